"""What the maintenance queue does each time beat sends its sweep: lost and stalled jobs sent again,
the running totals of gone connections folded, delivery answers past their window forgotten, (with
FACTMILL_JOB_RETENTION_DAYS) finished jobs past their retention deleted, and (with
FACTMILL_LEDGER_RETENTION_DAYS) llm_calls and extraction_audit rows past theirs, and the consolidation
requests a dead worker never made (the features' SWEEP_STEPS)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TypeVar

from celery.exceptions import SoftTimeLimitExceeded
from sqlalchemy import text
from sqlalchemy.orm import Session

from models import expire_jobs, expire_ledger, fold_totals, forget_deliveries
from worker.db import lock_timed_out
from worker.jobs.budgets import JobBudgets
from worker.jobs.outbox import sweep
from worker.jobs.registry import all_kinds
from worker.jobs.sending import broker_queue_depth
from worker.jobs.sweep_report import SweepReport
from worker.runtime import Runtime

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

# Stored answers deleted a sweep at most: at one sweep each 30 s, 28 million a day, while each DELETE
# stays short however large a backlog an upgrade finds.
FORGET_BATCH = 10_000
# Finished jobs deleted a sweep at most. Smaller than FORGET_BATCH: each job also clears job_id in the
# rows that name it (its audit rows, LLM calls, compactions). 2.9 million jobs a day at one sweep each 30 s;
# one batch took 75 ms at a million jobs, 458 ms without the index (bench/job_retention.py).
EXPIRE_BATCH = 1_000
# llm_calls and extraction_audit rows deleted a sweep at most, of each: 28 million a day at one sweep
# each 30 s, above what a worker fleet writes (bench/ledger_retention.py times one batch).
LEDGER_BATCH = 10_000
# How long a retention DELETE waits for a row lock before it leaves the batch to the next sweep. Its
# cascades (job_id and llm_call_id set NULL in the rows naming what it deletes) wait on whoever holds
# those rows: a page's erasure locks its audit rows and then its jobs, the reverse order, and the two
# deadlocked (Postgres ended one, the erasure's DELETE a 500 when it was the one). Under Postgres's
# deadlock_timeout (1 s), so the sweep usually gives way first (when it began waiting well after the
# erasure did, Postgres ends the erasure, which is made again: worker.extraction.erase); background
# work does not make a user's transaction wait much longer than this.
RETENTION_LOCK_TIMEOUT_MS = 200


# A feature's own step of each sweep (registered beside its job kind: the jobs package imports no
# feature); each returns how many things it did.
SWEEP_STEPS: dict[str, Callable[[Runtime], int]] = {}


def sweep_step(name: str) -> Callable[[Callable[[Runtime], int]], Callable[[Runtime], int]]:
    def register(step: Callable[[Runtime], int]) -> Callable[[Runtime], int]:
        SWEEP_STEPS[name] = step
        return step

    return register


@dataclass(frozen=True)
class MaintenanceReport:
    jobs: SweepReport
    forgotten_deliveries: int
    expired_jobs: int = 0
    expired_audit_rows: int = 0
    expired_llm_calls: int = 0
    steps: dict[str, int] = field(default_factory=dict)  # what each feature's sweep step did
    failed: list[str] = field(default_factory=list)  # the steps that raised (the others still ran)


class _Steps:
    """Runs each step of a sweep on its own: one that fails on every beat (a lock or statement
    timeout on a large table) skipped every step after it, the consolidation catch-up among them."""

    def __init__(self) -> None:
        self.failed: list[str] = []

    def run(self, name: str, step: Callable[[], _T], otherwise: _T, *, give_way: bool = False) -> _T:
        """``give_way``: a step under RETENTION_LOCK_TIMEOUT_MS, whose lock timeout is no failure (a lock
        timeout anywhere else, a DBA's on the role say, fails the step as any error does)."""
        try:
            return step()
        except SoftTimeLimitExceeded:  # the task's time is up: no step after it
            raise
        except Exception as exc:
            if not (give_way and lock_timed_out(exc)):
                return self._failed(name, exc, otherwise)
            logger.warning(
                "maintenance step %s gave way to a transaction holding its rows; the next sweep goes on", name
            )
            return otherwise

    def _failed(self, name: str, exc: Exception, otherwise: _T) -> _T:
        # Its class and SQLSTATE only: a database error's text may quote a row.
        sqlstate = getattr(getattr(exc, "orig", None), "sqlstate", None)
        logger.error(
            "maintenance step %s failed (%s%s); the other steps ran",
            name,
            type(exc).__name__,
            f", SQLSTATE {sqlstate}" if sqlstate else "",
        )
        self.failed.append(name)
        return otherwise


class MaintenanceStepsFailedError(RuntimeError):
    """Steps of a sweep failed (each logged); the others ran. Raised once they all have, so the task
    fails where Flower and the task events show it."""


def sweep_task(rt: Runtime) -> int:
    """The maintenance task's work: a sweep, failing (after every step ran) if any step failed; how
    many jobs it sent again."""
    report = maintain(rt)
    if report.failed:
        raise MaintenanceStepsFailedError(f"maintenance steps failed: {', '.join(report.failed)}")
    return report.jobs.total


def maintain(
    rt: Runtime,
    forget_batch: int = FORGET_BATCH,
    expire_batch: int = EXPIRE_BATCH,
    ledger_batch: int = LEDGER_BATCH,
) -> MaintenanceReport:
    settings, steps = rt.settings, _Steps()
    jobs = steps.run(
        "sweep",
        lambda: sweep(
            rt.factory,
            stale_after=settings.job_stale_after_seconds,
            requeue_after=settings.job_requeue_after_seconds,
            enabled=rt.config.enabled,
            job_budgets=JobBudgets.from_settings(settings),
            budget_room_for=rt.budget.jobs_with_room,
            budget_has_room=rt.budget.has_room,
            queue_depth=broker_queue_depth,
        ),
        SweepReport([], [], []),
    )
    steps.run("fold_totals", lambda: _in_transaction(rt, fold_totals), None)  # gone connections' totals
    forgotten = steps.run("forget_deliveries", lambda: _forget(rt, forget_batch), 0)
    expired = steps.run("expire_jobs", lambda: _expire_jobs(rt, expire_batch), 0, give_way=True)
    audit, calls = steps.run("expire_ledger", lambda: _expire_ledger(rt, ledger_batch), (0, 0), give_way=True)
    all_kinds()  # every kind's module imported, so its sweep step is registered
    done = {name: steps.run(name, functools.partial(step, rt), 0) for name, step in SWEEP_STEPS.items()}
    return MaintenanceReport(jobs, forgotten, expired, audit, calls, done, steps.failed)


def _in_transaction(rt: Runtime, work: Callable[[Session], _T], *, give_way: bool = False) -> _T:
    """``work`` in a transaction of its own; ``give_way``: each lock it waits for, at most
    RETENTION_LOCK_TIMEOUT_MS (a retention step: see there)."""
    with rt.factory.begin() as session:
        if give_way:
            session.execute(text(f"SET LOCAL lock_timeout = {RETENTION_LOCK_TIMEOUT_MS}"))
        return work(session)


def _forget(rt: Runtime, batch: int) -> int:
    hours = rt.settings.idempotency_key_hours
    forgotten = _in_transaction(rt, lambda session: forget_deliveries(session, timedelta(hours=hours), batch))
    if forgotten:
        logger.info("forgot %s delivery answers older than %s h", forgotten, hours)
    return forgotten


def _expire_jobs(rt: Runtime, batch: int) -> int:
    days = rt.settings.job_retention_days
    if days is None:
        return 0
    expired = _in_transaction(
        rt, lambda session: expire_jobs(session, timedelta(days=days), batch), give_way=True
    )
    if expired:
        logger.info("deleted %s jobs finished over %s days ago", expired, days)
    return expired


def _expire_ledger(rt: Runtime, batch: int) -> tuple[int, int]:
    days = rt.settings.ledger_retention_days
    if days is None:
        return 0, 0
    audit, calls = _in_transaction(
        rt, lambda session: expire_ledger(session, timedelta(days=days), batch), give_way=True
    )
    if audit or calls:
        logger.info(
            "deleted %s extraction_audit rows and %s llm_calls rows over %s days old", audit, calls, days
        )
    return audit, calls
