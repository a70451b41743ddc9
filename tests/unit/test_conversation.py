"""Tests for worker.core.conversation: pytest twins of seed 000's parsing, segmenting and rendering cases."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from itertools import pairwise

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from worker.core.conversation import (
    DEFAULT_SEGMENT_GAP_MINUTES,
    DEFAULT_SEGMENT_MAX_MESSAGES,
    HEADER_NAME_CHARS,
    MAX_PAGE_BODY_BYTES,
    MIN_SEGMENT_MESSAGES,
    SEGMENT_TEXT_CHAR_LIMIT,
    TRUNCATION_MARKER,
    Message,
    Segment,
    parse_conversation_messages,
    render_segment_for_extraction,
    segment_bytes,
    split_into_segments,
)
from worker.extraction.options import validate_since


def fmt(name: str, date: str, time_of_day: str, body: str) -> str:
    """The seed's fixture helper: one message line."""
    return f"**{name}** ({date} {time_of_day}): {body}"


def at(minute: int, speaker: str = "Alice Example", text: str | None = None) -> Message:
    """A message `minute` minutes after 2024-03-15 00:00 UTC, in the canonical timestamp form."""
    moment = datetime(2024, 3, 15, tzinfo=UTC) + timedelta(minutes=minute)
    return Message(speaker, moment.strftime("%Y-%m-%dT%H:%M:00Z"), text if text is not None else f"m{minute}")


# ---------------------------------------------------------------------------
# seed: parseConversationMessages
# ---------------------------------------------------------------------------


def test_parses_a_single_message_line() -> None:
    msgs = parse_conversation_messages(fmt("Alice Example", "2024-03-15", "6:07 PM", "hello"))
    assert msgs == [Message("Alice Example", "2024-03-15T18:07:00Z", "hello")]


def test_handles_am_pm_and_midnight_noon() -> None:
    body = "\n".join(
        [
            fmt("Bob Demo", "2024-03-15", "12:00 AM", "midnight"),
            fmt("Bob Demo", "2024-03-15", "12:30 PM", "noon"),
        ]
    )
    msgs = parse_conversation_messages(body)
    assert [m.timestamp for m in msgs] == ["2024-03-15T00:00:00Z", "2024-03-15T12:30:00Z"]


def test_treats_unmatched_lines_as_continuations_of_the_prior_message() -> None:
    body = "\n".join(
        [
            fmt("Alice Example", "2024-03-15", "9:00 AM", "first line"),
            "still part of the first message",
            fmt("Bob Demo", "2024-03-15", "9:01 AM", "separate message"),
        ]
    )
    msgs = parse_conversation_messages(body)
    assert len(msgs) == 2
    assert msgs[0].text == "first line\nstill part of the first message"
    assert msgs[1].text == "separate message"


def test_ignores_leading_orphan_lines_no_anchor_message_yet() -> None:
    body = "\n".join(["orphan one", "orphan two", fmt("Alice Example", "2024-03-15", "9:00 AM", "real")])
    msgs = parse_conversation_messages(body)
    assert msgs == [Message("Alice Example", "2024-03-15T09:00:00Z", "real")]


def test_empty_body_returns_empty_array() -> None:
    assert parse_conversation_messages("") == []


# ---------------------------------------------------------------------------
# seed: splitIntoSegments
# ---------------------------------------------------------------------------


def test_cuts_on_time_gap_larger_than_gap_minutes() -> None:
    msgs = parse_conversation_messages(
        "\n".join(
            [
                fmt("Alice Example", "2024-03-15", "9:00 AM", "a"),
                fmt("Bob Demo", "2024-03-15", "9:05 AM", "b"),
                # Gap of 90 minutes > default 30 → new segment.
                fmt("Alice Example", "2024-03-15", "10:35 AM", "c"),
                fmt("Bob Demo", "2024-03-15", "10:36 AM", "d"),
            ]
        )
    )
    segs = split_into_segments(msgs)
    assert [[m.text for m in s.messages] for s in segs] == [["a", "b"], ["c", "d"]]


def test_cuts_when_segment_reaches_max_messages_cap() -> None:
    lines = [fmt("Alice Example", "2024-03-15", f"9:{i:02d} AM", f"msg {i}") for i in range(7)]
    msgs = parse_conversation_messages("\n".join(lines))
    segs = split_into_segments(msgs, max_messages=3)
    # 7 messages / 3 per segment → 2 full + 1 leftover (dropped: < 2 messages).
    assert [[m.text for m in s.messages] for s in segs] == [
        ["msg 0", "msg 1", "msg 2"],
        ["msg 3", "msg 4", "msg 5"],
    ]
    assert all(len(s.messages) <= 3 for s in segs)


def test_drops_segments_shorter_than_the_minimum() -> None:
    msgs = parse_conversation_messages(fmt("Alice Example", "2024-03-15", "9:00 AM", "only one"))
    assert len(msgs) == 1
    assert split_into_segments(msgs) == []


