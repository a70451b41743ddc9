"""Celery entry points for backfills: the batch_extraction job, and beat's poll of waiting backfills
(and of the batch copies owed a delete at the provider)."""

from __future__ import annotations

from tasks import beat_task, job_task
from worker.extraction.backfill_admin import poll_backfills
from worker.extraction.backfill_request import BATCH_EXTRACTION
from worker.runtime import Runtime

run_backfill = job_task(BATCH_EXTRACTION)


@beat_task("tasks.backfill.poll")
def poll(resources: Runtime) -> int:
    """Run by beat: every backfill job waiting on provider batches runs one pass (polls, collects), and
    the batch copies owed a delete at the provider are deleted where due."""
    return poll_backfills(resources.factory, resources.settings)
