"""Celery entry points for the calibration queue: the recompute job, and beat's schedule."""

from __future__ import annotations

from tasks import beat_task, job_task
from worker.calibration import request_recompute
from worker.jobs.outbox import CALIBRATION
from worker.runtime import Runtime

recompute = job_task(CALIBRATION)


@beat_task("tasks.calibration.schedule")
def schedule(resources: Runtime) -> int:
    """Run by beat: request a recompute job (one pending at a time) and send it after the commit."""
    return request_recompute(resources.factory, trigger="schedule").job_id
