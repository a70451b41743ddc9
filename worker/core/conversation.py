"""Parse conversation pages into messages, split them into segments, and render segments for extraction."""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from itertools import compress, count, islice, pairwise, repeat
from operator import add, attrgetter, itemgetter, lt, sub
from typing import Final

DEFAULT_SEGMENT_GAP_MINUTES: Final = 30
DEFAULT_SEGMENT_MAX_MESSAGES: Final = 30
MIN_SEGMENT_MESSAGES: Final = 2
SEGMENT_TEXT_CHAR_LIMIT: Final = 6500
MAX_PAGE_BODY_BYTES: Final = 25 * 1024 * 1024
TRUNCATION_MARKER: Final = "\n…(truncated)"
# A speaker's name in the header is cut here (with "…"): names are not bounded by the parse, and a
# page of 30 bold "names" of 100 KB each rendered a 3 MB header with no message in it (the header is
# kept whole), sent on every try and past any batch's size estimate. No real name comes near.
HEADER_NAME_CHARS: Final = 200
# The page types whose body is a conversation (what extraction reads); `extraction.page_types` narrows them.
CONVERSATION_PAGE_TYPES: Final = ("conversation", "meeting", "slack", "email", "imessage")

__all__ = [
    "CONVERSATION_PAGE_TYPES",
    "DEFAULT_SEGMENT_GAP_MINUTES",
    "DEFAULT_SEGMENT_MAX_MESSAGES",
    "MAX_PAGE_BODY_BYTES",
    "MIN_SEGMENT_MESSAGES",
    "SEGMENT_TEXT_CHAR_LIMIT",
    "TRUNCATION_MARKER",
    "Message",
    "Segment",
    "check_page_types",
    "iter_conversation_messages",
    "narrow_page_types",
    "parse_conversation_messages",
    "render_segment_for_extraction",
    "split_into_segments",
]


def narrow_page_types(narrowed: str | None) -> tuple[str, ...]:
    """CONVERSATION_PAGE_TYPES, narrowed by a comma-separated `extraction.page_types` value if any. A
    stored value naming none of them (written past ``check_page_types``: by hand, or by a release before
    it) narrows nothing: read as no type, every job found nothing to extract and every changed page's
    facts were dropped as a type extraction does not read."""
    if not narrowed or not narrowed.strip():
        return CONVERSATION_PAGE_TYPES
    wanted = {t.strip().lower() for t in narrowed.split(",") if t.strip()}
    return tuple(t for t in CONVERSATION_PAGE_TYPES if t in wanted) or CONVERSATION_PAGE_TYPES


def check_page_types(value: str) -> None:
    """Refuse an `extraction.page_types` value naming a type extraction does not read, or none: it
    would narrow extraction to nothing, and storing a page of a type narrowed out drops its facts."""
    named = [t.strip().lower() for t in value.split(",") if t.strip()]
    unknown = [t for t in named if t not in CONVERSATION_PAGE_TYPES]
    if not named or unknown:
        what = f"{', '.join(map(repr, unknown))} is not one" if unknown else "it names none"
        raise ValueError(
            f"extraction.page_types must name some of {', '.join(CONVERSATION_PAGE_TYPES)} "
            f"(comma-separated); {what}. Unset it to extract every one of them."
        )


@dataclass(frozen=True, slots=True)
class Message:
    """One chat message; `timestamp` is its wall-clock time written as `YYYY-MM-DDTHH:MM:00Z`."""

    speaker: str
    timestamp: str
    text: str


@dataclass(frozen=True, slots=True)
class Segment:
    """A run of consecutive messages that is extracted as one unit.

    `participants` holds the speakers in first-seen order as a tuple, so a segment is
    immutable and hashable; compare it with `list(segment.participants)` where a list
    is expected.
    """

    messages: tuple[Message, ...]
    participants: tuple[str, ...]
    start_iso: str
    end_iso: str


