"""Request and response shapes of the transcripts API.

The request bodies are parsed by worker.compaction so the CLI and the API share one rule set; the
request models here document them in OpenAPI.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import SkipJsonSchema

from worker.core.transcripts import (
    MAX_INSTRUCTIONS_LENGTH,
    MAX_MESSAGES_PER_REQUEST,
    MAX_TOKEN_SETTING,
    MAX_TOOL_CALL_ID_LENGTH,
    MAX_TOOL_NAME_LENGTH,
)


class ToolCallIn(BaseModel):
    model_config = ConfigDict(extra="forbid")  # as the parser: any other field is refused

    id: str = Field(min_length=1, max_length=MAX_TOOL_CALL_ID_LENGTH)
    name: str = Field(min_length=1, max_length=MAX_TOOL_NAME_LENGTH)
    arguments: dict[str, Any] | str | None = Field(
        default="{}", description="A JSON object, or its JSON text"
    )
    type: Any = Field(default=None, description="Accepted and ignored (OpenAI's wire format sends it)")


class MessageIn(BaseModel):
    model_config = ConfigDict(extra="forbid")  # as the parser: a `content` field is refused, not dropped

    role: Literal["user", "assistant", "tool"]
    text: str | None = ""
    tool_calls: list[ToolCallIn] | None = Field(default_factory=list, description="Assistant turns only")
    tool_call_id: str | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_TOOL_CALL_ID_LENGTH,
        description="Tool results (required there): the call this answers",
    )
    tool_name: str | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_TOOL_NAME_LENGTH,
        description="Tool results: defaults to the call's name",
    )


# An integer setting that may be left out but never sent as null (the parser refuses null for these),
# and has no default in the document (left out, the stored value stays).
_Setting = Annotated[int, Field(ge=0, le=MAX_TOKEN_SETTING)] | SkipJsonSchema[None]


def _no_default(schema: dict[str, Any]) -> None:
    schema.pop("default", None)


_UNSENT: Any = Field(default=None, json_schema_extra=_no_default)


class SettingsIn(BaseModel):
    """Per-transcript settings; send only the ones to change. The window must be larger than the
    reserve (counting the settings already stored); otherwise 422, as no compaction would ever be
    requested."""

    model_config = ConfigDict(extra="forbid")

    # No defaults here: a field not sent keeps its stored value (a generated client that filled in
    # defaults would reset what its caller never meant to change: a null window stops compaction); a
    # new transcript's are no window, 16,384, 20,000, 2,000 and no instructions.
    context_window: Annotated[int, Field(ge=1, le=MAX_TOKEN_SETTING)] | None = Field(
        default=None, description="null: unknown, never compact", json_schema_extra=_no_default
    )
    reserve_tokens: _Setting = _UNSENT
    keep_recent_tokens: _Setting = _UNSENT
    tool_result_limit: _Setting = _UNSENT
    instructions: str | None = Field(
        default=None,
        max_length=MAX_INSTRUCTIONS_LENGTH,
        description="Steers the summarizer (quoted as data); null: none",
        json_schema_extra=_no_default,
    )


class AppendIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    messages: list[MessageIn] = Field(min_length=1, max_length=MAX_MESSAGES_PER_REQUEST)
    settings: SettingsIn | None = None


class CompactionRequested(BaseModel):
    job_id: int
    created: bool  # False: a compaction was already pending for this transcript


class AppendOut(BaseModel):
    transcript_id: str
    appended: int
    first_seq: int
    last_seq: int
    context_tokens: int  # estimated tokens of the context view after the append
    trigger_tokens: int | None  # context_window - reserve_tokens; None: never compacted automatically
    compaction: CompactionRequested | None
    note: str | None = None


class TranscriptSettingsOut(BaseModel):
    context_window: int | None
    reserve_tokens: int
    keep_recent_tokens: int
    tool_result_limit: int
    instructions: str | None


class TranscriptOut(BaseModel):
    transcript_id: str
    settings: TranscriptSettingsOut
    trigger_tokens: int | None
    messages: int
    history_tokens: int  # the full history, estimated
    context_tokens: int  # what the context view sends now
    saved_tokens: int
    summary_tokens: int
    compaction_id: int | None  # the accepted compaction the context view applies
    cut_seq: int | None
    pending_job_id: int | None
    created_at: datetime | None
    updated_at: datetime | None


class TranscriptSummary(BaseModel):
    transcript_id: str
    context_window: int | None
    messages: int
    history_tokens: int
    updated_at: datetime


class TranscriptList(BaseModel):
    transcripts: list[TranscriptSummary]  # most recently changed first


class TranscriptErased(BaseModel):
    transcript_id: str
    messages_removed: int
    compactions_removed: int
    jobs_cancelled: int  # pending compaction jobs of the transcript, now failed with "transcript erased"


class ToolCallOut(BaseModel):
    id: str
    name: str
    arguments: str  # JSON text


class ContextMessageOut(BaseModel):
    seq: int | None  # None: the summary, or a placeholder for a tool call that never got its result
    role: str
    text: str
    tool_calls: list[ToolCallOut]
    tool_call_id: str | None
    tool_name: str | None
    is_compaction: bool
    tokens: int


class ContextOut(BaseModel):
    transcript_id: str
    compaction_id: int | None
    coverage: float | None = Field(
        description="The coverage the gate measured for the compaction: what a label of it carries"
    )
    cut_seq: int | None
    tokens: int
    messages: list[ContextMessageOut]


class StoredMessageOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    seq: int
    role: str
    text: str
    tool_calls: list[ToolCallOut]
    tool_call_id: str | None
    tool_name: str | None
    tokens: int
    created_at: datetime


class MessagesOut(BaseModel):
    transcript_id: str
    messages: list[StoredMessageOut]
    next_after_seq: int | None  # pass as after_seq for the next page; None: this was the last page


class CompactionOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int  # the compaction_id POST /v1/feedback takes
    transcript_id: str
    status: str  # accepted | rejected | failed
    cut_seq: int
    previous_id: int | None
    summary: str | None
    tokens_before: int
    tokens_after: int | None
    coverage: float | None
    density: float | None
    threshold_tau: float | None
    threshold_version: int | None
    attempts: int
    missed_terms: list[str]
    attempt_log: list[dict[str, Any]]
    error: str | None
    job_id: int | None
    created_at: datetime


class CompactionsOut(BaseModel):
    transcript_id: str
    compactions: list[CompactionOut]
    # Older ones follow (the page stopped at its limit or at 8 MiB of summaries and logs): ask again with
    # before_id set to this.
    next_before_id: int | None = None
