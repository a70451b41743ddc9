"""Celery entry point for the compaction queue."""

from __future__ import annotations

from tasks import job_task
from worker.jobs.outbox import COMPACTION

compact_transcript = job_task(COMPACTION)
