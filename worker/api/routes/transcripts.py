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
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, Request
from fastapi.responses import JSONResponse, Response
from fastapi.types import DecoratedCallable
from pydantic import AfterValidator
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from models.reads import one_snapshot, read_only
from worker.api.auth import Admin, Ingest, TranscriptIngester, TranscriptReader
from worker.api.deps import (
    ApiContext,
    Context,
    IdempotencyHeader,
    check_idempotency_key,
    json_request_body,
    load_json_object,
    read_body,
)
from worker.api.errors import ApiError, error_responses
from worker.api.inputs import BIGINT_MAX, INT4_MAX
from worker.api.schemas.transcripts import (
    AppendIn,
    AppendOut,
    CompactionOut,
    CompactionRequested,
    CompactionsOut,
    ContextMessageOut,
    ContextOut,
    MessagesOut,
    SettingsIn,
    StoredMessageOut,
    TranscriptErased,
    TranscriptList,
    TranscriptOut,
)
from worker.compaction import (
    ContextTooLargeError,
    MessageError,
    TranscriptError,
    TranscriptNotFoundError,
    append_messages,
    check_transcript_id,
    context_view,
    list_compactions,
    list_messages,
    parse_messages,
    recent_transcripts,
    transcript_stats,
    update_settings,
)
from worker.compaction.erase import (
    ErasedSinceSignedError,
    erase_transcript,
    no_transcript_to_erase,
    refuse_if_erased_since,
)
from worker.compaction.views import measured_coverage
from worker.core.compaction import TranscriptMessage
from worker.core.labels import WORD_LABEL_PATTERN, listed_names
from worker.core.transcripts import MAX_TRANSCRIPT_ID_LENGTH
from worker.deliveries import REPLAYED_HEADERS, Answer, deliver_once, replayed_answer, scoped_key
from worker.jobs import outbox

logger = logging.getLogger(__name__)

compaction_router = APIRouter(tags=["transcripts"])


def _transcript_id(value: str) -> str:
    try:
        return check_transcript_id(value)
    except TranscriptError as exc:
        raise ValueError(str(exc)) from None


# The pattern is the rule (worker/core/labels.py); the validator gives the clearer message.
TranscriptId = Annotated[
    str,
    Path(
        min_length=1,
        max_length=MAX_TRANSCRIPT_ID_LENGTH,
        pattern=WORD_LABEL_PATTERN,
        description=(
            "The client's own id for the transcript: 1-200 printable characters, no whitespace "
            "(Unicode White_Space included) and no '/'"
        ),
    ),
    AfterValidator(_transcript_id),
]


# ---------------------------------------------------------------------------
# Signed writes
# ---------------------------------------------------------------------------


def _unprocessable(exc: TranscriptError) -> ApiError:
    if isinstance(exc, MessageError):
        loc = f"messages[{exc.index}]"
        return ApiError(422, str(exc), message_index=exc.index, errors=[{"loc": loc, "msg": str(exc)}])
    return ApiError(422, str(exc))


def _parse_append(data: dict[str, Any]) -> tuple[list[TranscriptMessage], dict[str, Any]]:
    """The messages and the settings of an append body (422 naming what is wrong)."""
    unknown = sorted(set(data) - {"messages", "settings"})
    if unknown:
        fields = listed_names(unknown)
        raise ApiError(422, f"unexpected field(s) {fields}; send messages and optional settings")
    if "messages" not in data:
        raise ApiError(422, 'messages: required; send {"messages": [{"role": ..., "text": ...}]}')
    settings = data.get("settings")
    if settings is None:
        settings = {}
    elif not isinstance(settings, dict):
        raise ApiError(422, "settings must be an object")
    try:
        return parse_messages(data["messages"]), settings
    except TranscriptError as exc:
        raise _unprocessable(exc) from None