def test_participants_array_preserves_first_seen_order() -> None:
    msgs = parse_conversation_messages(
        "\n".join(
            [
                fmt("Bob Demo", "2024-03-15", "9:00 AM", "b1"),
                fmt("Alice Example", "2024-03-15", "9:05 AM", "a1"),
                fmt("Bob Demo", "2024-03-15", "9:06 AM", "b2"),
            ]
        )
    )
    segs = split_into_segments(msgs)
    assert list(segs[0].participants) == ["Bob Demo", "Alice Example"]


def test_since_iso_filters_out_messages_older_than_the_watermark() -> None:
    msgs = parse_conversation_messages(
        "\n".join(
            [
                fmt("Alice Example", "2024-03-15", "9:00 AM", "old"),
                fmt("Bob Demo", "2024-03-15", "9:05 AM", "old"),
                fmt("Alice Example", "2024-03-16", "9:00 AM", "new"),
                fmt("Bob Demo", "2024-03-16", "9:05 AM", "new"),
            ]
        )
    )
    segs = split_into_segments(msgs, since_iso="2024-03-15T23:00:00Z")
    assert len(segs) == 1
    assert segs[0].start_iso == "2024-03-16T09:00:00Z"
    assert segs[0].end_iso == "2024-03-16T09:05:00Z"
    assert [m.text for m in segs[0].messages] == ["new", "new"]


def test_tuned_defaults_30_30_eng_v2_t5() -> None:
    assert DEFAULT_SEGMENT_GAP_MINUTES == 30
    assert DEFAULT_SEGMENT_MAX_MESSAGES == 30
    assert SEGMENT_TEXT_CHAR_LIMIT == 6500


# ---------------------------------------------------------------------------
# seed: renderSegmentForExtraction
# ---------------------------------------------------------------------------


def test_prepends_topical_temporal_context_header() -> None:
    msgs = parse_conversation_messages(
        "\n".join(
            [
                fmt("Alice Example", "2024-03-15", "9:00 AM", "hello"),
                fmt("Bob Demo", "2024-03-15", "9:05 AM", "hi back"),
            ]
        )
    )
    seg = split_into_segments(msgs)[0]
    text = render_segment_for_extraction("imessage: Alice Example", seg)
    assert "Page: imessage: Alice Example" in text
    assert "Conversation between Alice Example and Bob Demo" in text
    assert "2024-03-15T09:00:00Z" in text
    assert "2024-03-15T09:05:00Z" in text
    assert text == (
        "Page: imessage: Alice Example\n"
        "Conversation between Alice Example and Bob Demo from 2024-03-15T09:00:00Z to 2024-03-15T09:05:00Z\n"
        "---\n"
        "Alice Example (2024-03-15T09:00:00Z): hello\n"
        "Bob Demo (2024-03-15T09:05:00Z): hi back"
    )


def test_truncates_oversize_segments_but_keeps_the_header_intact() -> None:
    lines = []
    for i in range(500):
        mm, hh = f"{i % 60:02d}", f"{9 + i // 60:02d}"
        lines.append(f"**Alice Example** (2024-03-15 {hh}:{mm} AM): {'x' * 50}")
    msgs = parse_conversation_messages("\n".join(lines))
    # The seed writes hours 13-17 with AM, which are not times: those 260 lines
    # continue the 12:59 AM message instead of becoming messages of their own.
    assert len(msgs) == 240
    seg = split_into_segments(msgs, max_messages=500)[0]
    text = render_segment_for_extraction("big-page", seg)
    assert len(text) <= SEGMENT_TEXT_CHAR_LIMIT + 32
    assert text.startswith("Page: big-page")
    assert "Conversation between" in text
    assert text.endswith(TRUNCATION_MARKER)


# ---------------------------------------------------------------------------
# seed: body cap constant (Eng A2)
# ---------------------------------------------------------------------------


def test_max_page_body_bytes_is_25mb() -> None:
    assert MAX_PAGE_BODY_BYTES == 25 * 1024 * 1024


def test_other_constants() -> None:
    assert MIN_SEGMENT_MESSAGES == 2
    assert TRUNCATION_MARKER == "\n…(truncated)"


# ---------------------------------------------------------------------------
# parsing: beyond the seed
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("clock", "expected"),
    [("18:07", "18:07"), ("0:05", "00:05"), ("00:00", "00:00"), ("9:30", "09:30"), ("23:59", "23:59")],
)
def test_time_without_am_pm_is_24_hour(clock: str, expected: str) -> None:
    msgs = parse_conversation_messages(fmt("Alice", "2024-03-15", clock, "x"))
    assert [m.timestamp for m in msgs] == [f"2024-03-15T{expected}:00Z"]


@pytest.mark.parametrize(
    ("clock", "expected"),
    [
        ("6:07 pm", "18:07"),
        ("12:15 am", "00:15"),
        ("12:00 pm", "12:00"),
        ("11:59 Pm", "23:59"),
        ("1:00 aM", "01:00"),
    ],
)
def test_am_pm_is_case_insensitive(clock: str, expected: str) -> None:
    msgs = parse_conversation_messages(fmt("Alice", "2024-03-15", clock, "x"))
    assert [m.timestamp for m in msgs] == [f"2024-03-15T{expected}:00Z"]