# --- message lines -------------------------------------------------------------------
#
# A message line is `**Name** (YYYY-MM-DD H:MM AM): text`, matched against the whole
# body with one MULTILINE pattern rather than line by line: `_MESSAGE_LINE.split`
# then hands back every field in C, and the Python work is per column, not per line.
#
# The pattern is written so that matching it is the same as "strip the line, then
# match": `_WS` is whitespace other than a newline (Python's `\s` and `str.isspace`
# agree), so leading and trailing whitespace is skipped without crossing into the
# next line. `[0-9]` rather than `\d`, which would also accept non-ASCII digits.
#
# The pattern only accepts dates and times that exist, so a line such as
# `**A** (2024-13-01 9:00 AM): x` is not a message and stays a continuation line
# without any second pass. `_DATE` was checked against `datetime.date` for every
# YYYY-MM-DD with years 0000-9999, months 00-13 and days 00-32.
#
# A name starts and ends with a character that is neither a space nor `*`, and may
# hold `*` inside, in runs between two such characters (a masked number,
# `**+155****0135**`, as iMessage exports write a contact's): not `** ` or ` **`, so
# `**Note:** forwarded from **Bob** (…): x` stays text, not a message from a speaker
# `Note:** forwarded from **Bob`. Its ends keep the whitespace around it out of it, so
# matching stays linear in the line length on hostile input (bench/parse_segment.py).
_WS: Final = r"[^\S\n]"
_LEAP_YEAR: Final = r"(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:[02468][048]|[13579][26])00)"
_DATE: Final = (
    r"(?!0000)(?:"
    r"[0-9]{4}-(?:0[1-9]|1[0-2])-(?:0[1-9]|1[0-9]|2[0-8])"
    r"|[0-9]{4}-(?:0[13-9]|1[0-2])-(?:29|30)"
    r"|[0-9]{4}-(?:0[13578]|1[02])-31"
    rf"|{_LEAP_YEAR}-02-29)"
)
# 12-hour clock: hours 1-12 with AM/PM in any case; 24-hour clock: hours 0-23.
_CLOCK: Final = rf"(?:(?:0?[1-9]|1[0-2]):[0-5][0-9]{_WS}*[AaPp][Mm]|(?:[01]?[0-9]|2[0-3]):[0-5][0-9])"
_MESSAGE_LINE: Final = re.compile(
    rf"^{_WS}*\*\*{_WS}*(?P<speaker>[^\s*](?:(?:[^*\n]|(?<=[^\s*])\*+(?=[^\s*]))*?[^\s*])?){_WS}*\*\*{_WS}*"
    rf"\({_WS}*(?P<date>{_DATE}){_WS}+(?P<clock>{_CLOCK}){_WS}*\)"
    rf"{_WS}*:{_WS}*(?P<text>[^\n]*)",
    re.MULTILINE,
)
_SPEAKER, _DAY, _CLOCK_READING, _TEXT = (
    _MESSAGE_LINE.groupindex[name] for name in ("speaker", "date", "clock", "text")
)


def _clock_to_time(clock: str) -> str:
    """`6:07 PM` → `T18:07:00Z`, for a clock the pattern has already validated."""
    hour_text, _, rest = clock.partition(":")
    minute_text, meridiem = rest[:2], rest[2:].strip().upper()
    hour = int(hour_text)
    if meridiem:
        hour = hour % 12 + (12 if meridiem == "PM" else 0)
    return f"T{hour:02d}:{minute_text}:00Z"


def _continuation_lines(chunk: str) -> list[str]:
    return [stripped for line in chunk.split("\n") if (stripped := line.strip())]


# A byte-order mark (U+FEFF) at a line's start or end, among its whitespace: JavaScript's trim(), which
# the seed's parser applies to every line, removes it; Python's strip() does not (it is no space).
_EDGE_BOM: Final = re.compile(r"^([^\S\n]*)\ufeff+|\ufeff+(?=[^\S\n]*$)", re.MULTILINE)


def parse_conversation_messages(body: str) -> list[Message]:
    """Parse `**Name** (YYYY-MM-DD H:MM AM): text` lines into messages.

    Without AM/PM the time is read as 24-hour. Every other non-blank line (including a
    message line whose date or time does not exist) continues the previous message,
    joined with a newline; lines before the first message are dropped.
    """
    return list(iter_conversation_messages(body))


def iter_conversation_messages(body: str) -> Iterator[Message]:
    """The messages of ``parse_conversation_messages`` one at a time: a reader that needs only the first
    few (a commit checking that an appended page still holds what it extracted) holds none of the
    others (a 25 MiB page parses to about 112 MiB of messages)."""
    if "\ufeff" in body:  # rare: a page saved by an editor that writes one lost its first message
        body = _EDGE_BOM.sub(r"\1", body)
    # A page repeats the same few thousand clock readings (convert each one once) and the same few
    # speakers (share one string per name rather than one per message).
    times: dict[str, str] = {}
    names: dict[str, str] = {}
    matches = _MESSAGE_LINE.finditer(body)
    line = next(matches, None)
    while line is not None:
        following = next(matches, None)
        speaker, day, clock, text = line.group(_SPEAKER, _DAY, _CLOCK_READING, _TEXT)
        # What follows the line up to the next one (its newline alone, most often) continues its text.
        start, end = line.end(), following.start() if following is not None else len(body)
        if end - start > 1 or (end - start == 1 and body[start] != "\n"):
            extra = _continuation_lines(body[start:end])
            if extra:
                text = text.rstrip()
                text = "\n".join([text, *extra] if text else extra)
        time = times.get(clock)
        if time is None:
            time = times[clock] = _clock_to_time(clock)
        yield Message(names.setdefault(speaker, speaker), day + time, text.rstrip())
        line = following