def accept_messages(
    ctx: ApiContext, transcript_id: str, body: bytes, ingest: Ingest, key: str | None
) -> JSONResponse:
    """Verify, parse, store, commit, then enqueue a due compaction (blocking: runs on a worker thread)."""
    dated = ingest.delivered_at(ctx, body)
    key = check_idempotency_key(key)
    # Deliveries share one table with the page webhooks: the key is scoped by route and transcript.
    delivery_key = scoped_key("POST /v1/transcripts/{id}/messages", transcript_id, key, ingest.sender)
    body_hash = hashlib.sha256(body).hexdigest()
    try:
        messages, settings = _parse_append(load_json_object(body))
    except ApiError:  # a rule tightened since this delivery was stored: its retry gets the stored answer
        prior = replayed_answer(ctx.factory, delivery_key, body_hash)
        if prior is None:
            raise
        return JSONResponse(prior, 201, headers=REPLAYED_HEADERS)

    def write(session: Session) -> tuple[Answer, list[tuple[int, str]]]:
        # Before (the 409 says why, not a 422 about the erased state) and after (an erasure committed
        # while the write waited on the row it deleted).
        delivered_at = dated(session)
        refuse_if_erased_since(session, transcript_id, delivered_at)
        result = append_messages(
            session,
            transcript_id,
            messages,
            settings=settings,
            retrigger_seconds=ctx.settings.compaction_retrigger_seconds,
        )
        refuse_if_erased_since(session, transcript_id, delivered_at)
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
        )
        return response.model_dump(mode="json"), result.pending_jobs()

    try:
        response, pending = deliver_once(ctx.factory, delivery_key, body_hash, write)
    except TranscriptError as exc:
        raise _unprocessable(exc) from None
    except ErasedSinceSignedError as exc:
        hint, retry = ingest.erased_in_its_second(exc.in_its_second)
        raise ApiError(409, str(exc) + hint, headers=retry) from None
    if pending is None:
        return JSONResponse(response, 201, headers=REPLAYED_HEADERS)
    sent = ctx.enqueue(pending)
    # Not the transcript's id: a client's label, which can name a person (the request id is bound).
    logger.info(
        "%s message(s) appended (seq %s-%s), context %s tokens, %s compaction job(s) sent",
        len(messages),
        response["first_seq"],
        response["last_seq"],
        response["context_tokens"],
        sent,
    )
    return JSONResponse(response, 201)


@contextmanager
def _transcript_session(ctx: ApiContext) -> Iterator[Session]:
    """A read session in which a transcript that does not exist is answered 404. One snapshot: its
    figures come from several statements, and an append committed between them (an agent appends
    while it reads) counted more tokens in the context than in the whole history (saved_tokens < 0)."""
    with one_snapshot(ctx.factory) as session:
        try:
            yield session
        except TranscriptNotFoundError as exc:
            raise ApiError(404, str(exc)) from None


def _transcript_out(ctx: ApiContext, transcript_id: str) -> TranscriptOut:
    with _transcript_session(ctx) as session:
        stats = transcript_stats(session, transcript_id)
    return TranscriptOut.model_validate(stats.as_dict())


def accept_settings(
    ctx: ApiContext, transcript_id: str, body: bytes, ingest: Ingest, key: str | None = None
) -> JSONResponse:
    """A repeat with the same Idempotency-Key (which signatures sign; one is needed once v2 is off) gets
    the stored answer and changes nothing: a captured change of settings sent again within the
    signature's window undid the changes made after it."""
    dated = ingest.delivered_at(ctx, body)
    key = check_idempotency_key(key)
    data = load_json_object(body)

    def write(session: Session) -> tuple[Answer, list[tuple[int, str]]]:
        delivered_at = dated(session)
        refuse_if_erased_since(session, transcript_id, delivered_at)  # before and after, as for appends
        _, trigger = update_settings(
            session, transcript_id, data, retrigger_seconds=ctx.settings.compaction_retrigger_seconds
        )
        refuse_if_erased_since(session, transcript_id, delivered_at)
        stats = TranscriptOut.model_validate(transcript_stats(session, transcript_id).as_dict())
        pending = [(trigger.job.job_id, outbox.COMPACTION)] if trigger.job and trigger.job.created else []
        return stats.model_dump(mode="json"), pending

    delivery_key = scoped_key("PUT /v1/transcripts/{id}", transcript_id, key, ingest.sender)
    try:
        response, pending = deliver_once(ctx.factory, delivery_key, hashlib.sha256(body).hexdigest(), write)
    except TranscriptError as exc:
        raise _unprocessable(exc) from None
    except ErasedSinceSignedError as exc:
        hint, retry = ingest.erased_in_its_second(exc.in_its_second)
        raise ApiError(409, str(exc) + hint, headers=retry) from None
    if pending is None:
        return JSONResponse(response, 200, headers=REPLAYED_HEADERS)
    ctx.enqueue(pending)
    logger.info("transcript settings changed: %s", sorted(data))
    return JSONResponse(response, 200)


