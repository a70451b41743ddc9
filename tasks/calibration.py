"""Celery entry points for the calibration queue: the recompute job, and beat's schedule."""

from __future__ import annotations

from typing import Any

from tasks import job_task
from worker.calibration import request_recompute
from worker.jobs.celery_app import app
from worker.jobs.outbox import CALIBRATION

recompute = job_task(CALIBRATION)


@app.task(name="tasks.calibration.schedule", bind=True, ignore_result=True)
def schedule(self: Any) -> int:
    """Run by beat: request a recompute job (one pending at a time) and send it after the commit."""
    return request_recompute(self.resources.factory, trigger="schedule").job_id
