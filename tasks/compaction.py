"""Celery entry point for the compaction queue."""

from __future__ import annotations

from worker.celery_app import app
from worker.compaction import run_compaction_job


@app.task(name="tasks.compaction.compact_transcript", bind=True, queue="compaction", max_retries=None)
def compact_transcript(self, job_id: int) -> str:  # type: ignore[no-untyped-def]
    outcome = run_compaction_job(self.resources, int(job_id))
    if outcome.retry_in is not None:
        raise self.retry(countdown=outcome.retry_in)
    return outcome.status
