"""The Celery app under the name operators and deploy files use (``celery -A worker.celery_app``).

It is built in worker.jobs.celery_app, beside the registry it reads; this module only gives it its
stable public name.
"""

from __future__ import annotations

from worker.jobs.celery_app import FactmillTask, app, beat_schedule, broker_url, celery_config, create_app

__all__ = ["FactmillTask", "app", "beat_schedule", "broker_url", "celery_config", "create_app"]
