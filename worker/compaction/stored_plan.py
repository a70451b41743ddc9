"""A compaction's plan read from a transcript's stored rows: the kept tail's roles and tokens, then the
head's messages, each only as far as the pure planner asks (never the whole uncompacted history)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import bindparam, func, select
from sqlalchemy.orm import Session

from models.tables import TRANSCRIPT_MESSAGES
from worker.compaction.queries import TranscriptNotFoundError, applied_summary, settings_row
from worker.core.compaction import TranscriptMessage, estimate_tokens
from worker.core.timeline import AppliedSummary, CompactionPlan, plan_cut, plan_head
from worker.core.transcripts import TranscriptSettings, stored_message

# Rows read a page at a time: the kept tail (keep_recent_tokens) is a few hundred messages at most
# for the defaults, one page of roles and tokens; the head stops at the summarizer's input, and one of
# its pages loads at most HEAD_PAGE_BYTES of stored messages (or one message past it).
PAGE_ROWS = 500
HEAD_PAGE_BYTES = 8 * 1024 * 1024

_VIEW = TRANSCRIPT_MESSAGES.c
_IN_VIEW = (_VIEW.transcript_id == bindparam("id"), _VIEW.seq >= bindparam("start"))
_TOTALS = select(func.count(), func.coalesce(func.sum(_VIEW.tokens), 0), func.max(_VIEW.seq)).where(*_IN_VIEW)
_TAIL_PAGE = (
    select(_VIEW.seq, _VIEW.role, _VIEW.tokens)
    .where(*_IN_VIEW, _VIEW.seq < bindparam("before"))
    .order_by(_VIEW.seq.desc())
    .limit(PAGE_ROWS)
)
_HEAD_SIZES = (
    select(_VIEW.seq, _VIEW.stored_bytes)
    .where(*_IN_VIEW, _VIEW.seq < bindparam("before"))
    .order_by(_VIEW.seq)
    .limit(PAGE_ROWS)
)
_HEAD_PAGE = (
    select(_VIEW.seq, _VIEW.role, _VIEW.text, _VIEW.tool_calls, _VIEW.tool_call_id, _VIEW.tool_name)
    .where(*_IN_VIEW, _VIEW.seq < bindparam("before"))
    .order_by(_VIEW.seq)
)


@dataclass(frozen=True)
class StoredContext:
    """A transcript's context view as its stored totals tell it, before any message is read."""

    transcript_id: str
    settings: TranscriptSettings
    summary: AppliedSummary | None
    created_at: datetime | None  # an id erased and appended to again is another transcript
    tokens: int  # the summary marker's and every message's after its cut
    count: int  # messages after the cut (the marker not counted)
    end_seq: int  # the newest message's seq when read: later appends are not planned over


def stored_context(session: Session, transcript_id: str) -> StoredContext:
    row = settings_row(session, transcript_id)
    summary = applied_summary(session, transcript_id)
    start = summary.cut_seq if summary is not None else 0
    count, tokens, end_seq = (
        session.connection().execute(_TOTALS, {"id": transcript_id, "start": start}).one()
    )
    marker_tokens = estimate_tokens(summary.marker()) if summary is not None else 0
    return StoredContext(
        transcript_id,
        TranscriptSettings.of(row),
        summary,
        row.created_at,
        int(tokens) + marker_tokens,
        int(count),
        -1 if end_seq is None else int(end_seq),
    )


class StoredHistory:
    """The context view's roles and tokens (a TokenHistory), read from the newest message back a page at
    a time, only as far as the cut walk asks: the kept tail and one tool unit."""

    def __init__(self, session: Session, context: StoredContext) -> None:
        self._session = session
        self._context = context
        self._marker = context.summary.marker() if context.summary is not None else None
        self._offset = 1 if self._marker is not None else 0
        self._newest_first: list[tuple[int, str, int]] = []  # (seq, role, tokens)

    def __len__(self) -> int:
        return self._context.count + self._offset

    def role(self, index: int) -> str:
        return "user" if self._is_marker(index) else self._row(index)[1]

    def tokens(self, index: int) -> int:
        if self._is_marker(index):
            assert self._marker is not None
            return estimate_tokens(self._marker)
        return self._row(index)[2]

    def seq(self, index: int) -> int:
        return self._row(index)[0]

    def _is_marker(self, index: int) -> bool:
        return self._marker is not None and index == 0

    def _row(self, index: int) -> tuple[int, str, int]:
        back = len(self) - 1 - index
        while back >= len(self._newest_first):
            before = self._newest_first[-1][0] if self._newest_first else self._context.end_seq + 1
            rows = self._session.connection().execute(_TAIL_PAGE, _bounds(self._context, before=before)).all()
            if not rows:
                raise TranscriptNotFoundError(self._context.transcript_id)  # erased while it was read
            self._newest_first.extend((int(seq), str(role), int(tokens)) for seq, role, tokens in rows)
        return self._newest_first[back]


def _bounds(context: StoredContext, *, before: int, start: int | None = None) -> dict[str, object]:
    """The view's rows from ``start`` (the summary's cut) to before ``before``."""
    if start is None:
        start = context.summary.cut_seq if context.summary is not None else 0
    return {"id": context.transcript_id, "start": start, "before": before}


@dataclass(frozen=True)
class CompactionInput:
    """What a compaction reads, in one snapshot: the context's totals and, when it wanted one, its plan
    and the latest user texts its intent is read from."""

    context: StoredContext
    plan: CompactionPlan | None = None
    unplanned: str | None = None  # why there is no plan though one was wanted (NothingToCompactError)
    user_texts: list[str] = field(default_factory=list)


def plan_stored(
    session: Session, context: StoredContext, *, tool_result_limit: int, max_head_tokens: int | None
) -> CompactionPlan:
    """The plan ``plan_compaction`` makes of the whole timeline, read from the stored rows: memory holds
    the tail's roles and tokens and the head up to the summarizer's input, whatever the history's size.
    Raises NothingToCompactError as it does."""
    history = StoredHistory(session, context)
    settings = context.settings
    cut = plan_cut(history, settings.keep_recent_tokens, starts_with_summary=context.summary is not None)
    cut_seq = history.seq(cut)
    return plan_head(
        _head(session, context, cut_seq),
        cut,
        cut_seq,
        tokens_before=context.tokens,
        tool_result_limit=tool_result_limit,
        max_head_tokens=max_head_tokens,
    )


def _head(
    session: Session, context: StoredContext, cut_seq: int
) -> Iterator[tuple[TranscriptMessage, int | None]]:
    """The timeline before ``cut_seq``, oldest first: the summary marker, then the stored messages, a
    page of at most HEAD_PAGE_BYTES (or one message) at a time."""
    if context.summary is not None:
        yield context.summary.marker(), None
    start = context.summary.cut_seq if context.summary is not None else 0
    connection = session.connection()
    while start < cut_seq:
        sizes = connection.execute(_HEAD_SIZES, _bounds(context, start=start, before=cut_seq)).all()
        if not sizes:
            raise TranscriptNotFoundError(context.transcript_id)  # erased while it was read
        page_end, loaded = int(sizes[0][0]), 0
        for seq, size in sizes:
            if loaded and loaded + int(size) > HEAD_PAGE_BYTES:
                break
            page_end, loaded = int(seq), loaded + int(size)
        rows = connection.execute(_HEAD_PAGE, _bounds(context, start=start, before=page_end + 1)).all()
        for seq, role, text, calls, call_id, name in rows:
            yield stored_message(role, text, calls, call_id, name), int(seq)
        start = page_end + 1
