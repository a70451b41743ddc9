"""The job history over HTTP: list, one job, retry (worker.jobs.queries has the rules the CLI uses too)."""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Path, Query
from pydantic import BaseModel, ConfigDict

from models import Job
from models.reads import one_snapshot, read_only
from worker.access import Principal
from worker.accounting.reports import job_spend
from worker.api.auth import Admin, Reader
from worker.api.deps import Context
from worker.api.errors import ApiError, error_responses
from worker.api.inputs import BIGINT_MAX
from worker.jobs import outbox, queries

logger = logging.getLogger(__name__)

JobStatus = Literal["queued", "running", "paused", "succeeded", "failed"]  # = models.JOB_STATUSES
JobKind = Literal[
    "extraction", "compaction", "calibration", "consolidation", "batch_extraction"
]  # = worker.jobs.JOB_KINDS

jobs_router = APIRouter(tags=["jobs"])
JobId = Annotated[int, Path(ge=1, le=BIGINT_MAX, description="The job id the webhook answered with")]


class JobSpendOut(BaseModel):
    """What the job's LLM calls used and cost, from its llm_calls rows (every try, batch or online)."""

    calls: int
    input_tokens: int  # every prompt token, cached ones included
    cached_tokens: int  # of input_tokens, read from the provider's prompt cache
    output_tokens: int
    cost_usd: float
    # Of cost_usd, what the job's own budget (llm.budget_job_usd) counts: its calls since its budgets
    # last started over (its creation, a rerun for new content, an operator's retry).
    budget_cost_usd: float


class JobOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    kind: str
    subject: str
    source_id: str | None = None  # page jobs (extraction) only
    slug: str | None = None
    status: str
    attempts: int  # runs that reached a verdict of their own (capped by FACTMILL_JOB_MAX_ATTEMPTS)
    worker_losses: int  # runs their worker never finished (capped by FACTMILL_JOB_MAX_WORKER_LOSSES)
    # Since when the LLM provider has served the job nothing (an outage; empty while it serves it): the
    # job fails FACTMILL_JOB_PROVIDER_OUTAGE_PATIENCE_SECONDS after it (worker.jobs.outages).
    provider_outage_since: datetime | None = None
    pause_reason: str | None = None  # a paused job's: kill_switch, budget, batch, batch_fault
    options: dict[str, Any]
    counters: dict[str, Any]
    last_error: str | None
    rerun_requested: bool
    worker: str | None
    created_at: datetime
    updated_at: datetime
    enqueued_at: datetime | None
    started_at: datetime | None
    finished_at: datetime | None
    heartbeat_at: datetime | None
    spend: JobSpendOut | None = None  # GET /v1/jobs/{id}, for a key with the metrics or admin scope

    @classmethod
    def of(cls, job: Job, principal: Principal) -> JobOut:
        """The job as ``principal`` sees it: spend among its counters only with the metrics scope."""
        out = cls.model_validate(job)
        out.counters = queries.counters_shown(out.counters, figures=principal.has("metrics"))
        if job.kind == outbox.EXTRACTION:
            out.source_id, out.slug = outbox.split_page_subject(job.subject)
        return out


class JobList(BaseModel):
    jobs: list[JobOut]


@jobs_router.get("/v1/jobs", response_model=JobList, summary="List jobs, newest first")
def list_jobs(
    ctx: Context,
    principal: Reader,
    status: Annotated[JobStatus | None, Query(description="Only jobs in this status")] = None,
    kind: Annotated[JobKind | None, Query(description="Only jobs of this kind")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 50,
    before_id: Annotated[
        int | None, Query(ge=1, le=BIGINT_MAX, description="Only jobs with a smaller id (paging)")
    ] = None,
) -> JobList:
    with read_only(ctx.factory) as session:
        found = queries.list_jobs(
            session,
            status=status,
            kind=kind,
            limit=limit,
            before_id=before_id,
            source_ids=principal.source_ids,
        )
        return JobList(jobs=[JobOut.of(job, principal) for job in found])


@jobs_router.get(
    "/v1/jobs/{job_id}", response_model=JobOut, responses=error_responses(404), summary="One job"
)
def get_job(ctx: Context, principal: Reader, job_id: JobId) -> JobOut:
    with one_snapshot(ctx.factory) as session:
        job = session.get(Job, job_id)
        if job is None or not _visible(principal, job):
            raise ApiError(404, f"no job {job_id}")
        out = JobOut.of(job, principal)
        if principal.has("metrics"):  # spend is the metrics' and the admin's (readers see no figures)
            out.spend = JobSpendOut(**job_spend(session, job_id).as_dict())
        return out


def _visible(principal: Principal, job: Job) -> bool:
    """A source-limited key sees the page jobs of its sources only (another source's job is a 404)."""
    if principal.source_ids is None:
        return True
    return job.kind == outbox.EXTRACTION and principal.sees(outbox.split_page_subject(job.subject)[0])


@jobs_router.post(
    "/v1/jobs/{job_id}/retry",
    status_code=202,
    response_model=JobOut,
    responses=error_responses(404, 409, 422),
    summary="Queue a failed, paused or succeeded job again",
)
def retry(
    ctx: Context,
    admin: Admin,
    job_id: JobId,
    skipped: Annotated[
        bool,
        Query(
            description="Re-extract only the page's skipped (poison) segments, in page order, each "
            "committed once (extraction jobs only)"
        ),
    ] = False,
) -> JobOut:
    """A failed, paused or succeeded job is queued again (attempts and worker losses reset) and sent to
    its queue. With ``skipped=true`` the run re-extracts its page's skipped segments first.

    A queued or running job is left alone and answered with 409: it is already on its way (and
    the sweeper re-sends a queued job whose message was lost), so a retry would only duplicate it.
    So is a job whose page or transcript was erased: there is nothing left to extract or compact.
    ``skipped`` on a job of another kind is 422 (only extraction jobs skip segments).
    """
    try:
        with ctx.factory.begin() as session:
            out = JobOut.of(queries.retry(session, job_id, skipped=skipped), admin)
    except queries.JobNotFoundError as exc:
        raise ApiError(404, str(exc)) from None
    except (queries.JobNotRetryableError, queries.JobSubjectGoneError) as exc:
        raise ApiError(409, str(exc)) from None
    except queries.JobHasNoSegmentsError as exc:
        raise ApiError(422, str(exc)) from None
    except queries.JobAlreadyPendingError as exc:
        raise ApiError(409, str(exc), pending_job_id=exc.pending_job_id) from None
    ctx.enqueue([(out.id, out.kind)])
    logger.info("job %s re-queued by the API", job_id)
    return out


__all__ = ["JobKind", "JobList", "JobOut", "JobSpendOut", "JobStatus", "jobs_router"]