# --- segments ------------------------------------------------------------------------

_ONE_MICROSECOND: Final = timedelta(microseconds=1)
_UNIX_EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)
_MICROS_PER_MINUTE: Final = 60_000_000
# Tail of every timestamp this module writes ("THH:MM:00Z") → microseconds into the
# day, so a canonical timestamp becomes an instant with two dict look-ups.
_MICROS_INTO_DAY: Final[dict[str, int]] = {
    f"T{hour:02d}:{minute:02d}:00Z": (hour * 60 + minute) * _MICROS_PER_MINUTE
    for hour in range(24)
    for minute in range(60)
}
_timestamp_of: Final = attrgetter("timestamp")
_speaker_of: Final = attrgetter("speaker")
_day_part: Final = itemgetter(slice(0, 10))
_time_part: Final = itemgetter(slice(10, None))
_CANONICAL_DAY: Final = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}")


def instant_micros(iso: str) -> int:
    """Microseconds since the Unix epoch for an ISO-8601 string; a naive time is UTC."""
    moment = datetime.fromisoformat(iso)
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return (moment - _UNIX_EPOCH) // _ONE_MICROSECOND


def _day_micros(day: str) -> int | None:
    if not _CANONICAL_DAY.fullmatch(day):
        return None
    try:
        return instant_micros(day)
    except ValueError:
        return None


def _message_instants(messages: Sequence[Message]) -> list[int]:
    """Each message's instant in µs since the Unix epoch, exact (so comparisons never round)."""
    timestamps = list(map(_timestamp_of, messages))
    days = list(map(_day_part, timestamps))
    times = list(map(_time_part, timestamps))
    day_micros = {day: _day_micros(day) for day in set(days)}
    if None not in day_micros.values() and _MICROS_INTO_DAY.keys() >= set(times):
        # Every timestamp has the canonical shape parse_conversation_messages writes.
        return list(map(add, map(day_micros.__getitem__, days), map(_MICROS_INTO_DAY.__getitem__, times)))
    instants = []
    for index, timestamp in enumerate(timestamps):
        try:
            instants.append(instant_micros(timestamp))
        except ValueError:
            raise ValueError(
                f"message {index} has timestamp {timestamp!r}, which is not ISO-8601; "
                "expected e.g. '2024-03-15T09:00:00Z'"
            ) from None
    return instants


def segment_of(messages: Sequence[Message]) -> Segment:
    """These consecutive messages as one segment (how split_into_segments builds each of its own)."""
    return _segment(messages)


def _segment(messages: Sequence[Message]) -> Segment:
    return Segment(
        messages=tuple(messages),
        participants=tuple(dict.fromkeys(map(_speaker_of, messages))),
        start_iso=messages[0].timestamp,
        end_iso=messages[-1].timestamp,
    )


def split_into_segments(
    messages: Sequence[Message],
    *,
    gap_minutes: float = DEFAULT_SEGMENT_GAP_MINUTES,
    max_messages: int = DEFAULT_SEGMENT_MAX_MESSAGES,
    since_iso: str | None = None,
) -> list[Segment]:
    """Split messages into segments, cutting where the gap to the previous message exceeds `gap_minutes`.

    Only messages strictly after `since_iso` (any ISO-8601 form; naive means UTC) take
    part. A message earlier than the one before it (out of order) never cuts. A segment
    that reaches `max_messages` is closed and the next message opens a new one whatever
    its gap. Segments with fewer than MIN_SEGMENT_MESSAGES messages are dropped.
    """
    if max_messages < 1:
        raise ValueError(f"max_messages must be at least 1, got {max_messages}")
    if gap_minutes < 0:
        raise ValueError(f"gap_minutes must not be negative, got {gap_minutes}")
    instants = _message_instants(messages)
    if since_iso is not None:
        try:
            since = instant_micros(since_iso.strip())
        except ValueError:
            raise ValueError(
                f"since_iso {since_iso!r} is not an ISO-8601 timestamp; "
                "use e.g. '2024-03-15T23:00:00Z' or '2024-03-15T23:00:00+02:00'"
            ) from None
        after_since = list(map(lt, repeat(since), instants))
        messages = list(compress(messages, after_since))
        instants = list(compress(instants, after_since))

    # Runs are maximal stretches with no gap over the limit. Closing a full segment
    # restarts the gap clock, so within a run segments are simply consecutive
    # max_messages-sized chunks counted from the run's first message.
    gap = gap_minutes * _MICROS_PER_MINUTE
    long_gap_before = map(lt, repeat(gap), map(sub, islice(instants, 1, None), instants))
    run_starts = [0, *compress(count(1), long_gap_before), len(instants)]
    segments: list[Segment] = []
    for run_start, run_end in pairwise(run_starts):
        for start in range(run_start, run_end, max_messages):
            end = min(start + max_messages, run_end)
            if end - start >= MIN_SEGMENT_MESSAGES:
                segments.append(_segment(messages[start:end]))
    return segments


