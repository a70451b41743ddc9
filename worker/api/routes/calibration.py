"""Calibration API: signed feedback (did a compaction keep the answer?) and the threshold versions.

``POST /v1/feedback`` is signed exactly like the page webhooks (``Factmill-Signature`` over the raw
body). It stores one observation and, every ``FACTMILL_CALIBRATION_RECOMPUTE_EVERY`` new ones,
requests a recompute on the calibration queue, sent only after the commit.
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError
from starlette.concurrency import run_in_threadpool

from models import CalibrationThreshold
from models.reads import one_snapshot
from worker.api.auth import CalibrationReader, FeedbackIngester, Ingest
from worker.api.deps import (
    IDEMPOTENCY_HEADER,
    ApiContext,
    Context,
    check_idempotency_key,
    idempotency_header,
    json_request_body,
    load_json_object,
    read_body,
)
from worker.api.errors import ApiError, error_responses, problems_of, summarize
from worker.api.inputs import JsonBigIntId
from worker.calibration import (
    MAX_KEY_LENGTH,
    MAX_ORIGIN_LENGTH,
    ObservationError,
    ObservationIn,
    UnknownCompactionError,
    active_threshold,
    add_observation,
    observation_stats,
    threshold_history,
)
from worker.core.labels import LABEL_PATTERN
from worker.deliveries import WEBHOOK_SENDER

logger = logging.getLogger(__name__)

# A feedback body is a handful of fields; anything near this size is not one.
MAX_FEEDBACK_BYTES = 64 * 1024

calibration_router = APIRouter(tags=["calibration"])

FeedbackKeyHeader = Annotated[
    str | None, idempotency_header("Same as the body's idempotency_key", MAX_KEY_LENGTH)
]


class FeedbackIn(BaseModel):
    """One labelled case: the coverage a compaction scored and whether the answer survived it."""

    model_config = ConfigDict(extra="forbid")

    coverage: Annotated[
        float,
        Field(
            ge=0, le=1, allow_inf_nan=False, strict=True, description="Coverage the summary scored, 0 to 1"
        ),
    ]
    answer_kept: Annotated[StrictBool, Field(description="Did the compressed context still hold the answer?")]
    origin: Annotated[
        str,
        Field(
            description="Who judged it, e.g. 'eval:nightly' (surrounding whitespace is dropped)",
            max_length=MAX_ORIGIN_LENGTH,
            json_schema_extra={"pattern": LABEL_PATTERN},
        ),
    ]
    compaction_id: Annotated[JsonBigIntId | None, Field(description="The compaction judged")] = None
    idempotency_key: Annotated[
        str | None,
        Field(
            description="A resubmission with this key is answered as a duplicate and stored once",
            max_length=MAX_KEY_LENGTH,
            json_schema_extra={"pattern": LABEL_PATTERN},
        ),
    ] = None


class FeedbackOut(BaseModel):
    id: int
    duplicate: bool  # True: this key (or this exact compaction judgement) was already stored
    coverage: float
    answer_kept: bool
    origin: str
    compaction_id: int | None
    recompute_job_id: int | None  # set when this observation made a recompute due


def _parse_feedback(body: bytes, header_key: str | None, sender: str) -> ObservationIn:
    data = load_json_object(body, "a JSON object with coverage, answer_kept and origin")
    try:
        feedback = FeedbackIn.model_validate(data)
    except ValidationError as exc:
        problems = problems_of(exc.errors(include_url=False))
        raise ApiError(422, summarize(problems), errors=problems) from None
    key = feedback.idempotency_key
    if header_key is not None:
        if key is not None and key.strip() != header_key:
            raise ApiError(
                422,
                f"{IDEMPOTENCY_HEADER} header and idempotency_key differ; send one key, or the same in both",
            )
        key = header_key
    try:
        return ObservationIn(
            coverage=feedback.coverage,
            answer_kept=feedback.answer_kept,
            origin=feedback.origin,
            compaction_id=feedback.compaction_id,
            idempotency_key=key,
            sender="" if sender == WEBHOOK_SENDER else sender,
        )
    except ObservationError as exc:
        raise ApiError(422, str(exc)) from None


def accept_feedback(ctx: ApiContext, body: bytes, ingest: Ingest, header_key: str | None) -> JSONResponse:
    """Verify, validate, store, commit, then enqueue a due recompute (blocking: runs on a worker thread)."""
    ingest.verify(ctx, body)
    observation = _parse_feedback(body, check_idempotency_key(header_key), ingest.sender)
    try:
        report = add_observation(
            ctx.factory, observation, recompute_every=ctx.settings.calibration_recompute_every
        )
    except UnknownCompactionError as exc:
        raise ApiError(409, str(exc)) from None
    except ObservationError as exc:  # a key reused for a different observation (as Idempotency-Key: 422)
        raise ApiError(422, str(exc)) from None
    [stored] = report.stored
    pending = report.pending_jobs()
    ctx.enqueue(pending)
    out = FeedbackOut(
        id=stored.id,
        duplicate=stored.duplicate,
        coverage=observation.coverage if stored.coverage is None else stored.coverage,  # as stored
        answer_kept=observation.answer_kept,
        origin=observation.origin,
        compaction_id=observation.compaction_id,
        recompute_job_id=report.recompute.job_id if report.recompute is not None else None,
    )
    # The origin is a client's own label (it may name a person): stored, never logged.
    if stored.duplicate:
        logger.info("duplicate feedback for observation %s", stored.id)
    else:
        logger.info(
            "feedback stored as observation %s (coverage %.4f, kept %s); %s recompute(s) sent",
            stored.id,
            observation.coverage,
            observation.answer_kept,
            len(pending),
        )
    return JSONResponse(out.model_dump(mode="json"), 200 if stored.duplicate else 201)


@calibration_router.post(
    "/v1/feedback",
    status_code=201,
    response_model=FeedbackOut,
    summary="Record whether a compaction kept the answer (signed webhook)",
    responses={
        200: {"model": FeedbackOut, "description": "A duplicate: stored before"},
        **error_responses(401, 403, 409, 413, 422),
    },
    openapi_extra=json_request_body(FeedbackIn.model_json_schema()),
)
async def post_feedback(
    request: Request,
    ctx: Context,
    ingest: FeedbackIngester,
    idempotency_key: FeedbackKeyHeader = None,
) -> Response:
    """Store one observation: 201 when new, 200 with `"duplicate": true` when resubmitted.

    Coverage must be a number from 0 to 1 (NaN and infinities are refused with 422), and a
    `compaction_id` must name an existing compaction that was judged (one with a coverage; else 409).
    A resubmission is recognised by its `idempotency_key` (body or header), or, for a judgement of a
    known compaction, by its identical origin, compaction_id, coverage and answer_kept.
    """
    body = await read_body(request, min(ctx.settings.max_body_bytes, MAX_FEEDBACK_BYTES))
    return await run_in_threadpool(accept_feedback, ctx, body, ingest, idempotency_key)


class ThresholdOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    version: int
    tau: float | None  # None: no threshold was computed (see reason)
    active: bool
    reason: str
    alpha: float
    target_recall: float
    min_observations: int
    n: int
    n_bad: int
    calibration_n: int
    calibration_n_bad: int
    held_out_n: int
    held_out_n_bad: int
    held_out_accepted: int
    held_out_rate: float | None
    split_method: str
    max_observation_id: int | None
    trigger: str
    job_id: int | None
    computed_at: datetime
    activated_at: datetime | None


class ObservationsOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    n: int
    kept: int
    lost: int
    since_last_version: int
    last_at: datetime | None


class CalibrationOut(BaseModel):
    tau: float  # what gates use now
    version: int | None  # the active version; None: no version is active and tau is the fallback
    fallback: bool
    active: ThresholdOut | None
    observations: ObservationsOut
    history: list[ThresholdOut]  # newest first


@calibration_router.get(
    "/v1/calibration", response_model=CalibrationOut, summary="The active threshold and its history"
)
def get_calibration(
    ctx: Context,
    _: CalibrationReader,
    limit: Annotated[int, Query(ge=1, le=1000, description="History versions to list")] = 50,
) -> CalibrationOut:
    with one_snapshot(ctx.factory) as session:  # a version activated meanwhile shows in all or none
        current = active_threshold(session)
        history = [ThresholdOut.model_validate(row) for row in threshold_history(session, limit)]
        active_row = (
            session.get(CalibrationThreshold, current.version) if current.version is not None else None
        )
        observations = ObservationsOut.model_validate(observation_stats(session))
        active = ThresholdOut.model_validate(active_row) if active_row is not None else None
    return CalibrationOut(
        tau=current.tau,
        version=current.version,
        fallback=current.version is None,
        active=active,
        observations=observations,
        history=history,
    )


__all__ = ["MAX_FEEDBACK_BYTES", "accept_feedback", "calibration_router"]
