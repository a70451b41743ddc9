"""Celery entry point for the maintenance queue (run by beat)."""

from __future__ import annotations

from worker.celery_app import app
from worker.jobs import sweep as sweep_jobs
from worker.llm.budget import Budget


@app.task(name="tasks.maintenance.sweep", bind=True, queue="maintenance", ignore_result=True)
def sweep(self) -> int:  # type: ignore[no-untyped-def]
    rt = self.resources
    report = sweep_jobs(
        rt.factory,
        stale_after=rt.settings.job_stale_after_seconds,
        requeue_after=rt.settings.job_requeue_after_seconds,
        enabled=rt.config.enabled,
        budget_has_room=Budget(rt.factory, rt.config.get).has_room,
    )
    return report.total
