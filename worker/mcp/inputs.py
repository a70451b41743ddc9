"""What the MCP tools take and how they refuse: argument types, message shapes, access rules, errors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated, Any, Literal

from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ToolAnnotations
from pydantic import AfterValidator as After
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, Strict, StrictBool

from worker.access import AccessRefusedError
from worker.calibration import ObservationError
from worker.compaction import (
    ContextTooLargeError,
    TranscriptError,
    TranscriptNotFoundError,
    check_transcript_id,
)
from worker.compaction.erase import ErasedSinceSignedError
from worker.core.facts import MAX_ENTITY_NAME_CHARS, MAX_LIST_OFFSET, FactKind
from worker.core.intent import QueryParseError
from worker.core.jsonvalues import json_integer, storable_text
from worker.core.labels import MAX_SOURCE_ID_LENGTH, check_source_id
from worker.core.transcripts import MAX_TOOL_CALL_ID_LENGTH, MAX_TOOL_NAME_LENGTH
from worker.deliveries import DeliveryKeyReusedError
from worker.extraction.facts import ENTITY_CURSOR_PATTERN, EntityNameError, FactCursorError
from worker.extraction.pages import MAX_SLUG_INPUT_LENGTH
from worker.llm.errors import BudgetExhaustedError
from worker.search import BUDGET_SPENT, EmbeddingFailedError, SearchError
from worker.settings import Settings

Text = Annotated[str, After(storable_text)]
EntityCursor = Annotated[
    Text | None,
    Field(
        max_length=40,
        pattern=ENTITY_CURSOR_PATTERN,
        json_schema_extra={"pattern": ENTITY_CURSOR_PATTERN},  # pydantic leaves a union's pattern out
        description="next_after of the previous answer.",
    ),
]
# Bounded before the storable check (a bound on Text is checked after it: the whole input scanned, and
# "at most N items after validation" said of text).
EntityName = Annotated[str, Field(min_length=1, max_length=MAX_ENTITY_NAME_CHARS), After(storable_text)]
# The slug as sent (the stored cap is checked once it is normalized).
PageSlug = Annotated[str, Field(min_length=1, max_length=MAX_SLUG_INPUT_LENGTH), After(storable_text)]
SourceId = Annotated[str, Field(min_length=1, max_length=MAX_SOURCE_ID_LENGTH), After(storable_text)]
SourceIdFilter = Annotated[  # a 422 in the API
    str, Field(min_length=1, max_length=MAX_SOURCE_ID_LENGTH), After(storable_text), After(check_source_id)
]
# JSON's integers, as the API's bodies take them: true is not a limit (1.0 is an integer in JSON). The
# bounds go before the validator, so that the tool's schema states them as minimum/maximum.
JSON_INTEGER = BeforeValidator(json_integer)
Offset = Annotated[
    int,
    Strict(),
    Field(ge=0, le=MAX_LIST_OFFSET),
    JSON_INTEGER,
    Field(description=f"Skip this many (at most {MAX_LIST_OFFSET:,}: past it, page by the cursor)."),
]
# A cursor over an int4 position (a page's row_num, a transcript's seq): -1 is before the first.
SeqCursor = Annotated[int | None, Strict(), Field(ge=-1, le=2**31 - 1), JSON_INTEGER]
# A context view a tool answers with: the SDK sends a result twice (structured, and as indented JSON
# text), and no agent's context holds more; past it the error points to the history's pages.
SCORED_COVERAGE = (
    "The coverage the summary scored: with compaction_id, exactly the coverage get_transcript_context "
    "gave for it (another is refused)."
)
MCP_CONTEXT_MAX_BYTES = 4 * 1024 * 1024
MCP_APPEND = "mcp append_transcript_messages"  # the route label its idempotency keys are scoped by
KindName = FactKind
AsOf = Annotated[
    datetime | None,
    Field(
        description="Only facts that were true at this ISO 8601 time (what was true then: a duplicate is "
        "never one, and include_history is not read beside it)."
    ),
]
IncludeHistory = Annotated[
    StrictBool,
    Field(description="Also superseded and duplicate facts (the timeline); by default only current ones."),
]


@dataclass(frozen=True)
class Access:
    """What a tool needs: a scope, and (``all_sources``) data not partitioned by source, which a
    source-limited key may not touch (the API's rule for the same data)."""

    scope: str
    all_sources: str | None = None


# What a tool does, as a client reads it (its annotations): MCP hosts approve read-only tools at once.
READS = ToolAnnotations(read_only_hint=True, destructive_hint=False, open_world_hint=False)
# A search's plain and vec:/hyde: lines call the model: paid, on the readers' shared day budget.
READS_AND_CALLS_MODEL = ToolAnnotations(read_only_hint=True, destructive_hint=False, open_world_hint=True)
WRITES = ToolAnnotations(read_only_hint=False, destructive_hint=False, open_world_hint=False)


class ToolCallIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: Annotated[
        Text,
        Field(
            min_length=1,
            max_length=MAX_TOOL_CALL_ID_LENGTH,
            description="The call's id; its tool result names it.",
        ),
    ]
    name: Annotated[
        Text,
        Field(min_length=1, max_length=MAX_TOOL_NAME_LENGTH, description="The tool the assistant called."),
    ]
    # As the API takes them: an object, or its JSON text (how OpenAI's tool calls carry them).
    arguments: Annotated[dict[str, Any] | Text | None, Field(description="The call's arguments.")] = {}
    type: Annotated[Any, Field(description="OpenAI's call type ('function'), if sent; not used.")] = None


class MessageIn(BaseModel):
    """One transcript message, as POST /v1/transcripts/{id}/messages takes it."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["user", "assistant", "tool"]
    text: Annotated[
        Text | None, Field(description="The message text (may be empty or null for a tool-calling turn).")
    ] = ""
    tool_calls: Annotated[
        list[ToolCallIn] | None, Field(description="Assistant turns only: the tools it called.")
    ] = None
    tool_call_id: Annotated[
        Text | None,
        Field(
            max_length=MAX_TOOL_CALL_ID_LENGTH,
            description="Tool results only: the id of the call this answers.",
        ),
    ] = None
    tool_name: Annotated[
        Text | None,
        Field(max_length=MAX_TOOL_NAME_LENGTH, description="Tool results only: the tool that ran."),
    ] = None


@contextmanager
def refusals() -> Iterator[None]:
    """The errors a caller can cause, as refusals whose message says what was wrong."""
    try:
        yield
    except BudgetExhaustedError:
        raise ToolError(BUDGET_SPENT) from None
    except (AccessRefusedError, QueryParseError, SearchError, TranscriptError, ObservationError) as exc:
        raise ToolError(str(exc)) from None
    except DeliveryKeyReusedError:
        raise ToolError(
            "idempotency_key was used before with other messages; use a new key per append"
        ) from None
    except (
        ErasedSinceSignedError,
        TranscriptNotFoundError,
        ContextTooLargeError,
        EmbeddingFailedError,
        EntityNameError,
        FactCursorError,
    ) as exc:
        raise ToolError(str(exc)) from None


def checked_transcript_id(transcript_id: str) -> str:
    try:
        return check_transcript_id(transcript_id)
    except TranscriptError as exc:
        raise ToolError(f"transcript_id: {exc}") from None


def within_body_cap(what: str, arguments: dict[str, Any], settings: Settings) -> None:
    """ToolError when ``arguments`` (a write's), as compact JSON without what is unset, are over
    FACTMILL_MAX_BODY_BYTES, the API's body cap: over HTTP the body cap refuses the request, but over
    stdio nothing did, and one 300 MB message was stored, to be read whole by every page of the
    transcript's messages and by the compaction worker. (Measured as a client sends it: with Python's
    spaced separators an append the API takes was refused here.)"""
    sent = {name: value for name, value in arguments.items() if value is not None}
    size = len(json.dumps(sent, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "surrogatepass"))
    cap = settings.max_body_bytes
    if size > cap:
        raise ToolError(f"{what} is {size:,} bytes as JSON, over the {cap}-byte limit; send it in parts")


__all__ = [
    "JSON_INTEGER",
    "MCP_APPEND",
    "MCP_CONTEXT_MAX_BYTES",
    "SCORED_COVERAGE",
    "Access",
    "AsOf",
    "EntityCursor",
    "EntityName",
    "IncludeHistory",
    "KindName",
    "MessageIn",
    "Offset",
    "PageSlug",
    "SourceId",
    "SourceIdFilter",
    "Text",
    "ToolCallIn",
    "checked_transcript_id",
    "refusals",
    "within_body_cap",
]
