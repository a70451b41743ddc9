"""Finished jobs past FACTMILL_JOB_RETENTION_DAYS: the sweep deletes them, oldest first, a batch at a
time; what named them stays, and a job a backfill or a threshold version names stays too."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
from sqlalchemy import delete, func, select, update
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from models import Backfill, CalibrationThreshold, ExtractionAudit, Job, LLMCall, expire_jobs
from models.job import EXPIRED_JOB_CALL_ERROR
from tests.integration.test_api import make_runtime
from tests.locks import waits_on_a_lock
from tests.maintenance import maintained
from tests.rows import audit_row
from worker.jobs.maintenance import maintain
from worker.jobs.outbox import EXTRACTION, request_job

pytestmark = pytest.mark.integration

KEPT = timedelta(days=30)


class LockTimedOut(Exception):
    sqlstate = "55P03"  # as psycopg's LockNotAvailable says it


def finished_job(
    factory: sessionmaker[Session], name: str, status: str = "succeeded", age_days: float = 40
) -> int:
    """A job of page ``name`` that ended ``age_days`` ago with ``status`` (a pending status: created then)."""
    with factory.begin() as session:
        job_id = request_job(session, EXTRACTION, f"default|{name}").job_id
        ended = func.now() - timedelta(days=age_days)
        values = {"status": status, "created_at": ended}
        if status in ("succeeded", "failed"):
            values["finished_at"] = ended
        session.execute(update(Job).where(Job.id == job_id).values(**values))
    return job_id


def jobs_left(factory: sessionmaker[Session]) -> set[int]:
    with factory() as session:
        return set(session.scalars(select(Job.id)))


def test_finished_jobs_past_retention_go_oldest_first_and_what_named_them_stays(
    tx_factory: sessionmaker[Session],
) -> None:
    oldest = finished_job(tx_factory, "oldest", age_days=90)
    failed = finished_job(tx_factory, "failed", status="failed", age_days=60)
    old = finished_job(tx_factory, "old", age_days=31)
    recent = finished_job(tx_factory, "recent", age_days=29)
    queued = finished_job(tx_factory, "queued", status="queued", age_days=400)
    paused = finished_job(tx_factory, "paused", status="paused", age_days=400)
    backfilled = finished_job(tx_factory, "backfilled", age_days=400)
    provenance = finished_job(tx_factory, "provenance", age_days=400)
    with tx_factory.begin() as session:
        session.add(audit_row("oldest", job_id=oldest))
        session.add(LLMCall(job_id=oldest, provider="simulator", model="m", purpose="extract", outcome="ok"))
        # A failed call's provider message may quote the page: an erasure finds it by the job, so it goes
        # with the job (left under no job, no erasure could reach it). A refusal keeps only its length.
        for outcome, error in (
            ("provider_error", "HTTP 400: 'Alice signed the offer' is invalid"),
            ("refusal", "the model refused (40 characters of reply, kept with ...)"),
        ):
            session.add(LLMCall(job_id=oldest, provider="simulator", model="m", purpose="extract",
                                outcome=outcome, error=error))  # fmt: skip
        session.add(LLMCall(job_id=recent, provider="simulator", model="m", purpose="extract",
                            outcome="provider_error", error="HTTP 400: kept"))  # fmt: skip
        session.add(Backfill(source_id="default", job_id=backfilled))
        session.add(
            CalibrationThreshold(
                alpha=0.1,
                target_recall=0.9,
                min_observations=20,
                n=0,
                n_bad=0,
                split_method="test",
                reason="test",
                trigger="manual",
                job_id=provenance,
            )
        )
    with tx_factory.begin() as session:
        assert expire_jobs(session, KEPT, 2) == 2
    assert jobs_left(tx_factory) == {old, recent, queued, paused, backfilled, provenance}
    with tx_factory.begin() as session:
        assert expire_jobs(session, KEPT, 2) == 1
        assert expire_jobs(session, KEPT, 2) == 0
    assert jobs_left(tx_factory) == {recent, queued, paused, backfilled, provenance}
    assert failed not in jobs_left(tx_factory)
    with tx_factory() as session:  # the audit row and the calls stay, no longer naming the job
        assert session.scalars(select(ExtractionAudit.job_id)).all() == [None]
        calls = session.execute(select(LLMCall.job_id, LLMCall.outcome, LLMCall.error)).all()
    assert sorted(calls, key=str) == sorted(
        [
            (None, "ok", None),
            (None, "provider_error", EXPIRED_JOB_CALL_ERROR),
            (None, "refusal", "the model refused (40 characters of reply, kept with ...)"),
            (recent, "provider_error", "HTTP 400: kept"),
        ],
        key=str,
    )


def test_the_sweep_deletes_jobs_only_when_a_retention_is_set(
    database_url: str, tx_factory: sessionmaker[Session]
) -> None:
    gone = finished_job(tx_factory, "a", age_days=10)
    kept = finished_job(tx_factory, "b", age_days=6)
    assert maintained(make_runtime(database_url, tx_factory)).expired_jobs == 0
    assert jobs_left(tx_factory) == {gone, kept}
    runtime = make_runtime(database_url, tx_factory, job_retention_days=7)
    assert maintained(runtime).expired_jobs == 1
    assert jobs_left(tx_factory) == {kept}
    assert maintained(runtime, expire_batch=10).expired_jobs == 0


def test_a_sweep_step_that_fails_skips_none_of_the_others(
    database_url: str, tx_factory: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    """One step failing on every beat (a lock or statement timeout on a large table) skipped every step
    after it, the consolidation catch-up and the retention among them."""
    from worker.jobs import maintenance

    def times_out(*args: object, **kwargs: object) -> int:
        raise RuntimeError("canceling statement due to lock timeout on row 'alice-chat'")

    monkeypatch.setattr(maintenance, "forget_deliveries", times_out)
    gone = finished_job(tx_factory, "a", age_days=10)
    report = maintain(make_runtime(database_url, tx_factory, job_retention_days=7))
    assert (
        report.failed == ["forget_deliveries"]
        and report.expired_jobs == 1
        and gone not in jobs_left(tx_factory)
    )
    assert "consolidations_caught_up" in report.steps
    said = [r.getMessage() for r in caplog.records if "forget_deliveries" in r.getMessage()]
    assert said and not any("alice" in line for line in said)  # its class, not its text

    # A lock timeout in a step that does not give way (a DBA's lock_timeout on the role) is a failure.
    def lock_times_out(*args: object, **kwargs: object) -> int:
        raise OperationalError("DELETE FROM webhook_deliveries", {}, LockTimedOut())

    monkeypatch.setattr(maintenance, "forget_deliveries", lock_times_out)
    assert maintain(make_runtime(database_url, tx_factory)).failed == ["forget_deliveries"]
    # The task fails once every step has run: Flower and the task events show it.
    with pytest.raises(maintenance.MaintenanceStepsFailedError, match="forget_deliveries"):
        maintenance.sweep_task(make_runtime(database_url, tx_factory))


def test_a_retention_sweep_gives_way_to_an_erasure_holding_the_rows_its_cascade_needs(
    database_url: str,
    factory: sessionmaker[Session],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A page's erasure deletes its audit rows, then takes its jobs; a retention DELETE takes a job,
    then (its ON DELETE SET NULL) the audit rows naming it: the reverse order. They deadlocked, and
    Postgres ended one: the sweep step failed, or the erasure (a 500). The sweep now gives way."""
    from worker.jobs import maintenance

    # Still under the deadlock check's 1 s; long enough for the probe below to see the wait on a busy
    # machine (at 200 ms a scheduling gap could hide it).
    monkeypatch.setattr(maintenance, "RETENTION_LOCK_TIMEOUT_MS", 800)
    job = finished_job(factory, "erased", age_days=40)
    with factory.begin() as session:
        session.add(audit_row("erased", job_id=job))
    runtime = make_runtime(database_url, factory, job_retention_days=30)
    with factory() as erasure, ThreadPoolExecutor(1) as pool:
        erasure.execute(delete(ExtractionAudit).where(ExtractionAudit.page_slug == "erased"))
        sweeping = pool.submit(maintain, runtime)
        assert waits_on_a_lock(factory, sweeping, "DELETE FROM jobs%"), "the sweep never waited on the rows"
        # The erasure's next step, its jobs: it waited on the sweep's lock, and one of the two was ended.
        erasure.execute(update(Job).where(Job.id == job).values(subject="default|forgotten"))
        erasure.commit()
        report = sweeping.result(timeout=30)
    assert report.failed == [] and report.expired_jobs == 0
    assert any("expire_jobs gave way" in r.getMessage() for r in caplog.records)
    assert maintained(runtime).expired_jobs == 1  # the next sweep takes it
    assert jobs_left(factory) == set()
