"""Celery entry point for the maintenance queue (run by beat)."""

from __future__ import annotations

from tasks import beat_task
from worker.jobs.maintenance import sweep_task
from worker.runtime import Runtime


@beat_task("tasks.maintenance.sweep")
def sweep(resources: Runtime) -> int:
    """Run by beat: the sweep of stalled and lost jobs (worker.jobs.maintenance)."""
    return sweep_task(resources)
