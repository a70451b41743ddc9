"""Celery entry point for the consolidation queue."""

from __future__ import annotations

from tasks import job_task
from worker.jobs.outbox import CONSOLIDATION

consolidate_entity = job_task(CONSOLIDATION)