# --- rendering -----------------------------------------------------------------------


def _header_name(name: str) -> str:
    return name if len(name) <= HEADER_NAME_CHARS else name[: HEADER_NAME_CHARS - 1] + "…"


def _join_names(names: Sequence[str]) -> str:
    if len(names) <= 1:
        return "".join(names)
    return f"{', '.join(names[:-1])} and {names[-1]}"


def render_segment_for_extraction(page_label: str, segment: Segment) -> str:
    """Render a segment as extractor input: a context header, then one line per message.

    Past SEGMENT_TEXT_CHAR_LIMIT characters the message lines are cut (at a line break
    when one fits) and TRUNCATION_MARKER is appended. The header is always kept whole,
    so only a header that is itself over the limit makes the result longer than
    SEGMENT_TEXT_CHAR_LIMIT + len(TRUNCATION_MARKER); its speakers' names are cut at
    HEADER_NAME_CHARS each, so that is a long page label's doing.
    """
    if segment.participants:
        between = f"Conversation between {_join_names([_header_name(n) for n in segment.participants])}"
    else:
        between = "Conversation"
    header = f"Page: {page_label}\n{between} from {segment.start_iso} to {segment.end_iso}\n---\n"
    # Only as much text as the cut can keep, and the character after it: the whole of 30 long messages
    # (a 25 MiB page's email bodies) was joined to keep 6,500 characters of it, on every pipe thread.
    room = max(0, SEGMENT_TEXT_CHAR_LIMIT - len(header))
    lines, length = [], -1
    for message in segment.messages:
        lines.append(f"{message.speaker} ({message.timestamp}): {message.text[: room + 1]}")
        length += len(lines[-1]) + 1
        if length > room:
            break
    body = "\n".join(lines)
    if len(header) + len(body) <= SEGMENT_TEXT_CHAR_LIMIT:
        return header + body
    budget = max(0, SEGMENT_TEXT_CHAR_LIMIT - len(header))
    kept = body[:budget]
    # Prefer ending on a whole line: a message cut mid-sentence can read as a
    # different claim ("I will not sign" → "I will").
    if budget < len(body) and body[budget] != "\n" and (last_break := kept.rfind("\n")) > 0:
        kept = kept[:last_break]
    return header + kept + TRUNCATION_MARKER


def segment_bytes(segment: Segment, label: str = "") -> int:
    """An upper bound on a segment's bytes in a batched request: its rendering (the page's label in its
    header, then its lines, cut at SEGMENT_TEXT_CHAR_LIMIT characters of 4 bytes at most), in UTF-8,
    doubled for JSON's escapes (a newline or a quote is two bytes), and 4 more for each control
    character (written \\u00XX: six bytes)."""
    text = sum(len(m.text.encode()) + len(m.speaker.encode()) + 40 for m in segment.messages)
    # The header's names (each cut at HEADER_NAME_CHARS characters), kept whole beside the cut lines.
    names = sum(min(len(n.encode()), HEADER_NAME_CHARS * 4) + 5 for n in segment.participants)
    controls = sum(len(_CONTROL.findall(m.text)) + len(_CONTROL.findall(m.speaker)) for m in segment.messages)
    # Cut as the text is: a paste of 100,000 tabs counted 400 KB the rendering never held, and a batch
    # that took less held no request at all (every page after it waited, run after run).
    controls = min(controls, SEGMENT_TEXT_CHAR_LIMIT + HEADER_NAME_CHARS * len(segment.participants))
    return (min(text, SEGMENT_TEXT_CHAR_LIMIT * 4) + names + len(label.encode())) * 2 + 4 * controls + 512


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
