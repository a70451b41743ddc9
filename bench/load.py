"""Load benchmark: 200 concurrent signed webhook deliveries against a real `factmill serve` on loopback.

Deliveries are pages (POST /v1/pages) or, with ``--route messages``, agent transcript appends (POST
/v1/transcripts/{id}/messages: one message each, over ``--transcripts`` transcripts), or with
``--route feedback`` calibration feedback (POST /v1/feedback).

Prints the status counts (no 5xx, no pool errors in the server log), and /healthz p50/p99 measured
while the deliveries run, beside a baseline measured in the same run with no load. Goal: healthz
p99 under 100 ms under load (a liveness probe must never wait on the thread pool).

    .venv/bin/python bench/load.py [--requests 200] [--concurrency 200] [--port PORT] [--idempotency-keys]
                                   [--route pages|messages|feedback] [--transcripts 200] [--keep-logs]

The server listens on a free port unless --port names one. Needs the local Postgres (127.0.0.1:5432,
or FACTMILL_TEST_DATABASE_URL) and a Redis at 127.0.0.1:6379 (db 14); creates and drops its own
database, keeps its Redis keys (the jobs the deliveries queue) under a prefix of its own and deletes
them at the end. The server's log goes to a temporary folder, removed at the end unless --keep-logs
is given or the run failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import httpx
import psutil
from sqlalchemy.engine import make_url

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import bench.pipeline as pipe  # noqa: E402
from tests.service import free_port, fresh_database, stop_cleanly_on_termination  # noqa: E402
from worker import db  # noqa: E402
from worker.core.signing import signed_json_headers  # noqa: E402

SECRET = "bench-webhook-secret-" + "s" * 16
ADMIN = "bench-admin-token-" + "a" * 16
SERVER = os.environ.get("FACTMILL_TEST_DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
CONVERSATION = "**Alice** (2024-03-15 9:00 AM): I signed the offer.\n**Bob** (2024-03-15 9:01 AM): Congrats!"
MESSAGE = "please run the test suite again and tell me which of the integration tests still fail"
BROKER = "redis://127.0.0.1:6379/14"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def server_quantiles(metrics: str, method: str, route: str) -> dict[float, str]:
    """The p50 and p99 of the API's own time for a route, from its request histogram on /metrics: the
    upper bound of the bucket each falls in (the time from the app's first byte in to its last byte out,
    without the wait for a connection or in the socket)."""
    buckets: list[tuple[float, float]] = []
    for line in metrics.splitlines():
        if line.startswith("factmill_http_request_duration_seconds_bucket{") and (
            f'method="{method}"' in line and f'route="{route}"' in line
        ):
            bound = line.split('le="', 1)[1].split('"', 1)[0]
            buckets.append((float(bound), float(line.rsplit(" ", 1)[1])))
    buckets.sort()
    total = buckets[-1][1] if buckets else 0
    return {
        q: next((f"{bound * 1000:g} ms" for bound, n in buckets if n >= q * total), "?") for q in (0.5, 0.99)
    }


def probe_healthz(base: str, stop: threading.Event, out: list[float]) -> None:
    """Poll /healthz from its own thread and connection. The thread shares the load generator's process
    (and GIL), so under load its latency includes the client's own waits; its CPU in the API is taken
    out of the deliveries' (``run``)."""
    with httpx.Client(base_url=base, timeout=60) as client:
        while not stop.is_set():
            started = time.perf_counter()
            response = client.get("/healthz")
            out.append((time.perf_counter() - started) * 1000)
            assert response.status_code == 200
            time.sleep(0.005)


def probing(base: str, out: list[float]) -> tuple[threading.Event, threading.Thread]:
    stop = threading.Event()
    thread = threading.Thread(target=probe_healthz, args=(base, stop, out), daemon=True)
    thread.start()
    return stop, thread


# Connections per client: httpx's async pool matches every waiting request against every connection
# each time one is taken or returned, so a single pool of 200 made the load generator its own
# bottleneck (deliveries held 10-40 s before they were sent while the API answered in under 2.5 s).
CLIENT_POOL = 20


class Route(NamedTuple):
    """Where a delivery goes and what it carries: ``path`` and ``body`` of the delivery's index."""

    template: str  # the route as the API's request histogram names it
    path: Callable[[int], str]
    body: Callable[[int], bytes]


def route(name: str, transcripts: int) -> Route:
    if name == "feedback":
        return Route(
            "/v1/feedback",
            lambda index: "/v1/feedback",
            lambda index: json.dumps(
                {"coverage": (index % 100) / 100, "answer_kept": index % 3 != 0, "origin": "eval:load"}
            ).encode(),
        )
    if name == "messages":
        return Route(
            "/v1/transcripts/{transcript_id}/messages",
            lambda index: f"/v1/transcripts/load-{index % transcripts}/messages",
            lambda index: json.dumps(
                {"messages": [{"role": "user", "text": f"message {index}: {MESSAGE}"}]}
            ).encode(),
        )
    return Route(
        "/v1/pages",
        lambda index: "/v1/pages",
        lambda index: json.dumps(
            {"slug": f"load/{index}", "type": "conversation", "title": "t", "compiled_truth": CONVERSATION}
        ).encode(),
    )


