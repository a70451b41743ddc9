"""Transcript reads for the API, the CLI and the MCP server, inside the caller's transaction: the
context view, the history in pages, the before/after counts and the list of recent transcripts."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from models import Compaction, Job, Transcript, TranscriptMessageRow
from models.tables import TRANSCRIPT_MESSAGES
from worker.compaction.queries import STORED_BYTES, context_now, get_transcript, load_timeline
from worker.core.compaction import estimate_tokens
from worker.core.paging import taken_within
from worker.core.timeline import ContextView, view_of
from worker.core.transcripts import TranscriptSettings
from worker.jobs.outbox import COMPACTION, PENDING

# The context view is refused past this many stored bytes. Compaction keeps a view under its window,
# but a transcript with no window (or compaction switched off, or every summary refused by the gate)
# grows without end, and a view of gigabytes would be loaded whole into the API for one request. No
# model takes 32 MiB of context (a million tokens is about 4 MiB of text).
MAX_CONTEXT_VIEW_BYTES = 32 * 1024 * 1024

# A page of messages stops at this many bytes (at least one message): a transcript of large tool
# results would otherwise load gigabytes into the API for one request of 10,000 messages.
MAX_MESSAGES_PAGE_BYTES = 8 * 1024 * 1024


def context_view(
    session: Session, transcript_id: str, *, max_bytes: int = MAX_CONTEXT_VIEW_BYTES
) -> ContextView:
    """What to send a model now: the newest accepted summary plus the messages after its cut, repaired.
    Raises ContextTooLargeError past ``max_bytes``."""
    return view_of(load_timeline(session, transcript_id, max_bytes=max_bytes))


def list_messages(
    session: Session,
    transcript_id: str,
    *,
    after_seq: int | None = None,
    limit: int = 1000,
    max_bytes: int = MAX_MESSAGES_PAGE_BYTES,
) -> tuple[list[TranscriptMessageRow], bool]:
    """The full history in seq order (compaction never deletes a message), paged by seq: up to
    ``limit`` messages and ``max_bytes``; and whether more follow."""
    get_transcript(session, transcript_id)
    after = -1 if after_seq is None else after_seq
    mine = (TRANSCRIPT_MESSAGES.c.transcript_id == transcript_id) & (TRANSCRIPT_MESSAGES.c.seq > after)
    sizes = session.execute(
        select(TRANSCRIPT_MESSAGES.c.seq, STORED_BYTES).where(mine).order_by("seq").limit(limit + 1)
    ).all()
    taken = taken_within([size for _, size in sizes[:limit]], max_bytes)
    if not taken:
        return [], False
    last = sizes[taken - 1][0]
    rows = session.scalars(
        select(TranscriptMessageRow)
        .where(TranscriptMessageRow.transcript_id == transcript_id)
        .where(TranscriptMessageRow.seq > after, TranscriptMessageRow.seq <= last)
        .order_by(TranscriptMessageRow.seq)
    )
    return list(rows), len(sizes) > taken


@dataclass(frozen=True)
class TranscriptStats:
    """Before/after in tokens: the full history against what the context view sends now."""

    transcript_id: str
    settings: TranscriptSettings
    messages: int
    history_tokens: int
    context_tokens: int
    summary_tokens: int
    compaction_id: int | None
    cut_seq: int | None
    pending_job_id: int | None
    created_at: Any = None
    updated_at: Any = None

    @property
    def saved_tokens(self) -> int:
        return self.history_tokens - self.context_tokens

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["settings"] = asdict(self.settings)
        data["trigger_tokens"] = self.settings.trigger_tokens
        data["saved_tokens"] = self.saved_tokens
        for key in ("created_at", "updated_at"):
            if data[key] is not None:
                data[key] = data[key].isoformat()
        return data


def recent_transcripts(session: Session, limit: int) -> list[dict[str, Any]]:
    """Transcripts, most recently changed first, with their message and token counts (their running
    totals: no message is read)."""
    query = (
        select(
            Transcript.id,
            Transcript.context_window,
            Transcript.message_count,
            Transcript.message_tokens,
            Transcript.updated_at,
        )
        .order_by(Transcript.updated_at.desc(), Transcript.id)
        .limit(limit)
    )
    return [
        {
            "transcript_id": tid,
            "context_window": window,
            "messages": int(count),
            "history_tokens": int(tokens),
            "updated_at": updated.isoformat(),
        }
        for tid, window, count, tokens, updated in session.execute(query)
    ]


def transcript_stats(session: Session, transcript_id: str) -> TranscriptStats:
    transcript = get_transcript(session, transcript_id)
    count, history = transcript.message_count, transcript.message_tokens
    summary, tokens = context_now(session, transcript_id)
    pending = session.scalar(
        select(Job.id).where(Job.kind == COMPACTION, Job.subject == transcript_id, Job.status.in_(PENDING))
    )
    return TranscriptStats(
        transcript_id=transcript_id,
        settings=TranscriptSettings.of(transcript),
        messages=int(count),
        history_tokens=int(history),
        context_tokens=tokens,
        summary_tokens=estimate_tokens(summary.marker()) if summary else 0,
        compaction_id=summary.compaction_id if summary else None,
        cut_seq=summary.cut_seq if summary else None,
        pending_job_id=pending,
        created_at=transcript.created_at,
        updated_at=transcript.updated_at,
    )


def measured_coverage(session: Session, compaction_id: int | None) -> float | None:
    """The coverage the gate measured for a compaction (what a label of it carries); None without one."""
    if compaction_id is None:
        return None
    return session.scalar(select(Compaction.coverage).where(Compaction.id == compaction_id))
