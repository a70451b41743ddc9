"""Operating a backfill: cancel it, wake the ones waiting on batches (beat), show its progress, list
the backfills."""

from __future__ import annotations

import logging
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker
from typing_extensions import TypedDict  # pydantic reads it on Python 3.11 (the API answers with these)

from models import Backfill, BackfillBatch, Job
from models.backfill import REQUEST_STATUSES
from worker.extraction.backfill_request import BATCH_EXTRACTION, BATCH_FAULT, WAITING_FOR_BATCHES
from worker.extraction.backfill_store import job_status, request_counts, spend
from worker.extraction.provider_copies import sweep_provider_copies
from worker.jobs.outbox import BUDGET, resume_paused, retry_job
from worker.jobs.registry import KILL_SWITCH
from worker.jobs.sending import enqueue
from worker.llm.gateway import LLMConfigurationError
from worker.settings import Settings

logger = logging.getLogger(__name__)


def cancel_backfill(session: Session, backfill_id: int) -> list[tuple[int, str]] | None:
    """Ask the backfill to stop (in the caller's transaction): unsent batches never go, running ones are
    cancelled at the provider and what they finished is still committed. Returns its job to enqueue
    once committed (woken if it was waiting on batches), or None if the backfill had finished."""
    backfill = session.get(Backfill, backfill_id, with_for_update=True)
    if backfill is None:
        raise LookupError(f"no backfill {backfill_id}")
    if backfill.status in ("done", "cancelled"):
        return None
    backfill.cancel_requested = True
    woken = resume_waiting(session, job_id=backfill.job_id)
    if backfill.job_id is not None:  # one waiting for budget: cancelling needs none
        woken += resume_paused(session, [BATCH_EXTRACTION], BUDGET, [backfill.job_id], wait=True)
        # Nor the kill switch: the run cancels the batches at the provider, and waits for the switch
        # to collect them (worker.extraction.backfill_job.cancel_while_switched_off).
        woken += resume_paused(session, [BATCH_EXTRACTION], KILL_SWITCH, [backfill.job_id], wait=True)
        job = session.get(Job, backfill.job_id, with_for_update=True)
        if job is not None and job.status == "failed":
            # Its retries spent (the provider kept refusing): nothing would run the cancel, and the
            # batches it sent would never be cancelled or collected.
            woken.append((retry_job(session, job.id).id, BATCH_EXTRACTION))
    return woken


def resume_waiting(session: Session, job_id: int | None = None) -> list[tuple[int, str]]:
    """Queue again the backfill jobs paused while their batches run, or while asking about them fails
    (all, or one); to enqueue after."""
    job_ids = None if job_id is None else [job_id]
    return [
        job
        for reason in (WAITING_FOR_BATCHES, BATCH_FAULT)
        for job in resume_paused(session, [BATCH_EXTRACTION], reason, job_ids, wait=job_id is not None)
    ]


def poll_backfills(factory: sessionmaker[Session], settings: Settings) -> int:
    """Beat's poll: every backfill job waiting on provider batches is sent a pass, and the batch copies
    owed a delete at the provider are deleted where due. Answers the jobs sent."""
    with factory.begin() as session:
        woken = resume_waiting(session)
    sent = enqueue(factory, woken)
    try:
        sweep_provider_copies(factory, settings)
    except LLMConfigurationError as exc:
        logger.warning("provider copies: cannot reach the provider to delete them (%s)", exc)
    return sent


class BackfillSummary(TypedDict):
    """What a list of backfills shows of each: its selection, its state and its job's."""

    id: int
    source_id: str
    filters: dict[str, Any]
    status: str
    cancel_requested: bool
    # Selected pages (by source and slug; a --since applies when a page is planned) left to an
    # overlapping backfill that had requests out for them, when planned or when sent: not extracted by
    # this one (a cancel of the other leaves them to a later run).
    pages_left_to_others: int
    job_id: int | None
    job_status: str | None
    job_note: str | None
    created_by: str | None
    created_at: str
    finished_at: str | None


def backfill_summary(backfill: Backfill, job: str | None, job_note: str | None) -> BackfillSummary:
    return {
        "id": backfill.id,
        "source_id": backfill.source_id,
        "filters": backfill.filters,
        "status": backfill.status,
        "cancel_requested": backfill.cancel_requested,
        "pages_left_to_others": backfill.pages_left_to_others,
        "job_id": backfill.job_id,
        "job_status": job,
        "job_note": job_note,
        "created_by": backfill.created_by,
        "created_at": backfill.created_at.isoformat(),
        "finished_at": backfill.finished_at.isoformat() if backfill.finished_at else None,
    }


def list_backfills(
    session: Session, *, status: str | None = None, limit: int = 50, before_id: int | None = None
) -> list[BackfillSummary]:
    """Backfills newest first (``before_id`` pages backwards), optionally in one status, each with its
    job's status; `backfill_report` has the batches, requests and spend of one."""
    query = (
        select(Backfill, Job.status, Job.last_error)
        .outerjoin(Job, Job.id == Backfill.job_id)
        .order_by(Backfill.id.desc())
        .limit(limit)
    )
    if status is not None:
        query = query.where(Backfill.status == status)
    if before_id is not None:
        query = query.where(Backfill.id < before_id)
    return [backfill_summary(*row) for row in session.execute(query).all()]


class BackfillReport(BackfillSummary):
    """A backfill's state: its batches, its requests by status, its LLM calls and cost so far."""

    requests: dict[str, int]
    llm_calls: int
    cost_usd: str
    batches: list[dict[str, Any]]


def backfill_report(factory: sessionmaker[Session], backfill_id: int) -> BackfillReport:
    """A backfill's state and progress: its batches, its requests by status, what it cost so far."""
    with factory() as session:
        backfill = session.get(Backfill, backfill_id)
        if backfill is None:
            raise LookupError(f"no backfill {backfill_id}")
        batches = session.scalars(
            select(BackfillBatch).where(BackfillBatch.backfill_id == backfill_id).order_by(BackfillBatch.id)
        ).all()
        counts = request_counts(session, backfill_id)
        calls, cost = spend(session, backfill.job_id)
        job, job_note = job_status(session, backfill.job_id)
    total = sum(counts.values())
    return {
        **backfill_summary(backfill, job, job_note),
        "requests": {"total": total, **{status: counts.get(status, 0) for status in REQUEST_STATUSES}},
        "llm_calls": calls,
        "cost_usd": cost,
        "batches": [
            {
                "key": b.key,
                "provider": b.provider,
                "provider_batch_id": b.provider_batch_id,
                "status": b.status,
                "provider_status": b.provider_status,
            }
            for b in batches
        ],
    }
