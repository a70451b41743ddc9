"""The HTTP API: signed page webhooks, jobs, facts, config (kill switches), search, transcripts,
calibration, health and metrics.

Every request does a little database work and answers; the LLM work happens on the Celery
queues. The routes live in worker.api.routes, one module per group; this module assembles them.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager

import anyio.to_thread
from fastapi import Depends, FastAPI

from worker.api.deps import ApiContext, celery_sender_for
from worker.api.errors import add_error_handlers
from worker.api.follow_up_metrics import follow_up_steps
from worker.api.metrics import install_metrics
from worker.api.openapi import install_openapi
from worker.api.probes import BrokerCollector, ping_broker
from worker.api.routes.backfills import backfills_router
from worker.api.routes.calibration import calibration_router
from worker.api.routes.config import config_router
from worker.api.routes.facts import facts_router
from worker.api.routes.health import ops_router
from worker.api.routes.jobs import jobs_router
from worker.api.routes.pages import pages_router
from worker.api.routes.search import search_router
from worker.api.routes.transcripts import compaction_router
from worker.api.url_checks import check_request_url
from worker.bodycap import BodyCapMiddleware
from worker.core.signing import EXPECTED_FORMAT, SIGNATURE_HEADER
from worker.guards import RequestIdMiddleware
from worker.jobs.celery_app import start_tracing
from worker.jobs.sending import Sender
from worker.runtime import Runtime, get_runtime, tracing

TAGS = [
    {"name": "pages", "description": "Signed webhooks that store pages and queue their extraction."},
    {"name": "jobs", "description": "The job history: status, counters, errors; retry."},
    {"name": "facts", "description": "Facts extracted from a page (audit rows are never returned)."},
    {"name": "config", "description": "Kill switches and tunables (admin scope)."},
    {"name": "search", "description": "Intent-aware search over facts: lex, vec and hyde lines, fused."},
    {"name": "transcripts", "description": "Agent transcripts and their gated compaction summaries."},
    {"name": "calibration", "description": "Feedback on summaries and the calibrated coverage threshold."},
    {"name": "backfills", "description": "Batch extraction of many pages at half price (admin scope)."},
    {"name": "operations", "description": "Liveness, readiness and Prometheus metrics."},
]

# The include order is the order of the paths in the OpenAPI document.
ROUTERS = (
    pages_router,
    jobs_router,
    facts_router,
    config_router,
    calibration_router,
    search_router,
    compaction_router,
    backfills_router,
    ops_router,
)


def _version() -> str:
    try:
        return importlib.metadata.version("factmill")
    except importlib.metadata.PackageNotFoundError:  # running from a checkout that is not installed
        return "0.0.0"


def _thread_limit(threads: int) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        anyio.to_thread.current_default_thread_limiter().total_tokens = threads
        yield

    return lifespan


def create_app(runtime: Runtime | None = None, sender: Sender | None = None) -> FastAPI:
    """The API over ``runtime`` (default: the process runtime from FACTMILL_* settings).

    ``sender`` receives (task name, job id, queue) after each commit; None sends through Celery
    (the shared app for the process runtime, an app configured from ``runtime.settings`` otherwise).
    """
    if runtime is None:
        runtime = get_runtime()
    elif sender is None:
        sender = celery_sender_for(runtime.settings)
    runtime.settings.check_service_settings()
    if start_tracing(runtime.settings, "factmill-api"):  # FACTMILL_OTEL_ENDPOINT; nothing otherwise
        tracing.instrument_engine(runtime.factory.kw.get("bind"))  # a runtime built before tracing was on

    app = FastAPI(
        title="Factmill",
        version=_version(),
        summary="Turn conversation pages into durable, auditable facts with an LLM.",
        description=(
            "Signed webhooks store pages and queue their extraction; Celery workers do the LLM work. "
            "Every route but /healthz, /readyz and these docs needs `Authorization: Bearer <API key>` "
            "with the route's scope (read, ingest, admin, metrics). Ingestion routes also take a signature: "
            f"`{SIGNATURE_HEADER}: {EXPECTED_FORMAT}` "
            'under FACTMILL_WEBHOOK_SECRET. Errors are JSON `{"detail": ...}`. Text anywhere (bodies, '
            "paths, queries) must not hold NUL characters or lone surrogates, and JSON numbers must be "
            "finite: each is refused with 422 naming the field. So is a query parameter the route does not "
            "take, or one sent twice; a path or query that is not UTF-8 once decoded is refused with 400."
        ),
        openapi_tags=TAGS,
        lifespan=_thread_limit(runtime.settings.api_threads),
        dependencies=[Depends(check_request_url)],
    )
    # Innermost first: the body cap, then the metrics, then the request id around everything.
    settings = runtime.settings
    app.add_middleware(
        BodyCapMiddleware,  # type: ignore[arg-type]
        cap=settings.max_body_bytes,
        large_at_once=settings.max_large_bodies,
        large_body_seconds=settings.large_body_seconds,
        large_body_min_rate=settings.large_body_min_bytes_per_second,
    )
    registry = install_metrics(
        app,
        runtime.factory,
        runtime.settings.prometheus_multiproc_dir,
        follow_up_steps(runtime.settings),
    )
    app.add_middleware(RequestIdMiddleware)  # type: ignore[arg-type]
    context = app.state.factmill = ApiContext(runtime=runtime, sender=sender, registry=registry)
    registry.register(BrokerCollector(lambda: ping_broker(context.broker_url())))  # type: ignore[arg-type]
    add_error_handlers(app)
    for router in ROUTERS:
        app.include_router(router)
    install_openapi(app)
    tracing.instrument_app(app)
    return app


__all__ = ["create_app"]