def test_am_pm_without_space_and_zero_padded_hour() -> None:
    msgs = parse_conversation_messages("**Alice** (2024-03-15 09:05PM): x")
    assert msgs == [Message("Alice", "2024-03-15T21:05:00Z", "x")]


@pytest.mark.parametrize("name", ["Zoë Ångström", "李小龙", "Дмитрий Иванов", "O'Brien-Smith Jr.", "محمد"])
def test_unicode_names(name: str) -> None:
    body = "\n".join([fmt(name, "2024-03-15", "9:00 AM", "hej"), fmt("Bob", "2024-03-15", "9:01 AM", "hi")])
    msgs = parse_conversation_messages(body)
    assert [m.speaker for m in msgs] == [name, "Bob"]
    assert list(split_into_segments(msgs)[0].participants) == [name, "Bob"]


def test_blank_lines_are_skipped() -> None:
    body = "\n".join(
        [
            "",
            fmt("Alice", "2024-03-15", "9:00 AM", "a"),
            "",
            "   ",
            "more of a",
            "\t",
            "and more",
            "",
            fmt("Bob", "2024-03-15", "9:01 AM", "b"),
            "",
        ]
    )
    assert parse_conversation_messages(body) == [
        Message("Alice", "2024-03-15T09:00:00Z", "a\nmore of a\nand more"),
        Message("Bob", "2024-03-15T09:01:00Z", "b"),
    ]


def test_crlf_line_endings() -> None:
    body = "\r\n".join(
        [
            fmt("Alice", "2024-03-15", "9:00 AM", "a"),
            "  continued  ",
            "",
            fmt("Bob", "2024-03-15", "9:01 AM", "b"),
        ]
    )
    assert parse_conversation_messages(body + "\r\n") == [
        Message("Alice", "2024-03-15T09:00:00Z", "a\ncontinued"),
        Message("Bob", "2024-03-15T09:01:00Z", "b"),
    ]


def test_lines_are_stripped_before_matching() -> None:
    body = (
        "   "
        + fmt("Alice", "2024-03-15", "9:00 AM", "  padded text  ")
        + "  \n\t"
        + fmt("Bob", "2024-03-15", "9:01 AM", "b")
    )
    assert parse_conversation_messages(body) == [
        Message("Alice", "2024-03-15T09:00:00Z", "padded text"),
        Message("Bob", "2024-03-15T09:01:00Z", "b"),
    ]


@pytest.mark.parametrize(
    ("date", "clock"),
    [
        ("2024-13-15", "9:00 AM"),  # month 13
        ("2024-00-15", "9:00 AM"),  # month 0
        ("2024-02-30", "9:00 AM"),  # no such day
        ("2023-02-29", "9:00 AM"),  # not a leap year
        ("1900-02-29", "9:00 AM"),  # century, not a leap year
        ("2024-04-31", "9:00 AM"),
        ("0000-01-01", "9:00 AM"),  # no year 0
        ("2024-03-15", "25:00"),  # 24-hour clock past 23
        ("2024-03-15", "24:00"),
        ("2024-03-15", "13:00 PM"),  # 12-hour clock past 12
        ("2024-03-15", "0:30 AM"),  # 12-hour clock before 1
        ("2024-03-15", "9:60 AM"),  # minute 60
        ("2024-03-15", "9:60"),
    ],
)
def test_invalid_dates_and_times_are_continuation_lines(date: str, clock: str) -> None:
    bad = fmt("Bob", date, clock, "not a message")
    body = "\n".join(
        [fmt("Alice", "2024-03-15", "9:00 AM", "a"), bad, fmt("Carol", "2024-03-15", "9:02 AM", "c")]
    )
    assert parse_conversation_messages(body) == [
        Message("Alice", "2024-03-15T09:00:00Z", f"a\n{bad}"),
        Message("Carol", "2024-03-15T09:02:00Z", "c"),
    ]


@pytest.mark.parametrize("date", ["2024-02-29", "2000-02-29", "2023-12-31", "2023-04-30"])
def test_edge_dates_that_exist_are_messages(date: str) -> None:
    assert parse_conversation_messages(fmt("Alice", date, "9:00 AM", "x")) == [
        Message("Alice", f"{date}T09:00:00Z", "x")
    ]


def test_invalid_time_before_any_message_is_dropped() -> None:
    body = "\n".join(
        [fmt("Bob", "2024-13-01", "9:00 AM", "nope"), fmt("Alice", "2024-03-15", "9:00 AM", "a")]
    )
    assert parse_conversation_messages(body) == [Message("Alice", "2024-03-15T09:00:00Z", "a")]


def test_message_with_empty_text_takes_its_first_continuation_as_text() -> None:
    body = "\n".join(
        [
            "**Alice** (2024-03-15 9:00 AM):",
            "",
            "the actual text",
            "second line",
            "**Bob** (2024-03-15 9:01 AM):   ",
        ]
    )
    assert parse_conversation_messages(body) == [
        Message("Alice", "2024-03-15T09:00:00Z", "the actual text\nsecond line"),
        Message("Bob", "2024-03-15T09:01:00Z", ""),
    ]


