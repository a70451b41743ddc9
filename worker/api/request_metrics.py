"""The API's request metrics: counts and latency by route template, added up over every process of a
`factmill serve --workers N` (prometheus_client's multiprocess mode)."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, values
from prometheus_client.multiprocess import MultiProcessCollector

from worker.bodycap import ASGIApp, Receive, Scope, Send
from worker.guards import route_template, unexpected_status

logger = logging.getLogger(__name__)

CANCELLED_STATUS = 499  # a request cancelled before its answer (not an HTTP status a client sees)
KNOWN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


def method_label(method: str) -> str:
    """The method as a metric label: a known one, else "other" (random methods must not add series)."""
    return method if method in KNOWN_METHODS else "other"


class RequestMetricsMiddleware:
    """Counts API requests and their latency by route template and known method (bounded labels:
    an unmatched path is "unmatched", an unknown method "other")."""

    def __init__(self, app: ASGIApp, requests: Counter, latency: Histogram) -> None:
        self.app, self.requests, self.latency = app, requests, latency

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        began = time.perf_counter()
        status = 500
        started = False

        async def record_status(message: Any) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                status, started = message["status"], True
            await send(message)

        try:
            await self.app(scope, receive, record_status)
        except Exception as exc:
            # Not answered yet: the request-id middleware outside answers it (a database outage as 503).
            if not started:
                status = unexpected_status(exc)
            raise
        except asyncio.CancelledError:
            # Cancelled before an answer (the server stopping past its graceful timeout, the client
            # gone): nothing failed, so not a 500 (every rollout's slow requests showed as errors).
            # 499, the status proxies log for a request that ended unanswered.
            if not started:
                status = CANCELLED_STATUS
            raise
        finally:
            elapsed = time.perf_counter() - began
            route = route_template(scope)
            method = method_label(scope["method"])
            self.requests.labels(method, route, str(status)).inc()
            self.latency.labels(method, route).observe(elapsed)
            log_access(scope, method, route, status, elapsed)


access_logger = logging.getLogger("worker.api.access")


def log_access(scope: Scope, method: str, route: str, status: int, elapsed: float) -> None:
    """One line a request: the client's address, the route's template (never the path: it holds slugs,
    and the query holds search text, neither of which a log may keep), the status and the time."""
    client = (scope.get("client") or ("-",))[0]
    access_logger.info(
        "%s %s %s %d %.1fms",
        client,
        method,
        route,
        status,
        elapsed * 1000,
        extra={
            "client": client,
            "method": method,
            "route": route,
            "status": status,
            "ms": round(elapsed * 1000, 1),
        },
    )


def install_request_metrics(app: FastAPI, registry: CollectorRegistry, multiprocess_dir: Path | None) -> None:
    """Count ``app``'s requests into ``registry``.

    With ``multiprocess_dir`` (PROMETHEUS_MULTIPROC_DIR, which `factmill serve --workers N` sets for its
    processes) each process writes its counts to files there, and a scrape, which any one process
    answers, reads them all: without it a scrape showed only the answering process's counts, so the
    counters went up and down between scrapes and Prometheus read every fall as a reset. Process
    metrics (memory, CPU, open files) would describe only the answering process then: left out.
    """
    live = registry
    if multiprocess_dir is not None and values.ValueClass is values.MutexValue:
        # prometheus_client chose at its import, from the environment alone: a PROMETHEUS_MULTIPROC_DIR
        # read from .env only left it counting in memory, into a registry no scrape read (no series).
        logger.warning(
            "PROMETHEUS_MULTIPROC_DIR is set in .env but was not in the environment when prometheus_client "
            "was imported: this process counts its own requests (export it to share counts across processes)"
        )
        multiprocess_dir = None
    if multiprocess_dir is None:
        ProcessCollector(registry=registry)
    else:
        MultiProcessCollector(registry, path=str(multiprocess_dir))
        live = CollectorRegistry(auto_describe=False)  # the files hold the values; this only holds names
    requests = Counter("factmill_http_requests", "API requests", ["method", "route", "status"], registry=live)
    latency = Histogram(
        "factmill_http_request_duration_seconds", "API request latency", ["method", "route"], registry=live
    )
    app.add_middleware(RequestMetricsMiddleware, requests=requests, latency=latency)  # type: ignore[arg-type]


__all__ = ["RequestMetricsMiddleware", "install_request_metrics", "method_label"]
