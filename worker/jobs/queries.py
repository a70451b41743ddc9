"""What operators ask of jobs, shared by the API and the CLI: list them, and retry one (one 409 rule)."""

from __future__ import annotations

from collections.abc import Collection

from sqlalchemy import Select, inspect, literal_column, select, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from models import Job, Transcript, page_id_of
from models.job import PAGE_JOB, PAGE_SOURCE
from worker.jobs.outbox import COMPACTION, EXTRACTION, PENDING, retry_job, split_page_subject
from worker.jobs.outbox import JobHasNoSegmentsError as JobHasNoSegmentsError  # raised by retry
from worker.jobs.registry import kind_names

# A job's counters that are spend (a backfill's cost, an extraction's calls and tokens, a consolidation's
# prompt tokens): shown only to a key that may see figures (metrics or admin), as a job's spend is; a
# reader's list showed them. (A compaction's tokens before and after are the transcript's size.)
SPEND_COUNTERS = frozenset({"cost_usd", "llm_calls", "input_tokens", "output_tokens", "prompt_tokens"})


def counters_shown(counters: dict[str, object], *, figures: bool) -> dict[str, object]:
    """A job's counters as a caller sees them: without the spend unless it may see ``figures``."""
    return dict(counters) if figures else {k: v for k, v in counters.items() if k not in SPEND_COUNTERS}


class JobNotFoundError(LookupError):
    def __init__(self, job_id: int) -> None:
        super().__init__(f"no job {job_id}")
        self.job_id = job_id


class JobNotRetryableError(ValueError):
    """A queued or running job is already on its way; retrying it would only duplicate it."""

    def __init__(self, job_id: int, status: str) -> None:
        super().__init__(f"job {job_id} is {status}; only a failed, paused or succeeded job can be retried")
        self.job_id, self.status = job_id, status


class JobKindUnknownError(JobNotRetryableError):
    """A job of a kind this release does not run (a row from another version): queued, no worker would
    take it, and the sweeper passes it by."""

    def __init__(self, job_id: int, kind: str) -> None:
        ValueError.__init__(
            self,
            f"job {job_id} is of kind {kind!r}, which this release does not run "
            f"(it runs {', '.join(kind_names())}): retry it from a release that does",
        )
        self.job_id, self.status = job_id, "unknown kind"


class JobSubjectGoneError(ValueError):
    """A job whose subject is no longer stored: there is nothing left for it to do (409)."""

    def __init__(self, job_id: int, message: str) -> None:
        super().__init__(message)
        self.job_id = job_id


class JobPageGoneError(JobSubjectGoneError):
    """An extraction job whose page is no longer stored (erased, or never stored under that name)."""

    def __init__(self, job_id: int) -> None:
        super().__init__(
            job_id,
            f"job {job_id}'s page is no longer stored (it was erased): there is nothing to extract; "
            "a page delivered again gets a job of its own",
        )


class JobTranscriptGoneError(JobSubjectGoneError):
    """A compaction job whose transcript is no longer stored (erased)."""

    def __init__(self, job_id: int) -> None:
        super().__init__(
            job_id,
            f"job {job_id}'s transcript is no longer stored (it was erased): there is nothing to compact; "
            "messages appended again start a transcript of their own",
        )


class JobAlreadyPendingError(ValueError):
    """Another job for the same subject is pending (one pending job per subject)."""

    def __init__(self, job_id: int, pending_job_id: int | None) -> None:
        super().__init__(
            f"job {pending_job_id} for the same subject is already pending; follow that job instead"
        )
        self.job_id, self.pending_job_id = job_id, pending_job_id


def list_jobs(
    session: Session,
    *,
    status: str | None = None,
    kind: str | None = None,
    limit: int = 50,
    before_id: int | None = None,
    source_ids: Collection[str] | None = None,
) -> list[Job]:
    """Jobs newest first, optionally filtered; ``before_id`` pages backwards. ``source_ids`` keeps only
    the page (extraction) jobs of those sources."""
    query = job_list_query(status, kind, limit, before_id, source_ids)
    return list(session.scalars(query))


def job_list_query(
    status: str | None,
    kind: str | None,
    limit: int,
    before_id: int | None,
    source_ids: Collection[str] | None,
) -> Select[Job]:
    """The statement list_jobs runs."""
    query = select(Job).order_by(Job.id.desc()).limit(limit)
    if status is not None:
        query = query.where(Job.status == status)
    if kind is not None:
        query = query.where(Job.kind == kind)
    if before_id is not None:
        query = query.where(Job.id < before_id)
    if source_ids is not None:
        # ix_jobs_page_source's predicate and expression as SQL constants, so a source with few jobs reads
        # only those: as bound parameters, a prepared statement's generic plan could match neither (a scan
        # of every job: 0.3 s at a million).
        query = query.where(text(PAGE_JOB), literal_column(PAGE_SOURCE).in_(sorted(source_ids)))
    return query


def retry(session: Session, job_id: int, *, skipped: bool = False) -> Job:
    """Queue a failed, paused or succeeded job again (both budgets reset), in the caller's transaction.
    With ``skipped``, the extraction job re-extracts its page's skipped segments first (in page order).

    Raises JobNotFoundError, JobNotRetryableError (queued or running: already on its way; the sweeper
    re-sends a queued job whose message was lost), JobSubjectGoneError (an extraction job whose page
    is gone: JobPageGoneError; a compaction job whose transcript is: JobTranscriptGoneError) or
    JobAlreadyPendingError. The caller enqueues the job after its commit. Raises
    JobHasNoSegmentsError for ``skipped`` on another kind of job.
    """
    try:
        with session.begin_nested():
            job = retry_job(session, job_id, skipped=skipped)
            if job.kind not in kind_names():  # (its send would fail after the commit: a 500, stuck queued)
                raise JobKindUnknownError(job_id, job.kind)
            if not inspect(job).attrs.status.history.has_changes():
                raise JobNotRetryableError(job_id, job.status)
            if job.kind == EXTRACTION and page_id_of(session, *split_page_subject(job.subject)) is None:
                raise JobPageGoneError(job_id)
            if job.kind == COMPACTION and session.get(Transcript, job.subject) is None:
                # (an erasure fails its jobs as cancelled and renames their subject: accepted, the retry
                # failed in the worker, counted as a real failure by the failing-jobs alert)
                raise JobTranscriptGoneError(job_id)
            session.flush()
    except LookupError:
        raise JobNotFoundError(job_id) from None
    except IntegrityError:
        retried = select(Job.kind, Job.subject).where(Job.id == job_id).subquery()
        other = session.scalar(  # the pending job of the same kind (the unique index is (kind, subject))
            select(Job.id).where(
                Job.kind == retried.c.kind, Job.subject == retried.c.subject, Job.status.in_(PENDING)
            )
        )
        raise JobAlreadyPendingError(job_id, other) from None
    return job
