"""Liveness (/healthz), readiness (/readyz: the database and the broker answer) and /metrics."""

from __future__ import annotations

import logging

import redis
from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from kombu import Connection
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import text
from sqlalchemy.orm import Session, sessionmaker

from models.reads import read_only
from worker.api.auth import MetricsReader
from worker.api.deps import Context
from worker.api.errors import error_responses, one_line

logger = logging.getLogger(__name__)

READY_TIMEOUT_SECONDS = 2.0

ops_router = APIRouter(tags=["operations"])


def ping_database(factory: sessionmaker[Session]) -> None:
    with read_only(factory) as session:
        session.execute(text("SELECT 1"))


def ping_broker(url: str, timeout: float = READY_TIMEOUT_SECONDS) -> None:
    """Raise unless the broker answers within ``timeout`` seconds."""
    scheme = url.partition("://")[0].lower()
    if scheme in ("redis", "rediss", "redis+socket", "unix"):
        if scheme == "redis+socket":  # kombu's spelling of a Unix socket (the embedded Redis)
            path = url.partition("://")[2]
            client = redis.Redis(
                unix_socket_path=path, socket_timeout=timeout, socket_connect_timeout=timeout
            )
        else:
            client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        try:
            client.ping()
        finally:
            client.close()
        return
    with Connection(url, connect_timeout=timeout) as conn:
        conn.ensure_connection(max_retries=1)


@ops_router.get("/healthz", summary="The process is up")
async def healthz() -> dict[str, str]:
    # async and without the database: it answers on the event loop even when every thread is busy.
    return {"status": "ok"}


@ops_router.get("/readyz", summary="The database and the broker answer", responses=error_responses(503))
def readyz(ctx: Context) -> JSONResponse:
    """Open to anyone (probes carry no credential), so it answers which check failed and the error's
    class; the driver's message (hosts, ports, socket paths, role and database names) goes to the log."""
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
            "not ready: %s",
            "; ".join(f"{name} unreachable ({one_line(exc)})" for name, exc in errors.items()),
        )
        detail = "not ready: " + "; ".join(f"{name} {checks[name]}" for name in errors)
        return JSONResponse({"detail": detail, "checks": checks}, 503)
    return JSONResponse({"status": "ready", "checks": checks}, 200)


@ops_router.get("/metrics", summary="Prometheus metrics", response_class=Response)
def metrics(ctx: Context, _: MetricsReader) -> Response:
    """Prometheus figures: a key with the metrics scope (or admin) scrapes them."""
    return Response(generate_latest(ctx.registry), media_type=CONTENT_TYPE_LATEST)


__all__ = ["ops_router", "ping_broker", "ping_database"]
