"""A backfill's collected results are matched to the page's segments as they are now (matching_run)."""

from __future__ import annotations

from worker.core.checkpoint import PrefixHasher, segment_ends, segment_hash, with_leading_orphan
from worker.core.conversation import parse_conversation_messages, split_into_segments
from worker.extraction.backfill_matching import matching_run
from worker.extraction.backfill_rows import RequestRow
from worker.extraction.planner import PagePlan


def conversation() -> str:
    """31 messages a minute apart (a full segment of 30 and one more), two hours' gap, then three."""
    lines = [f"**{'Alice' if i % 2 else 'Bob'}** (2024-03-15 9:{i:02d} AM): message {i}" for i in range(31)]
    lines += [f"**Alice** (2024-03-15 11:{i:02d} AM): later {i}" for i in range(3)]
    return "\n".join(lines)


def plan_from(messages, start: int) -> PagePlan:  # type: ignore[no-untyped-def]
    segments = split_into_segments(messages[start:])
    if start:
        segments = with_leading_orphan(messages[start - 1], messages[start:], segments)
    return PagePlan(
        1, "p", "p", PrefixHasher(messages), segments, segment_ends(messages, start, segments), None, False
    )


def test_a_resumed_page_commits_the_result_planned_before_its_lone_message_joined_the_next_segment() -> None:
    """Planned from the start, the 31st message (alone after a full segment) was dropped; a pass that
    died after committing the full segment resumed with it leading the next one: the same end, another
    hash, and the paid result of that segment was discarded (and paid for again by a later run)."""
    messages = parse_conversation_messages(conversation())
    fresh = plan_from(messages, 0)
    assert [len(s.messages) for s in fresh.segments] == [30, 3] and list(fresh.ends) == [30, 34]
    requests = [
        RequestRow(i, f"r{i}", 1, "p", end, segment_hash(segment), "pending")
        for i, (segment, end) in enumerate(zip(fresh.segments, fresh.ends, strict=True))
    ]
    resumed = plan_from(messages, 30)  # the full segment committed
    assert [len(s.messages) for s in resumed.segments] == [4] and list(resumed.ends) == [34]
    [(index, segment, row)] = matching_run(resumed, requests[1:])
    assert (index, row.id) == (0, 1) and segment.messages == fresh.segments[1].messages
    # A segment whose messages changed otherwise (an edit) still matches nothing.
    edited = RequestRow(9, "r9", 1, "p", 34, "0" * 64, "pending")
    assert matching_run(resumed, [edited]) == []


def test_a_message_an_edit_brought_within_the_gap_of_the_next_is_no_orphan() -> None:
    """Planned with a lone message an hour before the conversation (dropped), then edited to a minute
    before it: the segment now opens with it (no resumed page's orphan), and its request, planned without
    it, is not committed (the checkpoint would move past a message no run would send)."""
    conversation = [f"**Alice** (2024-03-15 11:{i:02d} AM): later {i}" for i in range(3)]
    planned = parse_conversation_messages("\n".join(["**Bob** (2024-03-15 9:00 AM): early", *conversation]))
    fresh = plan_from(planned, 0)
    assert [len(s.messages) for s in fresh.segments] == [3] and list(fresh.ends) == [4]
    request = RequestRow(1, "r1", 1, "p", 4, segment_hash(fresh.segments[0]), "pending")
    edited = parse_conversation_messages("\n".join(["**Bob** (2024-03-15 10:59 AM): early", *conversation]))
    now = plan_from(edited, 0)
    assert [len(s.messages) for s in now.segments] == [4] and list(now.ends) == [4]
    assert matching_run(now, [request]) == []
