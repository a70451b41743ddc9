"""Celery entry point for the maintenance queue (run by beat)."""

from __future__ import annotations

from typing import Any

from worker.jobs.celery_app import app
from worker.jobs.maintenance import sweep_task


@app.task(name="tasks.maintenance.sweep", bind=True, ignore_result=True)
def sweep(self: Any) -> int:
    return sweep_task(self.resources)
