"""Liveness (/healthz), readiness (/readyz: the database answers; the broker is reported) and /metrics."""

from __future__ import annotations

import logging

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from worker.api.auth import MetricsReader
from worker.api.deps import Context
from worker.api.errors import error_responses, one_line
from worker.api.probes import ping_broker, ping_database

logger = logging.getLogger(__name__)

ops_router = APIRouter(tags=["operations"])


@ops_router.get("/healthz", summary="The process is up")
async def healthz() -> dict[str, str]:
    # async and without the database: it answers on the event loop even when every thread is busy.
    return {"status": "ok"}


@ops_router.get(
    "/readyz", summary="The database answers (and whether the broker does)", responses=error_responses(503)
)
def readyz(ctx: Context) -> JSONResponse:
    """503 when the database is unreachable: no route can serve. The broker is checked and reported, but
    an unreachable one leaves the API ready ("degraded"): pages and their jobs are still stored, and the
    sweeper sends the jobs once the broker is back; failing readiness would take every replica out of
    its load balancer for a Redis restart. Open to anyone (probes carry no credential), so it answers
    which check failed and the error's class; the driver's message goes to the log."""
    checks: dict[str, str] = {}
    errors: dict[str, Exception] = {}
    for name, ping in (
        ("database", lambda: ping_database(ctx.factory)),
        ("broker", lambda: ping_broker(ctx.broker_url())),
    ):
        try:
            ping()
            checks[name] = "ok"
        except Exception as exc:
            checks[name], errors[name] = f"unreachable ({type(exc).__name__})", exc
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
def metrics(ctx: Context, _: MetricsReader) -> Response:
    """Prometheus figures: a key with the metrics scope (or admin) scrapes them."""
    return Response(generate_latest(ctx.registry), media_type=CONTENT_TYPE_LATEST)


__all__ = ["ops_router"]
