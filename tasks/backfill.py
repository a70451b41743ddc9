"""Celery entry points for backfills: the batch_extraction job, and beat's poll of waiting backfills
(and of the batch copies owed a delete at the provider)."""

from __future__ import annotations

from typing import Any

from tasks import job_task
from worker.extraction.backfill_admin import poll_backfills
from worker.extraction.backfill_request import BATCH_EXTRACTION
from worker.jobs.celery_app import app

run_backfill = job_task(BATCH_EXTRACTION)


@app.task(name="tasks.backfill.poll", bind=True, ignore_result=True)
def poll(self: Any) -> int:
    """Run by beat: every backfill job waiting on provider batches runs one pass (polls, collects), and
    the batch copies owed a delete at the provider are deleted where due."""
    return poll_backfills(self.resources.factory, self.resources.settings)
