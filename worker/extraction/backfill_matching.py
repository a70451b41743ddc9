"""Which of a backfill's requests still ask for a page's segments as they are now (sending, collecting)."""

from __future__ import annotations

from collections.abc import Sequence

from worker.core.checkpoint import segment_hash
from worker.core.conversation import (
    DEFAULT_SEGMENT_GAP_MINUTES,
    MIN_SEGMENT_MESSAGES,
    Segment,
    instant_micros,
    segment_of,
)
from worker.extraction.backfill_rows import RequestRow
from worker.extraction.planner import PagePlan


def group_by_page(rows: Sequence[RequestRow]) -> list[tuple[tuple[int, str], list[RequestRow]]]:
    """Requests grouped by page, pages and segments in the order given (page order)."""
    groups: dict[tuple[int, str], list[RequestRow]] = {}
    for row in rows:
        groups.setdefault((row.page_id, row.slug), []).append(row)
    return list(groups.items())


def matching_run(plan: PagePlan, rows: Sequence[RequestRow]) -> list[tuple[int, Segment, RequestRow]]:
    """(index, segment, request) for the page's requests that still ask for its segments as they are
    now, from its next segment on and without a gap: results commit in order, so one after a gap (an
    edit inside an earlier segment) could only be paid for and discarded."""
    by_end = {row.end_message: row for row in rows}
    run: list[tuple[int, Segment, RequestRow]] = []
    for index, segment in enumerate(plan.segments):
        row = by_end.get(plan.ends[index])
        if row is None:
            break
        if row.segment_hash != segment_hash(segment):
            # Planned from the page's start, a conversation's lone last message after a full segment was
            # dropped; resumed past that segment, it leads the next one (worker.core.checkpoint's
            # with_leading_orphan), which then matched no request: a paid result discarded, paid again.
            # The request as planned is committed: the message is dropped as the plan dropped it.
            planned = _without_leading_orphan(segment) if index == 0 else None
            if planned is None or row.segment_hash != segment_hash(planned):
                break
            segment = planned
        run.append((index, segment, row))
    return run


def _without_leading_orphan(segment: Segment) -> Segment | None:
    """The segment without its first message when that message was a lone one a gap follows (as
    with_leading_orphan joins one to a resumed page's first segment); else None. A message that an edit
    brought within the gap of the next is no orphan: the page's full plan sends it with them."""
    messages = segment.messages
    if len(messages) <= MIN_SEGMENT_MESSAGES:
        return None
    gap = instant_micros(messages[1].timestamp) - instant_micros(messages[0].timestamp)
    if gap <= DEFAULT_SEGMENT_GAP_MINUTES * 60_000_000:  # microseconds
        return None
    return segment_of(messages[1:])