def test_markdown_that_is_not_a_message_line_is_text() -> None:
    body = "\n".join(
        [
            fmt("Alice", "2024-03-15", "9:00 AM", "list:"),
            "**Note** this is bold, not a speaker",
            "**Bob** (tomorrow): also not a message",
            "** Bob** (2024-03-15 9:01 AM: no closing parenthesis before the colon",
            "**Note:** forwarded from **Bob** (2024-03-15 9:01 AM): bold prose, not a speaker",
            "**Alice** (2024-03-15 9:02 AM) said to **Bob** (2024-03-15 9:03 AM): nor this",
        ]
    )
    msgs = parse_conversation_messages(body)
    assert len(msgs) == 1
    assert msgs[0].text.splitlines()[1:] == body.splitlines()[1:]


def test_a_name_may_hold_stars_inside_as_a_masked_number_does() -> None:
    """An iMessage export writes a contact without a name as a masked number: a name could not hold
    `*`, so its line was text, and what the contact said was read as the previous speaker's
    (gbrain reads the shortest name the rest of the line matches)."""
    body = "\n".join(
        [
            fmt("Alice Example", "2024-03-15", "9:38 AM", "Call me later"),
            fmt("+155****0135", "2024-03-15", "9:39 AM", "Will do, I am moving to Oslo in May"),
            fmt("A*B", "2024-03-15", "9:40 AM", "x"),
        ]
    )
    assert [(m.speaker, m.text) for m in parse_conversation_messages(body)] == [
        ("Alice Example", "Call me later"),
        ("+155****0135", "Will do, I am moving to Oslo in May"),
        ("A*B", "x"),
    ]


def test_a_message_line_does_not_span_lines() -> None:
    body = "\n".join(
        [
            fmt("Alice", "2024-03-15", "9:00 AM", "a"),
            "**Bob**",
            "(2024-03-15 9:01 AM): split header",
            "**Carol** (2024-03-15",
            "9:02 AM): also split",
        ]
    )
    continuation = "\n".join(body.split("\n")[1:])
    assert parse_conversation_messages(body) == [
        Message("Alice", "2024-03-15T09:00:00Z", f"a\n{continuation}")
    ]


def test_name_is_trimmed_inside_the_stars() -> None:
    assert parse_conversation_messages("** Alice Example ** ( 2024-03-15 9:00 AM ) :  hi") == [
        Message("Alice Example", "2024-03-15T09:00:00Z", "hi")
    ]


@pytest.mark.parametrize(
    "body",
    [
        "\ufeff**A** (2024-03-15 9:00 AM): hi\n**B** (2024-03-15 9:01 AM): yo",  # a file's BOM
        "**A** (2024-03-15 9:00 AM): hi \ufeff\n \ufeff**B** (2024-03-15 9:01 AM): yo\ufeff",
    ],
)
def test_a_byte_order_mark_is_trimmed_with_the_line(body: str) -> None:
    """The seed trims every line with JavaScript's trim(), which removes U+FEFF; Python's strip() does
    not: a page sent with a BOM lost its first message as a line before any message."""
    assert parse_conversation_messages(body) == [
        Message("A", "2024-03-15T09:00:00Z", "hi"),
        Message("B", "2024-03-15T09:01:00Z", "yo"),
    ]
    # Inside a line it is text (a zero-width no-break space), kept as written.
    [message] = parse_conversation_messages("**A** (2024-03-15 9:00 AM): z\ufeffw")
    assert message.text == "z\ufeffw"


