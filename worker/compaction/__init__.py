"""Compaction of long agent transcripts: store, service, prompts and the job kind (names re-exported here).

The flow: a client appends messages (``append_messages``); when the context a model would be sent
now (``context_view``: the newest accepted summary plus the messages after its cut) passes
``context_window - reserve_tokens``, a compaction job is requested in the same transaction (one
pending per transcript) and sent to the ``compaction`` queue after the commit. The job
(``compact_job`` → ``service.compact``) cuts the timeline with the pure core, asks the LLM for a
summary and gates it (see ``worker.compaction.service``). Messages are never deleted: a compaction
only adds a row, and the context view reads it.
"""

from __future__ import annotations

from worker.compaction.entry import compact_transcript
from worker.compaction.outcome import CompactionOutcome
from worker.compaction.queries import (
    ContextTooLargeError,
    TranscriptNotFoundError,
    append_messages,
    load_timeline,
    request_compaction,
    update_settings,
)
from worker.compaction.records import list_compactions
from worker.compaction.service import PAUSED_REASON, CompactionDisabledError
from worker.compaction.views import (
    MAX_CONTEXT_VIEW_BYTES,
    TranscriptStats,
    context_view,
    list_messages,
    recent_transcripts,
    transcript_stats,
)
from worker.core.compaction_gate import judge_summary
from worker.core.timeline import plan_compaction
from worker.core.transcripts import (
    MAX_MESSAGES_PER_REQUEST,
    MessageError,
    TranscriptError,
    check_transcript_id,
    parse_messages,
)

__all__ = [
    "MAX_CONTEXT_VIEW_BYTES",
    "MAX_MESSAGES_PER_REQUEST",
    "PAUSED_REASON",
    "CompactionDisabledError",
    "CompactionOutcome",
    "ContextTooLargeError",
    "MessageError",
    "TranscriptError",
    "TranscriptNotFoundError",
    "TranscriptStats",
    "append_messages",
    "check_transcript_id",
    "compact_transcript",
    "context_view",
    "judge_summary",
    "list_compactions",
    "list_messages",
    "load_timeline",
    "parse_messages",
    "plan_compaction",
    "recent_transcripts",
    "request_compaction",
    "transcript_stats",
    "update_settings",
]
