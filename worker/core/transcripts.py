"""Transcript input checks: ids, appended messages and their tool calls, tool-result links, settings."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol, cast

from worker.core.compaction import (
    DEFAULT_KEEP_RECENT_TOKENS,
    DEFAULT_RESERVE_TOKENS,
    DEFAULT_TOOL_RESULT_LIMIT,
    ROLES,
    Role,
    ToolCall,
    TranscriptMessage,
)
from worker.core.jsonvalues import json_integer, not_json, text_problem
from worker.core.labels import is_word_label, listed_names, quoted

MAX_TRANSCRIPT_ID_LENGTH: Final = 200
MAX_MESSAGES_PER_REQUEST: Final = 10_000
MAX_TOOL_CALL_ID_LENGTH: Final = 200
# Tool names as providers take them (OpenAI 64 characters, Anthropic 128), with room: a name was not
# counted in a transcript's stored bytes nor its tokens, so 25 MB names passed every memory cap.
MAX_TOOL_NAME_LENGTH: Final = 200
MAX_INSTRUCTIONS_LENGTH: Final = 8_000
MAX_TOKEN_SETTING: Final = 100_000_000
SETTING_NAMES: Final = (
    "context_window",
    "reserve_tokens",
    "keep_recent_tokens",
    "tool_result_limit",
    "instructions",
)


class TranscriptError(ValueError):
    """A request that cannot be stored as sent; the message says which field or message, and why."""


class MessageError(TranscriptError):
    """One message of an append is invalid; ``index`` is its position in the request."""

    def __init__(self, index: int, message: str) -> None:
        super().__init__(f"messages[{index}]: {message}")
        self.index = index


def check_transcript_id(transcript_id: object) -> str:
    """A transcript id as clients choose them: 1-200 printable characters, no whitespace or slash."""
    if not isinstance(transcript_id, str):
        raise TranscriptError(f"transcript id must be text, got {transcript_id!r}")
    if not 1 <= len(transcript_id) <= MAX_TRANSCRIPT_ID_LENGTH or not is_word_label(transcript_id):
        raise TranscriptError(
            f"transcript id must be 1 to {MAX_TRANSCRIPT_ID_LENGTH} printable characters without "
            f"whitespace or '/', got {transcript_id!r}"
        )
    return transcript_id


# ---------------------------------------------------------------------------
# Messages in: parsing and validation
# ---------------------------------------------------------------------------


def _tool_call(index: int, position: int, raw: object) -> ToolCall:
    where = f"tool_calls[{position}]"
    if not isinstance(raw, Mapping):
        raise MessageError(index, f"{where} must be an object with id, name and arguments")
    unknown = sorted(set(raw) - {"id", "name", "arguments", "type"})
    if unknown:
        raise MessageError(
            index, f"{where} has unknown field(s) {listed_names(unknown)}; use id, name, arguments"
        )
    call_id, name, arguments = raw.get("id"), raw.get("name"), raw.get("arguments", "{}")
    if not isinstance(call_id, str) or not call_id or len(call_id) > MAX_TOOL_CALL_ID_LENGTH:
        raise MessageError(
            index, f"{where}.id must be 1 to {MAX_TOOL_CALL_ID_LENGTH} characters, got {call_id!r}"
        )
    if not isinstance(name, str) or not name or len(name) > MAX_TOOL_NAME_LENGTH:
        raise MessageError(
            index, f"{where}.name must be a tool name of 1 to {MAX_TOOL_NAME_LENGTH} characters"
        )
    if arguments is None:
        arguments = "{}"
    if isinstance(arguments, Mapping):
        problem = not_json(arguments, f"{where}.arguments")
        if problem:  # JSON text with Infinity in it would go to the provider as the call's arguments
            raise MessageError(index, problem)
        return ToolCall.from_mapping(call_id, name, arguments)
    if not isinstance(arguments, str):
        raise MessageError(index, f"{where}.arguments must be a JSON object or its JSON text")
    # Text no database stores (a lone surrogate, as Python's json.loads makes of "\ud800"): the caller's
    # to fix, not a failed insert. An object's strings are checked by not_json above.
    problem = text_problem(arguments)
    if problem:
        raise MessageError(index, f"{where}.arguments {problem}")
    return ToolCall(call_id, name, arguments)


MESSAGE_FIELDS = ("role", "text", "tool_calls", "tool_call_id", "tool_name")


def parse_message(index: int, raw: Mapping[str, Any]) -> TranscriptMessage:
    """One appended message from its JSON fields; MessageError names the message and what is wrong. A
    field it does not know is refused: an OpenAI-shaped tool result's ``content`` was dropped, and the
    result stored with no text (compaction and the context view lost it)."""
    unknown = sorted(str(key) for key in raw if key not in MESSAGE_FIELDS)
    if unknown:
        hint = " (a message's words go in text)" if "content" in unknown else ""
        raise MessageError(
            index, f"unknown field(s) {listed_names(unknown)}; use {', '.join(MESSAGE_FIELDS)}{hint}"
        )
    role = raw.get("role")
    if role is not None and not isinstance(role, str):  # a list or an object is unhashable: no set test
        raise MessageError(
            index, f"role must be a string (user, assistant or tool), got {type(role).__name__}"
        )
    if role not in ROLES:
        raise MessageError(index, f"unknown role {role!r}; use one of: user, assistant, tool")
    text = raw.get("text", "")
    if text is None:
        text = ""
    if not isinstance(text, str):
        raise MessageError(index, f"text must be a string, got {type(text).__name__}")
    raw_calls = raw.get("tool_calls") or []
    if not isinstance(raw_calls, list | tuple):
        raise MessageError(index, "tool_calls must be a list of {id, name, arguments}")
    calls = tuple(_tool_call(index, position, call) for position, call in enumerate(raw_calls))
    if calls and role != "assistant":
        raise MessageError(index, f"only assistant messages carry tool_calls, not a {role} message")
    ids = [call.id for call in calls]
    if len(set(ids)) != len(ids):
        raise MessageError(index, "tool_calls repeat an id; each call of a turn needs its own id")
    tool_call_id, tool_name = raw.get("tool_call_id"), raw.get("tool_name")
    if role != "tool" and (tool_call_id is not None or tool_name is not None):
        raise MessageError(index, f"tool_call_id and tool_name belong to tool results, not a {role} message")
    if role == "tool":
        if not isinstance(tool_call_id, str) or not tool_call_id:
            raise MessageError(index, "a tool result needs tool_call_id: the id of the call it answers")
        if len(tool_call_id) > MAX_TOOL_CALL_ID_LENGTH:
            raise MessageError(index, f"tool_call_id must be at most {MAX_TOOL_CALL_ID_LENGTH} characters")
        if tool_name is not None and (
            not isinstance(tool_name, str) or not tool_name or len(tool_name) > MAX_TOOL_NAME_LENGTH
        ):
            raise MessageError(
                index, f"tool_name must be a tool name of 1 to {MAX_TOOL_NAME_LENGTH} characters"
            )
    elif not text and not calls:
        raise MessageError(index, "the message is empty; send text (or tool_calls for an assistant turn)")
    return TranscriptMessage(
        role=cast(Role, role), text=text, tool_calls=calls, tool_call_id=tool_call_id, tool_name=tool_name
    )


def parse_messages(raw_messages: object) -> list[TranscriptMessage]:
    """The messages of an append body (a list of objects), parsed and individually validated."""
    if not isinstance(raw_messages, list):
        raise TranscriptError("messages must be a list of message objects")
    if not raw_messages:
        raise TranscriptError("messages is empty; send at least one message")
    if len(raw_messages) > MAX_MESSAGES_PER_REQUEST:
        raise TranscriptError(
            f"{len(raw_messages)} messages in one request; send at most {MAX_MESSAGES_PER_REQUEST}"
        )
    parsed = []
    for index, raw in enumerate(raw_messages):
        if not isinstance(raw, Mapping):
            raise MessageError(index, "must be an object with role and text")
        parsed.append(parse_message(index, raw))
    return parsed


@dataclass
class ToolUnit:
    """The tool calls the next tool result may answer: those of the last assistant turn, still open."""

    calls: dict[str, str] = field(default_factory=dict)  # call id -> tool name
    answered: set[str] = field(default_factory=set)


def link_tool_results(
    messages: Sequence[TranscriptMessage], unit: ToolUnit | None
) -> list[TranscriptMessage]:
    """Check every tool result answers an open call of the assistant turn before it; fill in tool_name.

    ``unit`` is the open turn at the end of what is already stored (None: the stored history does
    not end in an assistant turn with tool calls and its results). Raises MessageError naming the
    first result that answers no earlier call, or answers one twice.
    """
    out: list[TranscriptMessage] = []
    for index, message in enumerate(messages):
        if message.role != "tool":
            unit = (
                ToolUnit({call.id: call.name for call in message.tool_calls}) if message.tool_calls else None
            )
            out.append(message)
            continue
        call_id = message.tool_call_id
        assert call_id is not None  # parse_message requires it
        if unit is None or call_id not in unit.calls:
            raise MessageError(
                index,
                f"tool result answers no earlier call: {call_id!r} is not a tool call of the assistant "
                "turn right before it; append the assistant message with that call first",
            )
        if call_id in unit.answered:
            raise MessageError(index, f"tool call {call_id!r} was already answered; send one result per call")
        called = unit.calls[call_id]
        if message.tool_name is not None and message.tool_name != called:
            # Stored, the history and the context view named a tool that was never called (and a
            # provider that pairs a result with its call by name refused the view).
            raise MessageError(
                index,
                f"tool result of call {call_id!r} names tool {quoted(message.tool_name)} but the call was "
                f"to {quoted(called)}; send the call's tool name, or none",
            )
        unit.answered.add(call_id)
        if message.tool_name is None:
            message = TranscriptMessage(
                role="tool", text=message.text, tool_call_id=call_id, tool_name=unit.calls[call_id]
            )
        out.append(message)
    return out


# ---------------------------------------------------------------------------
# Settings
# ---------------------------------------------------------------------------


def _count_setting(name: str, value: object, *, minimum: int) -> int:
    value = json_integer(value)
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= MAX_TOKEN_SETTING:
        raise TranscriptError(
            f"settings.{name} must be an integer from {minimum} to {MAX_TOKEN_SETTING}, got {quoted(value)}"
        )
    return value


def clean_settings(changes: Mapping[str, Any]) -> dict[str, Any]:
    """Validate a partial settings update; returns the columns to set. Unknown names are an error."""
    unknown = sorted(set(changes) - set(SETTING_NAMES))
    if unknown:
        # (The MCP tool's settings are a parsed dict, unchecked: a name may be no text at all.)
        raise TranscriptError(f"unknown setting(s) {listed_names(unknown)}; use {', '.join(SETTING_NAMES)}")
    cleaned: dict[str, Any] = {}
    for name, value in changes.items():
        if name == "context_window":
            # None: the window is unknown, so nothing is compacted automatically.
            cleaned[name] = None if value is None else _count_setting(name, value, minimum=1)
        elif name == "instructions":
            if value is not None and not isinstance(value, str):
                raise TranscriptError(f"settings.instructions must be text or null, got {quoted(value)}")
            if value is not None and (problem := text_problem(value)):  # the MCP tool's dict is unchecked
                raise TranscriptError(f"settings.instructions {problem}")
            if value is not None and len(value) > MAX_INSTRUCTIONS_LENGTH:
                raise TranscriptError(
                    f"settings.instructions is {len(value)} characters; keep it to {MAX_INSTRUCTIONS_LENGTH}"
                )
            text = (value or "").strip()
            cleaned[name] = text or None
        else:
            if value is None:
                raise TranscriptError(f"settings.{name} cannot be null; send an integer")
            cleaned[name] = _count_setting(name, value, minimum=0)
    return cleaned


class SettingsColumns(Protocol):
    """What a stored transcript holds of its settings (the transcripts row, read-only here)."""

    @property
    def context_window(self) -> int | None: ...
    @property
    def reserve_tokens(self) -> int: ...
    @property
    def keep_recent_tokens(self) -> int: ...
    @property
    def tool_result_limit(self) -> int: ...
    @property
    def instructions(self) -> str | None: ...


@dataclass(frozen=True)
class TranscriptSettings:
    context_window: int | None = None
    reserve_tokens: int = DEFAULT_RESERVE_TOKENS
    keep_recent_tokens: int = DEFAULT_KEEP_RECENT_TOKENS
    tool_result_limit: int = DEFAULT_TOOL_RESULT_LIMIT
    instructions: str | None = None

    @classmethod
    def of(cls, row: SettingsColumns) -> TranscriptSettings:
        return cls(
            row.context_window,
            row.reserve_tokens,
            row.keep_recent_tokens,
            row.tool_result_limit,
            row.instructions,
        )

    @property
    def trigger_tokens(self) -> int | None:
        """Context tokens above which a compaction is requested; None when it never is."""
        if self.context_window is None or self.context_window <= self.reserve_tokens:
            return None
        return self.context_window - self.reserve_tokens

    def check_room(self) -> None:
        """Refuse a window the reserve fills: no compaction would ever be requested for it, which is
        what a transcript with no window means, and surely not what a caller naming one wants (an
        8,192-token model with the default reserve of 16,384)."""
        if self.context_window is not None and self.context_window <= self.reserve_tokens:
            raise TranscriptError(
                f"settings.context_window ({self.context_window}) is not larger than reserve_tokens "
                f"({self.reserve_tokens}), so no compaction would ever be requested; lower "
                "reserve_tokens or raise context_window"
            )


# ---------------------------------------------------------------------------
# Stored form (the tool_calls jsonb column)
# ---------------------------------------------------------------------------


def tool_calls_json(calls: Sequence[ToolCall]) -> list[dict[str, str]]:
    """Tool calls as stored and served: a list of {id, name, arguments}."""
    return [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in calls]


def stored_message(
    role: str, text: str, calls: Sequence[Mapping[str, Any]], call_id: str | None, name: str | None
) -> TranscriptMessage:
    """A message back from its stored columns (tool_calls as ``tool_calls_json`` wrote them)."""
    return TranscriptMessage(
        role=cast(Role, role),
        text=text,
        tool_calls=tuple(ToolCall(c["id"], c["name"], c.get("arguments", "{}")) for c in calls),
        tool_call_id=call_id,
        tool_name=name,
    )
