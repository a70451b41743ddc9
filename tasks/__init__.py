"""Celery entry points. Each job kind's task is made from its registry entry by ``job_task``; the task
only rebuilds the job id and hands it to the one lifecycle (worker.jobs.lifecycle.run_job)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from worker.jobs.celery_app import app
from worker.jobs.lifecycle import run_job
from worker.jobs.registry import get_kind
from worker.runtime import Runtime, tracing
from worker.runtime.logs import log_context


def job_task(kind_name: str) -> Any:
    """The Celery task for a job kind: its registered name and queue, retried when the job asks."""
    kind = get_kind(kind_name)

    @app.task(name=kind.task_name, bind=True, queue=kind.queue, max_retries=None)
    def run(self: Any, job_id: int) -> str:
        with log_context(task_id=str(self.request.id)):
            outcome = run_job(self.resources, int(job_id), kind)
        if outcome.retry_in is not None:
            with tracing.resumed(outcome.traceparent):  # sent in the job's trace
                raise self.retry(countdown=outcome.retry_in)
        return outcome.status

    return run


def beat_task(name: str) -> Callable[[Callable[[Runtime], int]], Any]:
    """The Celery task beat sends by ``name``, running the decorated work on the process's resources,
    its log lines bound to the task's id as a job task's are (a sweep's and a poll's had none)."""

    def register(work: Callable[[Runtime], int]) -> Any:
        def run(self: Any) -> int:
            with log_context(task_id=str(self.request.id)):
                return work(self.resources)

        # Before the task is made: set on the task (a promise until the app is finalized), it made the
        # app read its configuration at import, starting the embedded broker.
        run.__doc__ = work.__doc__
        return app.task(name=name, bind=True, ignore_result=True)(run)

    return register