def test_hostile_lines_continue_the_message_before_them() -> None:
    # Shapes that make a careless pattern backtrack quadratically.
    n = 200_000
    body = "\n".join(
        [
            fmt("Alice", "2024-03-15", "9:00 AM", "a"),
            "**a" + " " * n + "b",
            "**" + " " * n,
            "** a" + " a" * (n // 2) + " **",
            "**a** (2024-03-15" + " " * n + "9:00",
        ]
    )
    # Their time is measured in bench/parse_segment.py (hostile lines); here, what they parse to.
    [message] = parse_conversation_messages(body)
    assert message.text.startswith("a\n**a")


# ---------------------------------------------------------------------------
# segmenting: beyond the seed
# ---------------------------------------------------------------------------


def test_gap_of_exactly_gap_minutes_does_not_cut() -> None:
    segs = split_into_segments([at(0), at(30), at(60)])
    assert [[m.text for m in s.messages] for s in segs] == [["m0", "m30", "m60"]]


def test_gap_of_one_minute_more_cuts() -> None:
    segs = split_into_segments([at(0), at(1), at(32), at(33)])
    assert [[m.text for m in s.messages] for s in segs] == [["m0", "m1"], ["m32", "m33"]]


def test_custom_gap_minutes() -> None:
    msgs = [at(0), at(5), at(11), at(12)]
    assert len(split_into_segments(msgs, gap_minutes=5)) == 2
    assert len(split_into_segments(msgs, gap_minutes=6)) == 1


def test_out_of_order_timestamps_never_cut() -> None:
    # 10:00, then a message stamped a day earlier, then 09:10 the same day as the first.
    msgs = [at(600, text="a"), at(600 - 1440, text="b"), at(-1440 + 10, text="c")]
    segs = split_into_segments(msgs)
    assert [[m.text for m in s.messages] for s in segs] == [["a", "b", "c"]]
    assert (segs[0].start_iso, segs[0].end_iso) == (msgs[0].timestamp, msgs[-1].timestamp)


def test_gap_is_measured_from_the_previous_message_even_when_it_was_out_of_order() -> None:
    msgs = [at(600, text="a"), at(100, text="b"), at(600, text="c"), at(601, text="d")]
    segs = split_into_segments(msgs)
    # b → c is 500 minutes forward: a cut, although c is no later than a.
    assert [[m.text for m in s.messages] for s in segs] == [["a", "b"], ["c", "d"]]


def test_max_messages_flush_restarts_the_gap_clock() -> None:
    msgs = [at(0), at(1), at(2), at(3), at(4), at(100), at(101)]
    segs = split_into_segments(msgs, max_messages=2)
    # Cut at 2 and 4 messages without any gap, then at the gap before 100.
    assert [[m.text for m in s.messages] for s in segs] == [["m0", "m1"], ["m2", "m3"], ["m100", "m101"]]
    # The message after a flush opens a new segment whatever its gap, and the next
    # gap is measured from it.
    segs = split_into_segments([at(0), at(1), at(200), at(201), at(202)], max_messages=2)
    assert [[m.text for m in s.messages] for s in segs] == [["m0", "m1"], ["m200", "m201"]]


def test_segment_fields() -> None:
    msgs = [at(0, "Bob"), at(1, "Alice"), at(2, "Bob"), at(3, "Carol")]
    (seg,) = split_into_segments(msgs)
    assert seg == Segment(
        messages=tuple(msgs),
        participants=("Bob", "Alice", "Carol"),
        start_iso=msgs[0].timestamp,
        end_iso=msgs[-1].timestamp,
    )


def test_since_is_strictly_after() -> None:
    msgs = [at(0), at(1), at(2), at(3)]
    (seg,) = split_into_segments(msgs, since_iso=msgs[1].timestamp)
    assert [m.text for m in seg.messages] == ["m2", "m3"]


@pytest.mark.parametrize(
    "since",
    [
        "2024-03-15T00:01:00Z",
        "2024-03-15T00:01:00+00:00",
        "2024-03-15T02:01:00+02:00",
        "2024-03-14T19:01:00-05:00",
        "2024-03-15T00:01:00",  # naive means UTC
        "2024-03-15 00:01",
        "2024-03-15T00:01:00.000Z",
    ],
)
def test_since_accepts_any_iso_8601_form(since: str) -> None:
    msgs = [at(0), at(1), at(2), at(3)]
    (seg,) = split_into_segments(msgs, since_iso=since)
    assert [m.text for m in seg.messages] == ["m2", "m3"]


def test_since_between_minutes_keeps_the_next_minute() -> None:
    msgs = [at(0), at(1), at(2), at(3)]
    (seg,) = split_into_segments(msgs, since_iso="2024-03-15T00:00:59.999999Z")
    assert [m.text for m in seg.messages] == ["m1", "m2", "m3"]


@pytest.fixture
def host_in_new_york(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("TZ", "America/New_York")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


@pytest.mark.usefixtures("host_in_new_york")
def test_naive_times_are_utc_whatever_the_host_time_zone() -> None:
    msgs = [at(0), at(1), at(2), Message("A", "2024-03-15T00:03:00", "naive")]
    (seg,) = split_into_segments(msgs, since_iso="2024-03-15T00:01:00")
    assert [m.text for m in seg.messages] == ["m2", "naive"]


@pytest.mark.parametrize("since", ["yesterday", "", "2024-13-01T00:00:00Z", "2024-03-15T25:00:00Z"])
def test_unparseable_since_is_a_clear_value_error(since: str) -> None:
    with pytest.raises(ValueError, match=r"since_iso .* is not an ISO-8601 timestamp"):
        split_into_segments([at(0), at(1)], since_iso=since)


def test_since_applies_before_segmenting() -> None:
    # Without since, m0 joins the first segment; with it, m1 alone would be dropped,
    # so the filter must run before cutting, not on finished segments.
    msgs = [at(0), at(1), at(2)]
    (seg,) = split_into_segments(msgs, since_iso=msgs[0].timestamp)
    assert [m.text for m in seg.messages] == ["m1", "m2"]


def test_message_timestamps_in_other_iso_forms() -> None:
    msgs = [
        Message("A", "2024-03-15T09:00:00Z", "a"),
        Message("B", "2024-03-15T11:20:00+02:00", "b"),  # 09:20 UTC
        Message("A", "2024-03-15T09:40:30", "c"),  # naive: UTC
        Message("B", "2024-03-15T10:30:00Z", "d"),  # 49.5 minutes later: cut
        Message("A", "2024-03-15T05:31:00-05:00", "e"),  # 10:31 UTC
    ]
    segs = split_into_segments(msgs)
    assert [[m.text for m in s.messages] for s in segs] == [["a", "b", "c"], ["d", "e"]]


def test_unparseable_message_timestamp_is_a_clear_value_error() -> None:
    with pytest.raises(ValueError, match=r"message 1 has timestamp 'soon'"):
        split_into_segments([at(0), Message("A", "soon", "x")])


def test_max_messages_below_one_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="max_messages must be at least 1"):
        split_into_segments([at(0), at(1)], max_messages=0)


def test_negative_gap_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="gap_minutes must not be negative"):
        split_into_segments([at(0), at(1)], gap_minutes=-1)


