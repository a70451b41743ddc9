"""Transcripts API: signed appends and settings, the context view, the full history, the compactions.

``POST /v1/transcripts/{id}/messages`` and ``PUT /v1/transcripts/{id}`` are signed exactly like the
page webhooks (``Factmill-Signature`` over the raw body). An append stores its messages and, when the
context passes ``context_window - reserve_tokens``, requests a compaction job in the same transaction;
the job is handed to the ``compaction`` queue only after the commit. No LLM call happens in a request.

Each accepted or rejected compaction can be labelled later through ``POST /v1/feedback`` with its
``compaction_id`` (the integer ``id`` listed by ``GET /v1/transcripts/{id}/compactions``) and the
``coverage`` it recorded; that feeds the calibration of the threshold the gate uses.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Header, Path, Query, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client.core import CounterMetricFamily, Metric
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import func, select, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from models import COMPACTION_STATUSES, Compaction, TranscriptMessageRow, WebhookDelivery
from worker.api.app import (
    IDEMPOTENCY_HEADER,
    ApiContext,
    ApiError,
    Context,
    _check_idempotency_key,
    _errors,
    load_json_body,
    read_body,
    verify_signature,
)
from worker.api.signing import SIGNATURE_HEADER
from worker.compaction import (
    MAX_MESSAGES_PER_REQUEST,
    MessageError,
    TranscriptError,
    TranscriptNotFoundError,
    append_messages,
    context_view,
    list_compactions,
    list_messages,
    parse_messages,
    transcript_stats,
    update_settings,
)

logger = logging.getLogger(__name__)

compaction_router = APIRouter(tags=["transcripts"])

TranscriptId = Annotated[
    str,
    Path(
        min_length=1,
        max_length=200,
        pattern=r"^[^\s/]+$",
        description="The client's own id for the transcript (1-200 characters, no whitespace or '/')",
    ),
]
SignatureHeader = Annotated[
    str | None,
    Header(
        alias=SIGNATURE_HEADER,
        description="t=<unix seconds>,v1=<hex HMAC-SHA256 of '<t>.<body>'> under FACTMILL_WEBHOOK_SECRET",
    ),
]
IdempotencyHeader = Annotated[
    str | None,
    Header(alias=IDEMPOTENCY_HEADER, description="A repeated delivery with this key replays the answer"),
]


# ---------------------------------------------------------------------------
# Shapes (the request bodies are parsed by worker.compaction so the CLI and the API share one rule
# set; these models document them in OpenAPI)
# ---------------------------------------------------------------------------


class ToolCallIn(BaseModel):
    id: str = Field(min_length=1, max_length=200)
    name: str = Field(min_length=1)
    arguments: dict[str, Any] | str = Field(default="{}", description="A JSON object, or its JSON text")


class MessageIn(BaseModel):
    role: str = Field(description="user, assistant or tool")
    text: str = ""
    tool_calls: list[ToolCallIn] = Field(default_factory=list, description="Assistant turns only")
    tool_call_id: str | None = Field(default=None, description="Tool results: the call this answers")
    tool_name: str | None = Field(default=None, description="Tool results: defaults to the call's name")


class SettingsIn(BaseModel):
    """Per-transcript settings; send only the ones to change."""

    model_config = ConfigDict(extra="forbid")

    context_window: int | None = Field(default=None, ge=1, description="null: unknown, never compact")
    reserve_tokens: int = Field(default=16_384, ge=0)
    keep_recent_tokens: int = Field(default=20_000, ge=0)
    tool_result_limit: int = Field(default=2_000, ge=0)
    instructions: str | None = Field(default=None, description="Steers the summarizer (quoted as data)")


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


# ---------------------------------------------------------------------------
# Signed writes
# ---------------------------------------------------------------------------


def _load_json_object(body: bytes) -> dict[str, Any]:
    data = load_json_body(body)
    if not isinstance(data, dict):
        raise ApiError(422, "body must be a JSON object")
    return data


def _unprocessable(exc: TranscriptError) -> ApiError:
    if isinstance(exc, MessageError):
        loc = f"messages[{exc.index}]"
        return ApiError(422, str(exc), message_index=exc.index, errors=[{"loc": loc, "msg": str(exc)}])
    return ApiError(422, str(exc))


async def _read_body(request: Request, ctx: ApiContext) -> bytes:
    return await read_body(request, ctx.settings.max_body_bytes)


def _delivery_key(transcript_id: str, key: str) -> str:
    # Deliveries share one table with the page webhooks; the prefix keeps the two key spaces apart.
    return f"transcripts/{transcript_id}:{key}"


def accept_messages(
    ctx: ApiContext, transcript_id: str, body: bytes, signature: str | None, key: str | None
) -> JSONResponse:
    """Verify, parse, store, commit, then enqueue a due compaction (blocking: runs on a worker thread)."""
    verify_signature(ctx, body, signature)
    key = _check_idempotency_key(key)
    data = _load_json_object(body)
    unknown = sorted(set(data) - {"messages", "settings"})
    if unknown:
        raise ApiError(422, f"unexpected field(s) {', '.join(unknown)}; send messages and optional settings")
    if "messages" not in data:
        raise ApiError(422, 'messages: required; send {"messages": [{"role": ..., "text": ...}]}')
    settings = data.get("settings")
    if settings is None:
        settings = {}
    elif not isinstance(settings, dict):
        raise ApiError(422, "settings must be an object")
    try:
        messages = parse_messages(data["messages"])
    except TranscriptError as exc:
        raise _unprocessable(exc) from None
    body_hash = hashlib.sha256(body).hexdigest()
    delivery_key = _delivery_key(transcript_id, key) if key is not None else None
    try:
        with ctx.factory.begin() as session:
            if delivery_key is not None:
                prior = session.get(WebhookDelivery, delivery_key)
                if prior is not None:
                    return _replay(prior, body_hash)
            result = append_messages(
                session,
                transcript_id,
                messages,
                settings=settings,
                retrigger_seconds=ctx.settings.compaction_retrigger_seconds,
            )
            trigger = result.trigger
            response = AppendOut(
                transcript_id=transcript_id,
                appended=len(messages),
                first_seq=result.first_seq,
                last_seq=result.last_seq,
                context_tokens=trigger.context_tokens,
                trigger_tokens=trigger.trigger_tokens,
                compaction=(
                    CompactionRequested(job_id=trigger.job.job_id, created=trigger.job.created)
                    if trigger.job is not None
                    else None
                ),
                note=trigger.note,
            ).model_dump(mode="json")
            if delivery_key is not None:
                session.add(
                    WebhookDelivery(idempotency_key=delivery_key, body_hash=body_hash, response=response)
                )
                session.flush()
    except TranscriptError as exc:
        raise _unprocessable(exc) from None
    except IntegrityError:
        # A concurrent delivery with the same key committed first: answer what it answered.
        if delivery_key is None:
            raise
        with ctx.factory() as session:
            prior = session.get(WebhookDelivery, delivery_key)
            if prior is None:
                raise
            return _replay(prior, body_hash)
    sent = ctx.enqueue(result.pending_jobs())
    logger.info(
        "transcript %s: %s message(s) appended (seq %s-%s), context %s tokens, %s compaction job(s) sent",
        transcript_id,
        len(messages),
        result.first_seq,
        result.last_seq,
        trigger.context_tokens,
        sent,
    )
    return JSONResponse(response, 201)


def _replay(delivery: WebhookDelivery, body_hash: str) -> JSONResponse:
    if not hmac.compare_digest(delivery.body_hash, body_hash):
        raise ApiError(422, f"{IDEMPOTENCY_HEADER} reused with a different body; use a new key per delivery")
    return JSONResponse(dict(delivery.response), 201, headers={"Idempotent-Replayed": "true"})


def _transcript_out(ctx: ApiContext, transcript_id: str) -> TranscriptOut:
    with ctx.factory() as session:
        try:
            stats = transcript_stats(session, transcript_id)
        except TranscriptNotFoundError as exc:
            raise ApiError(404, str(exc)) from None
    return TranscriptOut.model_validate(stats.as_dict())


def accept_settings(ctx: ApiContext, transcript_id: str, body: bytes, signature: str | None) -> JSONResponse:
    verify_signature(ctx, body, signature)
    data = _load_json_object(body)
    try:
        with ctx.factory.begin() as session:
            _, trigger = update_settings(
                session, transcript_id, data, retrigger_seconds=ctx.settings.compaction_retrigger_seconds
            )
            pending = [(trigger.job.job_id, "compaction")] if trigger.job and trigger.job.created else []
    except TranscriptError as exc:
        raise _unprocessable(exc) from None
    ctx.enqueue(pending)
    logger.info("transcript %s: settings %s", transcript_id, sorted(data))
    return JSONResponse(_transcript_out(ctx, transcript_id).model_dump(mode="json"), 200)


@compaction_router.post(
    "/v1/transcripts/{transcript_id}/messages",
    status_code=201,
    response_model=AppendOut,
    summary="Append messages to a transcript (signed webhook); queues a compaction when it is due",
    responses=_errors(400, 401, 413, 422),
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": AppendIn.model_json_schema()}},
        }
    },
)
async def post_messages(
    request: Request,
    ctx: Context,
    transcript_id: TranscriptId,
    factmill_signature: SignatureHeader = None,
    idempotency_key: IdempotencyHeader = None,
) -> Response:
    """`{"messages": [{role, text, tool_calls, tool_call_id, tool_name}], "settings": {...}}`.

    The transcript is created on first use. Roles are user, assistant and tool; a tool result must
    answer a call of the assistant turn right before it (counting what is already stored). An invalid
    message is answered with 422 naming it (`messages[i]`), and nothing of the request is stored.
    """
    body = await _read_body(request, ctx)
    return await run_in_threadpool(
        accept_messages, ctx, transcript_id, body, factmill_signature, idempotency_key
    )


@compaction_router.put(
    "/v1/transcripts/{transcript_id}",
    response_model=TranscriptOut,
    summary="Create a transcript or change its settings (signed)",
    responses=_errors(400, 401, 413, 422),
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": SettingsIn.model_json_schema()}},
        }
    },
)
async def put_transcript(
    request: Request, ctx: Context, transcript_id: TranscriptId, factmill_signature: SignatureHeader = None
) -> Response:
    """Only the settings sent change. A smaller window can put the context over its threshold at once:
    then a compaction is queued as for an append."""
    body = await _read_body(request, ctx)
    return await run_in_threadpool(accept_settings, ctx, transcript_id, body, factmill_signature)


# ---------------------------------------------------------------------------
# Reads
# ---------------------------------------------------------------------------


@compaction_router.get(
    "/v1/transcripts/{transcript_id}",
    response_model=TranscriptOut,
    responses=_errors(404),
    summary="A transcript's settings and its before/after token counts",
)
def get_transcript(ctx: Context, transcript_id: TranscriptId) -> TranscriptOut:
    return _transcript_out(ctx, transcript_id)


@compaction_router.get(
    "/v1/transcripts/{transcript_id}/context",
    response_model=ContextOut,
    responses=_errors(404),
    summary="What to send a model now: the newest accepted summary plus the messages after its cut",
)
def get_context(ctx: Context, transcript_id: TranscriptId) -> ContextOut:
    """Repaired for providers: every tool call is followed by its results (a placeholder stands in for
    one that never came), and no tool result is separated from its call."""
    with ctx.factory() as session:
        try:
            view = context_view(session, transcript_id)
        except TranscriptNotFoundError as exc:
            raise ApiError(404, str(exc)) from None
    return ContextOut(
        transcript_id=transcript_id,
        compaction_id=view.compaction_id,
        cut_seq=view.cut_seq,
        tokens=view.tokens,
        messages=[ContextMessageOut.model_validate(m.as_dict()) for m in view.messages],
    )


@compaction_router.get(
    "/v1/transcripts/{transcript_id}/messages",
    response_model=MessagesOut,
    responses=_errors(404),
    summary="The full history, in order (compaction never deletes a message)",
)
def get_messages(
    ctx: Context,
    transcript_id: TranscriptId,
    after_seq: Annotated[
        int | None, Query(ge=-1, description="Only messages after this seq (paging)")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
) -> MessagesOut:
    with ctx.factory() as session:
        try:
            rows: list[TranscriptMessageRow] = list_messages(
                session, transcript_id, after_seq=after_seq, limit=limit
            )
        except TranscriptNotFoundError as exc:
            raise ApiError(404, str(exc)) from None
        messages = [StoredMessageOut.model_validate(row) for row in rows]
    next_after = messages[-1].seq if len(messages) == limit else None
    return MessagesOut(transcript_id=transcript_id, messages=messages, next_after_seq=next_after)


@compaction_router.get(
    "/v1/transcripts/{transcript_id}/compactions",
    response_model=CompactionsOut,
    responses=_errors(404),
    summary="Compactions of a transcript, newest first (label one with POST /v1/feedback)",
)
def get_compactions(
    ctx: Context,
    transcript_id: TranscriptId,
    limit: Annotated[int, Query(ge=1, le=1000)] = 50,
    before_id: Annotated[int | None, Query(ge=1, description="Only compactions with a smaller id")] = None,
) -> CompactionsOut:
    """Accepted, rejected and failed alike. To label one for calibration, send its `id` as
    `compaction_id` and its `coverage` to `POST /v1/feedback` with whether the answer survived."""
    with ctx.factory() as session:
        try:
            rows: list[Compaction] = list_compactions(
                session, transcript_id, limit=limit, before_id=before_id
            )
        except TranscriptNotFoundError as exc:
            raise ApiError(404, str(exc)) from None
        compactions = [CompactionOut.model_validate(row) for row in rows]
    return CompactionsOut(transcript_id=transcript_id, compactions=compactions)


# ---------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------


class CompactionCollector:
    """Prometheus collector over the compactions table, read at scrape time (Postgres is the truth).

    ``factmill_compactions_total{outcome}``: compactions by outcome (accepted, rejected, failed);
    ``factmill_compaction_tokens_saved_total``: context tokens the accepted summaries took out
    (tokens before - tokens after, at the time of each compaction).
    Register it next to StoreCollector: ``registry.register(CompactionCollector(runtime.factory))``.
    """

    def __init__(self, factory: sessionmaker[Session]) -> None:
        self.factory = factory

    def describe(self) -> list[Metric]:
        return []  # keeps registration from querying the database

    def collect(self) -> list[Metric]:
        try:
            with self.factory() as session, session.begin():
                session.execute(text("SET LOCAL statement_timeout = '5s'"))
                rows = session.execute(
                    select(
                        Compaction.status,
                        func.count(),
                        func.coalesce(
                            func.sum(Compaction.tokens_before - Compaction.tokens_after).filter(
                                Compaction.status == "accepted"
                            ),
                            0,
                        ),
                    ).group_by(Compaction.status)
                ).all()
        except Exception as exc:
            logger.warning("metrics: could not read the compactions: %s", exc)
            return []
        by_status = {status: (int(n), int(saved)) for status, n, saved in rows}
        outcomes = CounterMetricFamily("factmill_compactions", "Compactions by outcome", labels=["outcome"])
        for status in sorted(set(COMPACTION_STATUSES) | set(by_status)):
            outcomes.add_metric([status], by_status.get(status, (0, 0))[0])
        saved = CounterMetricFamily(
            "factmill_compaction_tokens_saved",
            "Context tokens taken out by accepted compactions (before - after)",
            value=sum(tokens for _, tokens in by_status.values()),
        )
        return [outcomes, saved]


__all__ = ["CompactionCollector", "accept_messages", "accept_settings", "compaction_router"]
