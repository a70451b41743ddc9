"""Celery entry points for the calibration queue."""

from __future__ import annotations

from worker.calibration import request_recompute, run_calibration_job
from worker.celery_app import app


@app.task(name="tasks.calibration.recompute", bind=True, queue="calibration", max_retries=None)
def recompute(self, job_id: int) -> str:  # type: ignore[no-untyped-def]
    outcome = run_calibration_job(self.resources, int(job_id))
    if outcome.retry_in is not None:
        raise self.retry(countdown=outcome.retry_in)
    return outcome.status


@app.task(name="tasks.calibration.schedule", bind=True, queue="calibration", ignore_result=True)
def schedule(self) -> int:  # type: ignore[no-untyped-def]
    """Run by beat: request a recompute job (one pending at a time) and send it after the commit."""
    return request_recompute(self.resources.factory, trigger="schedule").job_id