def test_empty_and_single_inputs() -> None:
    assert split_into_segments([]) == []
    assert split_into_segments([at(0)]) == []
    assert split_into_segments([at(0), at(1)], max_messages=1) == []


def test_accepts_a_tuple_of_messages() -> None:
    msgs = (at(0), at(1))
    assert split_into_segments(msgs)[0].messages == msgs


# ---------------------------------------------------------------------------
# rendering: beyond the seed
# ---------------------------------------------------------------------------


def test_header_with_three_participants() -> None:
    (seg,) = split_into_segments([at(0, "Ann"), at(1, "Ben"), at(2, "Cy"), at(3, "Ann")])
    text = render_segment_for_extraction("team", seg)
    assert text.splitlines()[:3] == [
        "Page: team",
        f"Conversation between Ann, Ben and Cy from {seg.start_iso} to {seg.end_iso}",
        "---",
    ]


def test_header_with_one_participant() -> None:
    (seg,) = split_into_segments([at(0, "Ann"), at(1, "Ann")])
    text = render_segment_for_extraction("notes", seg)
    assert text.splitlines()[1] == f"Conversation between Ann from {seg.start_iso} to {seg.end_iso}"


def test_message_lines_keep_multiline_text() -> None:
    (seg,) = split_into_segments([at(0, "Ann", "one\ntwo"), at(1, "Ben", "three")])
    text = render_segment_for_extraction("p", seg)
    assert text.split("---\n", 1)[1] == f"Ann ({seg.start_iso}): one\ntwo\nBen ({seg.end_iso}): three"


def _segment_rendering_to(length: int) -> Segment:
    """A two-message segment whose rendering is exactly `length` characters."""
    first, second = at(0, "A", ""), at(1, "B", "")
    base = len(
        render_segment_for_extraction(
            "p", Segment((first, second), ("A", "B"), first.timestamp, second.timestamp)
        )
    )
    second = Message("B", second.timestamp, "y" * (length - base))
    return Segment((first, second), ("A", "B"), first.timestamp, second.timestamp)


def test_render_at_the_limit_is_not_truncated() -> None:
    text = render_segment_for_extraction("p", _segment_rendering_to(SEGMENT_TEXT_CHAR_LIMIT))
    assert len(text) == SEGMENT_TEXT_CHAR_LIMIT
    assert not text.endswith(TRUNCATION_MARKER)


def test_render_one_over_the_limit_is_truncated() -> None:
    text = render_segment_for_extraction("p", _segment_rendering_to(SEGMENT_TEXT_CHAR_LIMIT + 1))
    assert text.endswith(TRUNCATION_MARKER)
    assert len(text) <= SEGMENT_TEXT_CHAR_LIMIT + 32


def test_truncation_keeps_header_and_cuts_at_a_line_break() -> None:
    msgs = [at(i, "Ann" if i % 2 else "Ben", f"message {i} " + "z" * 90) for i in range(200)]
    (seg,) = split_into_segments(msgs, max_messages=200)
    text = render_segment_for_extraction("long", seg)
    header = f"Page: long\nConversation between Ben and Ann from {seg.start_iso} to {seg.end_iso}\n---\n"
    assert text.startswith(header)
    assert text.endswith(TRUNCATION_MARKER)
    assert SEGMENT_TEXT_CHAR_LIMIT - 200 < len(text) <= SEGMENT_TEXT_CHAR_LIMIT + len(TRUNCATION_MARKER)
    kept_lines = text[len(header) : -len(TRUNCATION_MARKER)].split("\n")
    full_lines = [f"{m.speaker} ({m.timestamp}): {m.text}" for m in msgs]
    assert kept_lines == full_lines[: len(kept_lines)]


def test_truncation_cuts_inside_a_single_huge_message() -> None:
    (seg,) = split_into_segments([at(0, "Ann", "w" * 20_000), at(1, "Ben", "short")])
    text = render_segment_for_extraction("p", seg)
    assert len(text) == SEGMENT_TEXT_CHAR_LIMIT + len(TRUNCATION_MARKER)
    assert text.endswith("w" + TRUNCATION_MARKER)


def test_speakers_names_in_the_header_are_cut_so_a_segment_stays_near_its_limit() -> None:
    """Names are not bounded by the parse: thirty bold "names" of 100 KB rendered a 3 MB header with no
    message line in it, sent on every try."""
    body = "\n".join(f"**{str(n) * 100_000}** (2024-06-01 9:{n:02d} AM): hi" for n in range(10, 40))
    (seg,) = split_into_segments(parse_conversation_messages(body))
    text = render_segment_for_extraction("chat", seg)
    header = text.split("\n---\n")[0]
    assert len(header) < 30 * (HEADER_NAME_CHARS + 2) + 200
    assert f"{'10' * 99}1…, " in header and header.count("…") == 30
    (short,) = split_into_segments([at(0), at(1)])
    assert "Conversation between Alice Example from " in render_segment_for_extraction("chat", short)


