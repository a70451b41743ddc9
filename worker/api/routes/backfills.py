"""Backfills over HTTP (admin scope): start one, follow it, cancel it (worker.extraction.backfill)."""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, Strict
from starlette.concurrency import run_in_threadpool

from models.reads import read_only
from worker.access import Principal
from worker.api.auth import Admin
from worker.api.deps import ApiContext, Context, json_request_body, parse_json_model, read_body
from worker.api.errors import ApiError, error_responses
from worker.api.inputs import BigIntIdPath, SourceIdField, StorableStr
from worker.core.jsonvalues import BIGINT_MAX, json_integer
from worker.extraction.backfill_admin import (
    BackfillReport,
    BackfillSummary,
    backfill_report,
    cancel_backfill,
    list_backfills,
)
from worker.extraction.backfill_request import (
    BATCH_EXTRACTION,
    MAX_BACKFILL_SEGMENTS,
    BackfillSelection,
    NothingToBackfillError,
    request_backfill,
)
from worker.extraction.pages import MAX_SLUG_INPUT_LENGTH
from worker.llm.batches import batch_unavailable

logger = logging.getLogger(__name__)

backfills_router = APIRouter(tags=["backfills"])
MAX_BACKFILL_BODY_BYTES = 64 * 1024


class BackfillIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    source_id: SourceIdField = "default"
    since: Annotated[
        datetime | None,
        Field(
            description="Pass over, for good, the messages up to this ISO-8601 time: the checkpoint of each "
            "page extracted moves past them (only `factmill extract --force` takes them again); a page with "
            "nothing to extract after it is left as it was"
        ),
    ] = None
    slug_prefix: Annotated[StorableStr | None, Field(max_length=MAX_SLUG_INPUT_LENGTH)] = None
    max_segments: (
        Annotated[int, Strict(), Field(ge=1, le=MAX_BACKFILL_SEGMENTS), BeforeValidator(json_integer)] | None
    ) = None  # a JSON integer: true is not 1


class BackfillCreated(BaseModel):
    id: int
    job_id: int


BackfillStatus = Literal["planning", "running", "done", "cancelled"]  # = models.backfill.BACKFILL_STATUSES


class BackfillList(BaseModel):
    backfills: list[BackfillSummary]


@backfills_router.post(
    "/v1/backfills",
    status_code=202,
    response_model=BackfillCreated,
    responses=error_responses(404, 409, 413, 422),
    summary="Start a backfill through provider batches (half price)",
    openapi_extra=json_request_body(BackfillIn.model_json_schema()),
)
async def create_backfill(request: Request, ctx: Context, principal: Admin) -> BackfillCreated:
    """A batch_extraction job plans the selected pages' pending segments, stores every batch and its
    requests, sends them to the provider, and commits their results as they end. Answers at once;
    404 when no stored page of a type extraction reads (config extraction.page_types) matches the
    selection (nothing would be planned); 409 when the deployment's
    LLM provider has no batch API (FACTMILL_LLM=openai-compatible)."""
    # Read here, after the admin check and under a small cap: a body parameter is read and parsed by
    # FastAPI before any dependency runs, so anyone could make the API parse 25 MiB of JSON.
    body = parse_json_model(await read_body(request, MAX_BACKFILL_BODY_BYTES), BackfillIn)
    return await run_in_threadpool(_create_backfill, ctx, principal, body)


def _create_backfill(ctx: ApiContext, principal: Principal, body: BackfillIn) -> BackfillCreated:
    unavailable = batch_unavailable(ctx.settings)
    if unavailable:
        raise ApiError(409, unavailable)
    since = body.since.isoformat() if body.since else None
    selection = BackfillSelection(body.source_id, since, body.slug_prefix, body.max_segments)
    try:
        with ctx.factory.begin() as session:
            backfill_id, job_id = request_backfill(session, selection, created_by=principal.name)
    except NothingToBackfillError as exc:
        raise ApiError(404, str(exc)) from None
    except ValueError as exc:
        raise ApiError(422, str(exc)) from None
    ctx.enqueue([(job_id, BATCH_EXTRACTION)])
    logger.info("backfill %s requested over the API (job %s)", backfill_id, job_id)
    return BackfillCreated(id=backfill_id, job_id=job_id)


@backfills_router.get("/v1/backfills", response_model=BackfillList, summary="List backfills, newest first")
def get_backfills(
    ctx: Context,
    _: Admin,
    status: Annotated[BackfillStatus | None, Query(description="Only backfills in this status")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 50,
    before_id: Annotated[
        int | None, Query(ge=1, le=BIGINT_MAX, description="Only backfills with a smaller id (paging)")
    ] = None,
) -> BackfillList:
    with read_only(ctx.factory) as session:
        found = list_backfills(session, status=status, limit=limit, before_id=before_id)
    return BackfillList.model_validate({"backfills": found})


@backfills_router.get(
    "/v1/backfills/{backfill_id}",
    response_model=BackfillReport,
    responses=error_responses(404),
    summary="A backfill's state and progress",
)
def get_backfill(ctx: Context, _: Admin, backfill_id: BigIntIdPath) -> BackfillReport:
    try:
        return backfill_report(ctx.factory, backfill_id)
    except LookupError as exc:
        raise ApiError(404, str(exc)) from None


@backfills_router.post(
    "/v1/backfills/{backfill_id}/cancel",
    status_code=202,
    response_model=BackfillReport,
    responses=error_responses(404),
    summary="Cancel a backfill",
)
def cancel(ctx: Context, _: Admin, backfill_id: BigIntIdPath) -> BackfillReport:
    """Unsent batches never go; running ones are cancelled at the provider, and what they finished
    (paid for) is still committed. A finished backfill is answered as it is."""
    try:
        with ctx.factory.begin() as session:
            woken = cancel_backfill(session, backfill_id)
    except LookupError as exc:
        raise ApiError(404, str(exc)) from None
    ctx.enqueue(woken or [])
    return backfill_report(ctx.factory, backfill_id)
