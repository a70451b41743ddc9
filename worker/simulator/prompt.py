"""How the simulator reads a prompt: messages as text, the conversation segment, the fact cap, tokens."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

SEGMENT_OPEN = "<segment>"
SEGMENT_CLOSE = "</segment>"
UNTRUSTED_OPEN = "<untrusted-data>"
UNTRUSTED_CLOSE = "</untrusted-data>"
DEFAULT_MAX_FACTS = 10
# A prompt may lower or raise the cap; this ceiling keeps a silly number from producing a huge reply.
MAX_FACTS_CEILING = 100
CHARACTERS_PER_TOKEN = 4


def estimate_tokens(text: str) -> int:
    """About four characters a token, rounded up; the empty string is zero tokens."""
    return (len(text) + CHARACTERS_PER_TOKEN - 1) // CHARACTERS_PER_TOKEN


# --------------------------------------------------------------------------------------------------
# Prompt shape
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PromptMessage:
    """One message of a prompt, flattened to text (the wire layer turns content blocks into text)."""

    role: str
    text: str


@dataclass(frozen=True)
class SegmentMatch:
    """Where the conversation segment sits in a prompt."""

    message_index: int
    open_offset: int  # offset of "<segment>" inside that message's text
    content: str  # the text between the delimiters
    instructions: str  # every other word of the prompt: the only place a fact cap is read from


_MESSAGE_LINE = re.compile(
    r"^(?P<speaker>[^()\n]{1,200}?)\s*"
    r"\((?P<ts>\d{4}-\d{2}-\d{2}(?:[T ][0-9:.]+)?(?:Z|[+-]\d{2}:?\d{2})?)\):\s?(?P<text>.*)$"
)


def _looks_like_segment_start(content: str) -> bool:
    for line in content.split("\n"):
        stripped = line.strip()
        if not stripped:
            continue
        return stripped.startswith("Page:") or bool(_MESSAGE_LINE.match(stripped))
    return False


def _locate_segment(text: str) -> tuple[int, int, int] | None:
    """(open offset, content start, content end) of the segment in one message, or None.

    The segment is data and may itself contain the delimiters (a conversation about prompts, or an
    injection attempt), so the content runs to the LAST closing delimiter, and among several opening
    delimiters (instructions may mention the tag) the first one followed by a rendered segment wins.
    """
    close = text.rfind(SEGMENT_CLOSE)
    if close < 0:
        return None
    opens = [m.start() for m in re.finditer(re.escape(SEGMENT_OPEN), text[:close])]
    if not opens:
        return None
    for start in opens:
        content_start = start + len(SEGMENT_OPEN)
        if _looks_like_segment_start(text[content_start:close]):
            return start, content_start, close
    start = opens[-1]
    return start, start + len(SEGMENT_OPEN), close


def find_segment(messages: Sequence[PromptMessage]) -> SegmentMatch | None:
    """The conversation segment of a prompt: user messages searched last to first, then the others."""
    order = [i for i in reversed(range(len(messages))) if messages[i].role == "user"]
    order += [i for i in range(len(messages)) if messages[i].role != "user"]
    for index in order:
        text = messages[index].text
        located = _locate_segment(text)
        if located is None:
            continue
        open_offset, content_start, content_end = located
        outside = [m.text for i, m in enumerate(messages) if i != index]
        outside.append(text[:open_offset] + text[content_end + len(SEGMENT_CLOSE) :])
        return SegmentMatch(
            message_index=index,
            open_offset=open_offset,
            content=text[content_start:content_end],
            instructions="\n".join(outside),
        )
    return None


_FACT_CAP = re.compile(
    r"\b(?:at\s+most|up\s+to|no\s+more\s+than|maximum\s+of|max(?:imum)?)\s+(\d+)\s+facts?\b",
    re.IGNORECASE,
)


def requested_max_facts(instructions: str, default: int = DEFAULT_MAX_FACTS) -> int:
    """The cap a prompt asks for ("at most N facts"), else the default; clamped to [0, MAX_FACTS_CEILING]."""
    match = _FACT_CAP.search(instructions)
    value = int(match.group(1)) if match else default
    return max(0, min(MAX_FACTS_CEILING, value))


# --------------------------------------------------------------------------------------------------
# Segment parsing
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ConversationLine:
    speaker: str
    timestamp: str
    text: str


def parse_segment_lines(segment: str) -> list[ConversationLine]:
    """Message lines of a rendered segment; header lines are skipped, other lines continue the message."""
    lines: list[ConversationLine] = []
    # Rendered lines end at "\n" only (as the page's messages do): a U+2028 in a message is its text.
    in_body = "---" not in {raw.strip() for raw in segment.split("\n")}
    for raw in segment.split("\n"):
        line = raw.strip()
        if not in_body:
            if line == "---":
                in_body = True
            continue
        if not line or line == "…(truncated)":
            continue
        match = _MESSAGE_LINE.match(line)
        if match:
            speaker, timestamp, text = match["speaker"].strip(), match["ts"].strip(), match["text"].strip()
            lines.append(ConversationLine(speaker, timestamp, text))
        elif lines:
            last = lines[-1]
            joined = f"{last.text}\n{line}" if last.text else line
            lines[-1] = ConversationLine(last.speaker, last.timestamp, joined)
    return lines