def test_header_longer_than_the_limit_is_kept_whole() -> None:
    label = "L" * (SEGMENT_TEXT_CHAR_LIMIT + 100)
    (seg,) = split_into_segments([at(0), at(1)])
    text = render_segment_for_extraction(label, seg)
    assert text.startswith(f"Page: {label}\nConversation between Alice Example from ")
    assert text.endswith("\n---\n" + TRUNCATION_MARKER)


# ---------------------------------------------------------------------------
# properties
# ---------------------------------------------------------------------------

_gaps = st.one_of(st.integers(-90, -1), st.integers(0, 45), st.integers(46, 5000))


@settings(max_examples=300, deadline=None)
@given(
    deltas=st.lists(_gaps, max_size=60),
    gap_minutes=st.integers(0, 60),
    max_messages=st.integers(1, 8),
)
def test_segments_are_justified_contiguous_runs(
    deltas: list[int], gap_minutes: int, max_messages: int
) -> None:
    minutes = [0]
    for delta in deltas:
        minutes.append(minutes[-1] + delta)
    msgs = [at(minute, speaker=f"S{i % 3}", text=str(i)) for i, minute in enumerate(minutes)]
    segs = split_into_segments(msgs, gap_minutes=gap_minutes, max_messages=max_messages)

    # Rebuild the partition: kept segments plus each dropped message on its own.
    chunks: list[list[int]] = []
    covered: set[int] = set()
    for seg in segs:
        indices = [int(m.text) for m in seg.messages]
        assert indices == list(range(indices[0], indices[0] + len(indices))), "not a contiguous run"
        assert MIN_SEGMENT_MESSAGES <= len(indices) <= max_messages
        assert list(seg.participants) == list(dict.fromkeys(m.speaker for m in seg.messages))
        assert (seg.start_iso, seg.end_iso) == (seg.messages[0].timestamp, seg.messages[-1].timestamp)
        chunks.append(indices)
        covered.update(indices)
    assert [c[0] for c in chunks] == sorted(c[0] for c in chunks), "segments out of order"
    chunks += [[i] for i in range(len(msgs)) if i not in covered]
    chunks.sort()
    assert [i for chunk in chunks for i in chunk] == list(range(len(msgs)))

    for chunk in chunks:
        for a, b in pairwise(chunk):
            assert minutes[b] - minutes[a] <= gap_minutes, "a gap over the limit inside a segment"
    for left, right in pairwise(chunks):
        gap = minutes[right[0]] - minutes[left[-1]]
        assert gap > gap_minutes or len(left) == max_messages, (
            "a cut with neither a long gap nor a full segment"
        )


@settings(max_examples=100, deadline=None)
@given(deltas=st.lists(_gaps, max_size=40), since_offset=st.integers(-100, 3000))
def test_since_equals_splitting_the_messages_after_it(deltas: list[int], since_offset: int) -> None:
    minutes = [0]
    for delta in deltas:
        minutes.append(minutes[-1] + delta)
    msgs = [at(minute, text=str(i)) for i, minute in enumerate(minutes)]
    since = at(since_offset).timestamp
    expected = split_into_segments(
        [m for m, minute in zip(msgs, minutes, strict=True) if minute > since_offset]
    )
    assert split_into_segments(msgs, since_iso=since) == expected


# A plain line-by-line statement of the parsing contract, to check the whole-body parser against.
_REFERENCE_LINE = re.compile(
    r"\*\*\s*(?P<speaker>[^\s*](?:(?:[^*]|(?<=[^\s*])\*+(?=[^\s*]))*?[^\s*])?)\s*\*\*\s*\(\s*(?P<date>[0-9]{4}-[0-9]{2}-[0-9]{2})\s+"
    r"(?P<hour>[0-9]{1,2}):(?P<minute>[0-9]{2})(?:\s*(?P<meridiem>[AaPp][Mm]))?\s*\)\s*:\s*(?P<text>.*)"
)


def _reference_parse(body: str) -> list[Message]:
    messages: list[list[str]] = []
    for raw in body.split("\n"):
        line = raw.strip()
        if not line:
            continue
        match = _REFERENCE_LINE.fullmatch(line)
        timestamp = None
        if match:
            hour, minute, meridiem = (
                int(match["hour"]),
                int(match["minute"]),
                (match["meridiem"] or "").upper(),
            )
            if meridiem:
                hour = hour % 12 + (12 if meridiem == "PM" else 0) if 1 <= hour <= 12 else 99
            try:
                year, month, day = (int(part) for part in match["date"].split("-"))
                moment = datetime(year, month, day, hour, minute)
                timestamp = f"{match['date']}T{moment:%H:%M}:00Z"
            except ValueError:
                timestamp = None
        if match and timestamp:
            messages.append([match["speaker"], timestamp, match["text"]])
        elif messages:
            messages[-1][2] = f"{messages[-1][2]}\n{line}" if messages[-1][2] else line
    return [Message(*fields) for fields in messages]


