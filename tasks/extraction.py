"""Celery entry point for the extraction queue."""

from __future__ import annotations

from worker.celery_app import app
from worker.job_runner import run_extraction_job


@app.task(name="tasks.extraction.extract_page", bind=True, queue="extraction", max_retries=None)
def extract_page(self, job_id: int) -> str:  # type: ignore[no-untyped-def]
    outcome = run_extraction_job(self.resources, int(job_id))
    if outcome.retry_in is not None:
        raise self.retry(countdown=outcome.retry_in)
    return outcome.status