@compaction_router.post(
    "/v1/transcripts/{transcript_id}/messages",
    status_code=201,
    response_model=AppendOut,
    summary="Append messages to a transcript (signed webhook); queues a compaction when it is due",
    responses=error_responses(400, 401, 403, 409, 413, 422),
    openapi_extra=json_request_body(AppendIn.model_json_schema()),
)
async def post_messages(
    request: Request,
    ctx: Context,
    transcript_id: TranscriptId,
    ingest: TranscriptIngester,
    idempotency_key: IdempotencyHeader = None,
) -> Response:
    """`{"messages": [{role, text, tool_calls, tool_call_id, tool_name}], "settings": {...}}`.

    The transcript is created on first use. Roles are user, assistant and tool; a tool result must
    answer a call of the assistant turn right before it (counting what is already stored). An invalid
    message is answered with 422 naming it (`messages[i]`), and nothing of the request is stored.
    """
    body = await read_body(request, ctx.settings.max_body_bytes)
    return await run_in_threadpool(accept_messages, ctx, transcript_id, body, ingest, idempotency_key)


@compaction_router.put(
    "/v1/transcripts/{transcript_id}",
    response_model=TranscriptOut,
    summary="Create a transcript or change its settings (signed)",
    responses=error_responses(400, 401, 403, 409, 413, 422),
    openapi_extra=json_request_body(SettingsIn.model_json_schema()),
)
async def put_transcript(
    request: Request,
    ctx: Context,
    transcript_id: TranscriptId,
    ingest: TranscriptIngester,
    idempotency_key: IdempotencyHeader = None,
) -> Response:
    """Only the settings sent change. A smaller window can put the context over its threshold at once:
    then a compaction is queued as for an append. A repeat with the same Idempotency-Key gets the first
    answer (header `Idempotent-Replayed: true`) and changes nothing."""
    body = await read_body(request, ctx.settings.max_body_bytes)
    return await run_in_threadpool(accept_settings, ctx, transcript_id, body, ingest, idempotency_key)


# ---------------------------------------------------------------------------
# Reads
# ---------------------------------------------------------------------------


@compaction_router.get(
    "/v1/transcripts",
    response_model=TranscriptList,
    responses=error_responses(401, 403),
    summary="Transcripts, most recently changed first, with their message and token counts",
)
def list_transcripts(
    ctx: Context, _: TranscriptReader, limit: Annotated[int, Query(ge=1, le=1000)] = 50
) -> TranscriptList:
    with read_only(ctx.factory) as session:
        return TranscriptList.model_validate({"transcripts": recent_transcripts(session, limit)})


def _read(
    suffix: str, response_model: type[Any], summary: str, *refusals: int
) -> Callable[[DecoratedCallable], DecoratedCallable]:
    """A transcript read: GET /v1/transcripts/{transcript_id}<suffix>, 404 for a transcript never written."""
    return compaction_router.get(
        "/v1/transcripts/{transcript_id}" + suffix,
        response_model=response_model,
        responses=error_responses(404, *refusals),
        summary=summary,
    )