async def deliver(
    client: httpx.AsyncClient, target: Route, index: int, took: list[float], keyed: bool
) -> int | str:
    """The answer's status code, or the name of the error that left the delivery without one; appends
    the delivery's milliseconds to ``took``."""
    body, path = target.body(index), target.path(index)
    started = time.perf_counter()
    try:
        response = await client.post(
            path,
            content=body,
            headers=signed_json_headers(
                body, SECRET, method="POST", path=path, idempotency_key=f"load-{index}" if keyed else None
            ),
        )
    except httpx.HTTPError as exc:
        return type(exc).__name__
    finally:
        took.append((time.perf_counter() - started) * 1000)
    return response.status_code


async def deliver_all(
    base: str, target: Route, requests: int, concurrency: int, keyed: bool
) -> tuple[list[int | str], list[float]]:
    """``concurrency`` lanes, each sending one delivery at a time, ``CLIENT_POOL`` lanes to a client."""
    indexes = iter(range(requests))
    statuses: list[int | str] = []
    took: list[float] = []
    clients = [
        httpx.AsyncClient(base_url=base, limits=httpx.Limits(max_connections=CLIENT_POOL), timeout=60)
        for _ in range(-(-concurrency // CLIENT_POOL))
    ]

    async def lane(client: httpx.AsyncClient) -> None:
        for index in indexes:
            statuses.append(await deliver(client, target, index, took, keyed))

    try:
        await asyncio.gather(*(lane(clients[n // CLIENT_POOL]) for n in range(concurrency)))
    finally:
        for client in clients:
            await client.aclose()
    return statuses, took


def _cpu(process: psutil.Process) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


async def run(
    base: str, target: Route, requests: int, concurrency: int, server_pid: int, keyed: bool, name: str
) -> dict[str, object]:
    api = psutil.Process(server_pid)
    baseline: list[float] = []
    idle = _cpu(api)
    stop, thread = probing(base, baseline)
    await asyncio.sleep(2.0)
    stop.set()
    thread.join()
    # The API's CPU a probe, unloaded: the probes sent during the load are charged at it and taken out
    # (they ran 100-150 a second, as many as the deliveries, so a slower tree's deliveries carried more).
    probe_cpu = (_cpu(api) - idle) / max(len(baseline), 1)
    loaded: list[float] = []
    stop, thread = probing(base, loaded)
    elsewhere = pipe.commits_elsewhere(SERVER, name)
    api_before, postgres_before, probes_before = (
        _cpu(api),
        pipe.cpu_by_pid(pipe.postgres_processes()),
        len(loaded),
    )
    started = time.perf_counter()
    statuses, deliveries = await deliver_all(base, target, requests, concurrency, keyed)
    took = time.perf_counter() - started
    api_after, postgres_after, probes = _cpu(api), pipe.cpu_by_pid(pipe.postgres_processes()), len(loaded)
    pipe.warn_if_busy_elsewhere(elsewhere, pipe.commits_elsewhere(SERVER, name))
    probes_cpu = (probes - probes_before) * probe_cpu
    api_cpu = max(0.0, api_after - api_before - probes_cpu)
    postgres_cpu = pipe.cpu_since(postgres_before, postgres_after)
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        metrics = await client.get("/metrics", headers={"Authorization": f"Bearer {ADMIN}"})
    stop.set()
    thread.join()
    return {
        "baseline": baseline,
        "loaded": loaded,
        "deliveries": deliveries,
        "server": server_quantiles(metrics.text, "POST", target.template),
        "statuses": Counter(statuses),
        "took": took,
        "cpu_ms": (api_cpu / requests * 1000, postgres_cpu / requests * 1000),
        "probes_cpu_ms": (probes - probes_before, probe_cpu * 1000, probes_cpu / requests * 1000),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=200)
    parser.add_argument("--port", type=int, default=0, help="the server's port (default: a free one)")
    parser.add_argument("--idempotency-keys", action="store_true", help="a key of its own for each delivery")
    parser.add_argument("--route", choices=("pages", "messages", "feedback"), default="pages")
    parser.add_argument("--transcripts", type=int, default=200, help="with --route messages")
    parser.add_argument("--keep-logs", action="store_true", help="keep the server's log (path printed)")
    args = parser.parse_args()
    with fresh_database(SERVER, "load") as url:
        name = str(make_url(url).database)
        with pipe.run_logs(name, args.keep_logs) as logs:
            log_path = logs / "server.log"
            try:
                result, target = serve_and_load(args, url, name, log_path)
            finally:
                pipe.forget_broker_keys(f"{name}:", BROKER)
            server_log = log_path.read_text()
    return report(args, result, target, server_log)


def wait_healthy(base: str, server: subprocess.Popen[bytes], log_path: Path, timeout: float = 120) -> None:
    """Until the server started here answers /healthz with 200; a clear failure (with its log's end)
    if it exits first or never does within ``timeout`` seconds (a loaded machine starts it slowly)."""
    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(
                f"the server exited ({server.returncode}) before it was healthy; its log ends:\n"
                f"{log_path.read_text(errors='replace')[-2000:]}"
            )
        try:
            response = httpx.get(base + "/healthz", timeout=1)
            if response.status_code == 200:
                return
            last = f"status {response.status_code}"
        except httpx.HTTPError as exc:
            last = type(exc).__name__
        time.sleep(0.1)
    raise SystemExit(
        f"the server at {base} was not healthy after {timeout:.0f} s (last: {last}); its log ends:\n"
        f"{log_path.read_text(errors='replace')[-2000:]}"
    )


def serve_and_load(
    args: argparse.Namespace, url: str, name: str, log_path: Path
) -> tuple[dict[str, object], Route]:
    """Start `factmill serve` on the fresh database at ``url``, run the deliveries against it, stop it
    (killed if it has not exited 20 s after SIGTERM)."""
    server: subprocess.Popen[bytes] | None = None
    try:
        db.upgrade(url)
        env = {k: v for k, v in os.environ.items() if not k.startswith("FACTMILL_")} | {
            "FACTMILL_DATABASE_URL": url,
            "FACTMILL_BROKER_URL": BROKER,
            "FACTMILL_BROKER_KEY_PREFIX": f"{name}:",
            "FACTMILL_WEBHOOK_SECRET": SECRET,
            "FACTMILL_ADMIN_TOKEN": ADMIN,
            "PYTHONPATH": str(REPO),
        }
        port = args.port or free_port()
        with log_path.open("wb") as log:  # the server holds its own copy of the descriptor
            server = subprocess.Popen(
                [sys.executable, "-m", "worker.cli", "serve", "--port", str(port)],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, server, log_path)
        target = route(args.route, args.transcripts)
        result = asyncio.run(
            run(base, target, args.requests, args.concurrency, server.pid, args.idempotency_keys, name)
        )
        return result, target
    finally:
        if server is not None:
            server.terminate()
            try:
                server.wait(timeout=20)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait(timeout=20)


def report(args: argparse.Namespace, result: dict[str, object], target: Route, server_log: str) -> int:
    """Prints the figures; 1 when a delivery got a 5xx or no answer, or the server logged a pool error."""
    pool_errors = server_log.count("QueuePool limit") + server_log.count("TimeoutError")
    baseline, loaded = result["baseline"], result["loaded"]
    assert isinstance(baseline, list) and isinstance(loaded, list)
    statuses = result["statuses"]
    assert isinstance(statuses, Counter)
    print(
        f"{args.requests} signed POST {target.template}, {args.concurrency} concurrent, "
        f"in {result['took']:.2f} s"
    )
    answered = {s: n for s, n in statuses.items() if isinstance(s, int)}
    unanswered = {s: n for s, n in statuses.items() if not isinstance(s, int)}
    server_errors = sum(n for s, n in answered.items() if s >= 500)
    print(f"statuses: {dict(sorted(answered.items()))}  5xx: {server_errors}")
    if unanswered:
        print(f"no answer (client-side errors): {dict(sorted(unanswered.items()))}")
    print(f"pool errors in the server log: {pool_errors}")
    deliveries = result["deliveries"]
    assert isinstance(deliveries, list)
    print(
        f"a delivery at the client: p50 {statistics.median(deliveries):.1f} ms, "
        f"p99 {percentile(deliveries, 0.99):.1f} ms, max {max(deliveries):.1f} ms"
    )
    api_ms, postgres_ms = result["cpu_ms"]  # type: ignore[misc]
    probes, probe_ms, taken_ms = result["probes_cpu_ms"]  # type: ignore[misc]
    print(
        f"CPU a delivery: the API {api_ms:.2f} ms, Postgres {postgres_ms:.2f} ms (the API's less "
        f"{taken_ms:.2f} ms a delivery for the {probes} /healthz probes sent meanwhile, at {probe_ms:.2f} ms "
        "each unloaded)"
    )
    server = result["server"]
    assert isinstance(server, dict)
    print(f"a delivery inside the API (its request histogram): p50 <= {server[0.5]}, p99 <= {server[0.99]}")
    print(
        f"/healthz baseline (no load, n={len(baseline)}): p50 {statistics.median(baseline):.1f} ms, "
        f"p99 {percentile(baseline, 0.99):.1f} ms"
    )
    print(
        f"/healthz under load (n={len(loaded)}): p50 {statistics.median(loaded):.1f} ms, "
        f"p99 {percentile(loaded, 0.99):.1f} ms, max {max(loaded):.1f} ms"
    )
    return 1 if server_errors or unanswered or pool_errors else 0


if __name__ == "__main__":
    stop_cleanly_on_termination()
    sys.exit(main())
