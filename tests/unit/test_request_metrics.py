"""The API's request counts and broker probe: what reaches a scrape however the environment was given."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, generate_latest, values

from worker.api.request_metrics import install_request_metrics
from worker.core.redis_urls import redis_py_url


def test_a_multiprocess_folder_prometheus_client_never_saw_still_counts(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A folder named in .env reached Settings but not prometheus_client, which reads the environment
    once, at import: the counts went into a registry no scrape read, and the request series vanished."""
    assert values.ValueClass is values.MutexValue  # this process imported it with no folder set
    app = FastAPI()

    @app.get("/ping")
    def ping() -> dict[str, str]:
        return {"ok": "yes"}

    registry = CollectorRegistry()
    install_request_metrics(app, registry, tmp_path)
    with TestClient(app) as client:
        assert client.get("/ping").status_code == 200
    scraped = generate_latest(registry).decode()
    assert 'factmill_http_requests_total{method="GET",route="/ping",status="200"} 1.0' in scraped
    assert "is set in .env but was not in the environment" in caplog.text


@pytest.mark.parametrize(
    ("url", "read"),
    [
        (
            "rediss://:pw@cache:6380/0?ssl_cert_reqs=CERT_REQUIRED",
            "rediss://:pw@cache:6380/0?ssl_cert_reqs=required",
        ),
        ("rediss://cache/1?ssl_cert_reqs=CERT_NONE&x=1", "rediss://cache/1?ssl_cert_reqs=none&x=1"),
        ("rediss://cache/1?ssl_cert_reqs=optional", "rediss://cache/1?ssl_cert_reqs=optional"),
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        ("redis://a:6379/2;redis://b:6380/0", "redis://a:6379/2"),  # kombu's failover list: its first
        ("unix:///run/redis.sock?db=2", "unix:///run/redis.sock?db=2"),  # was "unix:/run/...", refused
        ("redis+socket:///tmp/r.sock?db=1", "unix:///tmp/r.sock?db=1"),
        ("rediss://h:6380/0?ssl_cert_reqs=CERT_REQUIRED#primary", "rediss://h:6380/0?ssl_cert_reqs=required"),
        ("rediss://a:6379?ssl_cert_reqs=CERT_NONE; redis://b", "rediss://a:6379?ssl_cert_reqs=none"),
    ],
)
def test_redis_py_url_reads_kombus_and_celerys_spellings(url: str, read: str) -> None:
    """redis-py refused CERT_REQUIRED (Celery's documented spelling) at every ping: /readyz said
    "degraded" and factmill_broker_up stayed 0 against a broker Celery used fine."""
    import redis

    assert redis_py_url(url) == read
    client = redis.Redis.from_url(redis_py_url(url))
    assert client.connection_pool.connection_kwargs.get("ssl_cert_reqs", "required") in (
        "required",
        "none",
        "optional",
    )


def test_the_shared_rate_limiters_read_celerys_spelling_of_the_tls_check() -> None:
    """The limiters had a copy of their own that only mapped redis+socket: with CERT_REQUIRED every call
    failed, the search limit fell back to per-process counts and the LLM limits to none."""
    from worker.access.ratelimit import PerKeyLimiter
    from worker.llm.ratelimit import RateLimits, RedisRateLimiter

    url = "rediss://:pw@cache:6380/0?ssl_cert_reqs=CERT_REQUIRED"
    llm = RedisRateLimiter.from_url(url, RateLimits(requests_per_minute=1))
    search = PerKeyLimiter(10, url)
    for client in (llm._redis, search._redis):
        assert client is not None
        assert client.connection_pool.connection_kwargs["ssl_cert_reqs"] == "required"


def test_a_multiprocess_folder_the_operator_names_is_made_and_cleared_of_earlier_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A folder named in PROMETHEUS_MULTIPROC_DIR was neither made (missing, every API process failed
    to start) nor cleared (a restarted process reusing a pid went on from its predecessor's counts)."""
    from worker.cli.services import request_counts_shared
    from worker.settings import Settings

    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    missing = tmp_path / "volume" / "metrics"
    with request_counts_shared(Settings(prometheus_multiproc_dir=missing), workers=2):
        assert missing.is_dir()
    (missing / "counter_7.db").write_bytes(b"earlier run")
    (missing / "README").write_text("not ours")
    with request_counts_shared(Settings(prometheus_multiproc_dir=missing), workers=2):
        assert sorted(p.name for p in missing.iterdir()) == ["README"]
        assert Path(os.environ["PROMETHEUS_MULTIPROC_DIR"]) == missing
    assert missing.is_dir()  # the operator's: kept


def test_a_request_cancelled_before_its_answer_is_counted_as_499_not_500(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """uvicorn cancels the requests still open when a stopping server's graceful timeout ends: each was
    counted (and logged) as a 500, so every rollout's slow requests showed as server errors."""
    import asyncio
    import logging

    from prometheus_client import Counter, Histogram

    from worker.api.request_metrics import RequestMetricsMiddleware

    async def cancelled_app(scope: object, receive: object, send: object) -> None:
        raise asyncio.CancelledError

    registry = CollectorRegistry()
    requests = Counter("t_requests", "requests", ["method", "route", "status"], registry=registry)
    latency = Histogram("t_latency", "latency", ["method", "route"], registry=registry)
    middleware = RequestMetricsMiddleware(cancelled_app, requests, latency)  # type: ignore[arg-type]
    scope = {"type": "http", "method": "GET", "path": "/slow", "client": ("10.0.0.1", 1)}

    async def nothing() -> dict[str, object]:
        return {}

    async def ignore(message: object) -> None:
        return None

    caplog.set_level(logging.INFO, logger="worker.api.access")
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(middleware(scope, nothing, ignore))  # type: ignore[arg-type]
    scraped = generate_latest(registry).decode()
    assert 't_requests_total{method="GET",route="unmatched",status="499"} 1.0' in scraped
    assert 'status="500"' not in scraped and " 499 " in caplog.text
