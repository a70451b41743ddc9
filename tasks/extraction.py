"""Celery entry point for the extraction queue."""

from __future__ import annotations

from tasks import job_task
from worker.jobs.outbox import EXTRACTION

extract_page = job_task(EXTRACTION)
