"""Operating a backfill: cancel it, wake the ones waiting on batches (beat), show its progress."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from models import Backfill, BackfillBatch
from models.backfill import REQUEST_STATUSES
from worker.extraction.backfill import BATCH_EXTRACTION, WAITING_FOR_BATCHES
from worker.extraction.backfill_store import job_status, request_counts, spend
from worker.jobs.outbox import enqueue, resume_paused


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
    return resume_waiting(session, job_id=backfill.job_id)


def resume_waiting(session: Session, job_id: int | None = None) -> list[tuple[int, str]]:
    """Queue again the backfill jobs paused while their batches run (all, or one); to enqueue after."""
    job_ids = None if job_id is None else [job_id]
    return resume_paused(session, [BATCH_EXTRACTION], WAITING_FOR_BATCHES, job_ids)


def wake_waiting_backfills(factory: sessionmaker[Session]) -> int:
    """Beat's poll: every backfill job waiting on provider batches runs a pass."""
    with factory.begin() as session:
        woken = resume_waiting(session)
    return enqueue(factory, woken)


def backfill_report(factory: sessionmaker[Session], backfill_id: int) -> dict[str, object]:
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
        "id": backfill.id,
        "source_id": backfill.source_id,
        "filters": backfill.filters,
        "status": backfill.status,
        "cancel_requested": backfill.cancel_requested,
        "job_id": backfill.job_id,
        "job_status": job,
        "job_note": job_note,
        "created_at": backfill.created_at.isoformat(),
        "finished_at": backfill.finished_at.isoformat() if backfill.finished_at else None,
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