_spaces = st.text(alphabet=" \t\r\x0b\x0c\x1c\x85\u00a0\u2028\u3000", max_size=2)
_names = st.text(alphabet=st.characters(exclude_characters="\n", exclude_categories=["Cs"]), max_size=8)
_clock = st.builds(
    lambda h, m, meridiem, space: f"{h}:{m:02d}{space}{meridiem}" if meridiem else f"{h}:{m:02d}",
    st.integers(0, 25),
    st.integers(0, 61),
    st.sampled_from(["", "AM", "PM", "am", "pM"]),
    st.sampled_from(["", " "]),
)
_date = st.builds(
    lambda y, mo, d: f"{y:04d}-{mo:02d}-{d:02d}",
    st.sampled_from([0, 1900, 2000, 2023, 2024]),
    st.integers(0, 13),
    st.integers(0, 32),
)
_message_line = st.builds(
    lambda lead, name, date, clock, text, trail: f"{lead}**{name}** ({date} {clock}): {text}{trail}",
    _spaces,
    _names,
    _date,
    _clock,
    _names,
    _spaces,
)
_other_line = st.one_of(
    st.text(alphabet=st.characters(exclude_characters="\n", exclude_categories=["Cs"]), max_size=12),
    _spaces,
    st.sampled_from(
        [
            "**",
            "**Bold** text",
            "** ** (2024-03-15 9:00 AM): x",
            "**Bob**",
            "(2024-03-15 9:00 AM): x",
            "**Bob** (2024-03-15",
            "9:00 AM): y",
        ]
    ),
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lines=st.lists(st.one_of(_message_line, _message_line, _other_line), max_size=12))
def test_parse_matches_a_line_by_line_reference(lines: list[str]) -> None:
    body = "\n".join(lines)
    assert parse_conversation_messages(body) == _reference_parse(body)


def _rendered_whole(page_label: str, segment: Segment) -> str:
    """The rendering as it was: every message joined, then cut (the reference for the one that stops);
    for a segment of Ann alone."""
    span = f"from {segment.start_iso} to {segment.end_iso}"
    header = f"Page: {page_label}\nConversation between Ann {span}\n---\n"
    body = "\n".join(f"{m.speaker} ({m.timestamp}): {m.text}" for m in segment.messages)
    if len(header) + len(body) <= SEGMENT_TEXT_CHAR_LIMIT:
        return header + body
    budget = max(0, SEGMENT_TEXT_CHAR_LIMIT - len(header))
    kept = body[:budget]
    if budget < len(body) and body[budget] != "\n" and (last_break := kept.rfind("\n")) > 0:
        kept = kept[:last_break]
    return header + kept + TRUNCATION_MARKER


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(
    texts=st.lists(st.one_of(st.text(max_size=40), st.text(min_size=3000, max_size=9000)), max_size=30),
    label=st.one_of(st.just("p"), st.text(min_size=6400, max_size=7000)),
)
def test_rendering_stops_reading_at_the_cut_and_renders_the_same(texts: list[str], label: str) -> None:
    """The whole of 30 long messages (a 25 MiB page's email bodies) was joined to keep 6,500 characters."""
    messages = tuple(Message("Ann", f"2024-01-01T10:{i:02d}:00Z", text) for i, text in enumerate(texts))
    segment = Segment(messages, ("Ann",), "2024-01-01T10:00:00Z", "2024-01-01T10:30:00Z")
    assert render_segment_for_extraction(label, segment) == _rendered_whole(label, segment)


@pytest.mark.parametrize("since", ["2024-03-15Z", "20240101Z", "yesterday", "2024-03-15T25:00:00Z"])
def test_a_since_the_segmenter_cannot_read_is_refused_before_any_run(since: str) -> None:
    """The run's check rewrote a Z before parsing, the segmenter did not: "2024-03-15Z" was accepted,
    then every page failed (a backfill's planning, five attempts, for good)."""
    with pytest.raises(ValueError, match="--since must be an ISO-8601 time"):
        validate_since(since)
    with pytest.raises(ValueError):
        split_into_segments([at(0), at(1)], since_iso=since)  # what the run would have met


@pytest.mark.parametrize("since", ["2024-03-15", "2024-03-15T00:00:00Z", " 2024-03-15T00:00:00+02:00 "])
def test_a_since_the_segmenter_reads_passes_the_check(since: str) -> None:
    validate_since(since)
    split_into_segments([at(0), at(1)], since_iso=since)


def test_segment_bytes_counts_control_characters_only_as_far_as_the_rendering_keeps_them() -> None:
    """A paste of 100,000 tabs a message counted 1.25 MB for a rendering of 6.5 KB: a batch of 1 MB held
    no request at all, and every page after it waited, run after run. Still an upper bound."""
    tabs = "\t" * 100_000
    messages = [Message("Ann", f"2024-03-10T09:0{i}:00Z", tabs) for i in range(3)]
    segment = Segment(messages, ["Ann"], messages[0].timestamp, messages[-1].timestamp)
    rendered = json.dumps(render_segment_for_extraction("chat: Ann", segment)).encode()
    assert len(rendered) <= segment_bytes(segment, "chat: Ann") < 100_000
