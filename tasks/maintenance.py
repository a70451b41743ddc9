"""Celery entry point for the maintenance queue (run by beat)."""

from __future__ import annotations

from typing import Any

from models import fold_totals
from worker.jobs.budgets import JobBudgets
from worker.jobs.celery_app import app
from worker.jobs.outbox import broker_queue_depth
from worker.jobs.outbox import sweep as sweep_jobs


@app.task(name="tasks.maintenance.sweep", bind=True, ignore_result=True)
def sweep(self: Any) -> int:
    rt = self.resources
    report = sweep_jobs(
        rt.factory,
        stale_after=rt.settings.job_stale_after_seconds,
        requeue_after=rt.settings.job_requeue_after_seconds,
        enabled=rt.config.enabled,
        job_budgets=JobBudgets.from_settings(rt.settings),
        budget_has_room=rt.budget.has_room,
        queue_depth=broker_queue_depth,
    )
    with rt.factory.begin() as session:  # the running totals of gone connections, into one row each
        fold_totals(session)
    return report.total
