"""Liveness (/healthz), readiness (/readyz: the database answers; the broker is reported) and /metrics."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from worker.api.auth import MetricsReader, on_scrape_threads
from worker.api.deps import Context
from worker.api.errors import error_responses, one_line
from worker.api.probes import READY_TIMEOUT_SECONDS, ping_broker, ping_database

logger = logging.getLogger(__name__)

ops_router = APIRouter(tags=["operations"])


@ops_router.get("/healthz", summary="The process is up")
async def healthz() -> dict[str, str]:
    # async and without the database: it answers on the event loop even when every thread is busy.
    return {"status": "ok"}


# The probes' own threads: /readyz must answer while every request thread is busy (slow searches held
# all of FACTMILL_API_THREADS, so readiness timed out and Kubernetes took every replica out of service).
_PROBE_THREADS = ThreadPoolExecutor(max_workers=4, thread_name_prefix="readyz")
# A check that has not answered by then counts as unreachable (its thread is left to finish).
PROBE_TIMEOUT_SECONDS = READY_TIMEOUT_SECONDS + 1


async def _probe(ping: Callable[[], None]) -> None:
    await asyncio.wait_for(asyncio.wrap_future(_PROBE_THREADS.submit(ping)), timeout=PROBE_TIMEOUT_SECONDS)


@ops_router.get(
    "/readyz", summary="The database answers (and whether the broker does)", responses=error_responses(503)
)
async def readyz(ctx: Context) -> JSONResponse:
    """503 when the database is unreachable: no route can serve. The broker is checked and reported, but
    an unreachable one leaves the API ready ("degraded"): pages and their jobs are still stored, and the
    sweeper sends the jobs once the broker is back; failing readiness would take every replica out of
    its load balancer for a Redis restart. Open to anyone (probes carry no credential), so it answers
    which check failed and the error's class; the driver's message goes to the log. Both checks run at
    once on threads of their own, never on the request threads."""
    probes = {
        "database": lambda: ping_database(ctx.factory),
        "broker": lambda: ping_broker(ctx.broker_url()),
    }
    answers = await asyncio.gather(*(_probe(ping) for ping in probes.values()), return_exceptions=True)
    checks: dict[str, str] = {}
    errors: dict[str, BaseException] = {}
    for name, answer in zip(probes, answers, strict=True):
        if isinstance(answer, BaseException):
            checks[name], errors[name] = f"unreachable ({type(answer).__name__})", answer
        else:
            checks[name] = "ok"
    if errors:
        logger.warning(
            "%s: %s",
            "not ready" if "database" in errors else "degraded",
            "; ".join(f"{name} unreachable ({one_line(exc)})" for name, exc in errors.items()),
        )
    if "database" in errors:
        detail = "not ready: " + "; ".join(f"{name} {checks[name]}" for name in errors)
        return JSONResponse({"detail": detail, "checks": checks}, 503)
    return JSONResponse({"status": "degraded" if errors else "ready", "checks": checks}, 200)


@ops_router.get("/metrics", summary="Prometheus metrics", response_class=Response)
async def metrics(ctx: Context, _: MetricsReader) -> Response:
    """Prometheus figures: a key with the metrics scope (or admin) scrapes them. The key's check and the
    figures' reads run on threads of their own, so a scrape answers while searches hold every request
    thread."""
    body = await on_scrape_threads(lambda: generate_latest(ctx.registry))
    return Response(body, media_type=CONTENT_TYPE_LATEST)


__all__ = ["ops_router"]
