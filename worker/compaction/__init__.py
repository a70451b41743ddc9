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
from worker.compaction.job import KIND, compact_job, threshold_cache
from worker.compaction.prompts import LLM_PURPOSE, SUMMARIZE_LEAD, summarizer_request
from worker.compaction.queries import (
    AppendResult,
    CompactionRecord,
    SavedCompaction,
    TranscriptNotFoundError,
    TranscriptStats,
    TriggerCheck,
    append_messages,
    applied_summary,
    check_trigger,
    context_tokens,
    context_view,
    get_transcript,
    latest_user_texts,
    list_compactions,
    list_messages,
    load_timeline,
    request_compaction,
    transcript_stats,
    update_settings,
)
from worker.compaction.service import (
    PAUSED_REASON,
    CompactionDisabledError,
    CompactionOutcome,
    CompactionStatus,
    compact,
)
from worker.compaction.store import TranscriptStore
from worker.core.compaction_gate import (
    INTENT_TEXT_LIMIT,
    MAX_ATTEMPTS,
    MAX_MISSED_TERMS,
    MAX_TERM_LENGTH,
    GateResult,
    intent_terms,
    judge_summary,
    missed_query_terms,
)
from worker.core.timeline import (
    AppliedSummary,
    CompactionPlan,
    ContextView,
    NothingToCompactError,
    Timeline,
    ViewMessage,
    plan_compaction,
    view_of,
)
from worker.core.transcripts import (
    MAX_INSTRUCTIONS_LENGTH,
    MAX_MESSAGES_PER_REQUEST,
    MAX_TOKEN_SETTING,
    MAX_TOOL_CALL_ID_LENGTH,
    MAX_TRANSCRIPT_ID_LENGTH,
    SETTING_NAMES,
    MessageError,
    ToolUnit,
    TranscriptError,
    TranscriptSettings,
    check_transcript_id,
    clean_settings,
    link_tool_results,
    parse_message,
    parse_messages,
)

__all__ = [
    "INTENT_TEXT_LIMIT",
    "KIND",
    "LLM_PURPOSE",
    "MAX_ATTEMPTS",
    "MAX_INSTRUCTIONS_LENGTH",
    "MAX_MESSAGES_PER_REQUEST",
    "MAX_MISSED_TERMS",
    "MAX_TERM_LENGTH",
    "MAX_TOKEN_SETTING",
    "MAX_TOOL_CALL_ID_LENGTH",
    "MAX_TRANSCRIPT_ID_LENGTH",
    "PAUSED_REASON",
    "SETTING_NAMES",
    "SUMMARIZE_LEAD",
    "AppendResult",
    "AppliedSummary",
    "CompactionDisabledError",
    "CompactionOutcome",
    "CompactionPlan",
    "CompactionRecord",
    "CompactionStatus",
    "ContextView",
    "GateResult",
    "MessageError",
    "NothingToCompactError",
    "SavedCompaction",
    "Timeline",
    "ToolUnit",
    "TranscriptError",
    "TranscriptNotFoundError",
    "TranscriptSettings",
    "TranscriptStats",
    "TranscriptStore",
    "TriggerCheck",
    "ViewMessage",
    "append_messages",
    "applied_summary",
    "check_transcript_id",
    "check_trigger",
    "clean_settings",
    "compact",
    "compact_job",
    "compact_transcript",
    "context_tokens",
    "context_view",
    "get_transcript",
    "intent_terms",
    "judge_summary",
    "latest_user_texts",
    "link_tool_results",
    "list_compactions",
    "list_messages",
    "load_timeline",
    "missed_query_terms",
    "parse_message",
    "parse_messages",
    "plan_compaction",
    "request_compaction",
    "summarizer_request",
    "threshold_cache",
    "transcript_stats",
    "update_settings",
    "view_of",
]