@_read("", TranscriptOut, "A transcript's settings and its before/after token counts")
def get_transcript(ctx: Context, _: TranscriptReader, transcript_id: TranscriptId) -> TranscriptOut:
    return _transcript_out(ctx, transcript_id)


@_read(
    "/context",
    ContextOut,
    "What to send a model now: the newest accepted summary plus the messages after its cut",
    409,
)
def get_context(ctx: Context, _: TranscriptReader, transcript_id: TranscriptId) -> ContextOut:
    """Repaired for providers: every tool call is followed by its results (a placeholder stands in for
    one that never came), and no tool result is separated from its call. A view past 32 MiB (no summary
    has cut it down) is answered 409; the history is still read in pages from `/messages`."""
    with _transcript_session(ctx) as session:
        try:
            view = context_view(session, transcript_id)
        except ContextTooLargeError as exc:
            raise ApiError(409, str(exc)) from None
        scored = measured_coverage(session, view.compaction_id)
    return ContextOut(
        transcript_id=transcript_id,
        compaction_id=view.compaction_id,
        coverage=scored,
        cut_seq=view.cut_seq,
        tokens=view.tokens,
        messages=[ContextMessageOut.model_validate(m.as_dict()) for m in view.messages],
    )


@_read("/messages", MessagesOut, "The full history, in order (compaction never deletes a message)")
def get_messages(
    ctx: Context,
    _: TranscriptReader,
    transcript_id: TranscriptId,
    after_seq: Annotated[
        int | None, Query(ge=-1, le=INT4_MAX, description="Only messages after this seq (paging)")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
) -> MessagesOut:
    with _transcript_session(ctx) as session:
        rows, more = list_messages(session, transcript_id, after_seq=after_seq, limit=limit)
        messages = [StoredMessageOut.model_validate(row) for row in rows]
    next_after = messages[-1].seq if more else None
    return MessagesOut(transcript_id=transcript_id, messages=messages, next_after_seq=next_after)


@_read(
    "/compactions",
    CompactionsOut,
    "Compactions of a transcript, newest first (label one with POST /v1/feedback)",
)
def get_compactions(
    ctx: Context,
    _: TranscriptReader,
    transcript_id: TranscriptId,
    limit: Annotated[int, Query(ge=1, le=1000)] = 50,
    before_id: Annotated[
        int | None, Query(ge=1, le=BIGINT_MAX, description="Only compactions with a smaller id")
    ] = None,
) -> CompactionsOut:
    """Accepted, rejected and failed alike. To label one for calibration, send its `id` as
    `compaction_id` and its `coverage` to `POST /v1/feedback` with whether the answer survived."""
    with _transcript_session(ctx) as session:
        rows, more = list_compactions(session, transcript_id, limit=limit, before_id=before_id)
        compactions = [CompactionOut.model_validate(row) for row in rows]
    next_before = compactions[-1].id if more else None
    return CompactionsOut(transcript_id=transcript_id, compactions=compactions, next_before_id=next_before)


@compaction_router.delete(
    "/v1/transcripts/{transcript_id}",
    response_model=TranscriptErased,
    summary="Erase a transcript: its messages and compactions (admin)",
    responses=error_responses(401, 403, 404),
)
def delete_transcript(ctx: Context, admin: Admin, transcript_id: TranscriptId) -> TranscriptErased:
    """Remove the transcript, its messages and its compactions (their summaries) in one transaction, and
    fail its pending compaction jobs; one row in `transcript_erasures` records that it happened (the
    id's sha256, no text). Its jobs and the answers kept for its appends name it by that digest."""
    report = erase_transcript(ctx.factory, transcript_id, requested_by=admin.actor)
    if report is None:
        raise ApiError(404, no_transcript_to_erase(ctx.factory, transcript_id))
    return TranscriptErased(transcript_id=transcript_id, **report.as_dict())


__all__ = ["accept_messages", "accept_settings", "compaction_router", "delete_transcript"]
