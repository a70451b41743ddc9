"""Pipeline benchmark: signed webhooks → Redis → Celery worker → LLM simulator → facts in Postgres.

Prints segments per second against the ideal (calls in flight / latency) and against the original
sequential loop (one segment at a time with a 200 ms pause), both measured in the same run, plus
worker CPU milliseconds per segment and webhook requests per second.

    .venv/bin/python bench/pipeline.py [--pages 160] [--segments 8] [--latency-ms 100]
                                       [--jobs 16] [--segment-concurrency 4]

Needs the local Postgres (127.0.0.1:5432) and Redis (127.0.0.1:6379); creates and drops its own
database and uses its own Redis key prefix.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import uuid
from datetime import datetime, timedelta
from pathlib import Path

import httpx
import psutil
import psycopg

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from worker import db  # noqa: E402
from worker.core.signing import signed_json_headers  # noqa: E402
from worker.extraction import extract_segment  # noqa: E402
from worker.llm.openai_compat import OpenAIChatClient  # noqa: E402

SERVER = "postgresql://postgres@127.0.0.1:5432/postgres"
SECRET = "bench-secret"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def page_body(index: int, segments: int) -> str:
    lines = []
    for s in range(segments):
        # Six segments a day, two hours apart, on valid dates however many there are.
        day = (datetime(2024, 6, 1) + timedelta(days=s // 6)).strftime("%Y-%m-%d")
        hour = 8 + 2 * (s % 6)
        for m in range(3):
            who = ("Alice Example", "Bob Demo", "Zoë Ångström")[(s + m) % 3]
            lines.append(
                f"**{who}** ({day} {hour:02d}:{m:02d}): I moved to Lisbon in {2000 + index % 20} "
                f"and I will run {5 + s} km with Acme Corp colleagues on Sunday {s}-{m}."
            )
    return "\n".join(lines)


def wait_http(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{url} did not come up")


def spawn(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as handle:
        return subprocess.Popen(
            [sys.executable, *args],
            env=env,
            cwd=REPO,
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """Stop the spawned processes (each its own session): SIGTERM to all, SIGKILL those not gone in 15 s."""
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, 15)
    for proc in procs:
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)


def sequential_baseline(simulator_url: str, samples: int) -> float:
    """The original loop: one segment at a time, then a 200 ms pause. Returns segments/second."""
    llm = OpenAIChatClient(model="simulator-1", base_url=simulator_url, provider="simulator")
    from worker.core.conversation import (
        parse_conversation_messages,
        render_segment_for_extraction,
        split_into_segments,
    )

    segments = split_into_segments(parse_conversation_messages(page_body(0, samples)))
    started = time.perf_counter()
    for segment in segments[:samples]:
        extract_segment(llm, render_segment_for_extraction("bench", segment), 10, 1024)
        time.sleep(0.2)
    return samples / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pages", type=int, default=160)
    parser.add_argument("--segments", type=int, default=8, help="segments per page")
    parser.add_argument("--latency-ms", type=int, default=100)
    parser.add_argument("--jobs", type=int, default=16, help="worker threads (pages in flight)")
    parser.add_argument("--segment-concurrency", type=int, default=4, help="LLM calls in flight per page")
    parser.add_argument("--baseline-samples", type=int, default=12)
    parser.add_argument("--workers", type=int, default=1, help="worker processes (each with --jobs threads)")
    parser.add_argument("--no-embed", action="store_true", help="leave embeddings to `factmill embed`")
    parser.add_argument(
        "--llm-concurrency",
        type=int,
        default=0,
        help="LLM calls in flight per worker (FACTMILL_LLM_CONCURRENCY); default jobs × segment calls",
    )
    args = parser.parse_args()
    per_worker = args.llm_concurrency or args.jobs * args.segment_concurrency
    in_flight = per_worker * args.workers
    name = f"factmill_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(SERVER, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    logs = Path("/tmp") / name
    logs.mkdir()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        db.upgrade(url)
        sim_port, api_port = free_port(), free_port()
        base_env = {k: v for k, v in os.environ.items() if not k.startswith("FACTMILL_")}
        procs.append(
            spawn(
                ["-m", "worker.simulator", "--port", str(sim_port), "--latency-ms", str(args.latency_ms)],
                base_env,
                logs / "simulator.log",
            )
        )
        simulator_url = f"http://127.0.0.1:{sim_port}/v1"
        env = base_env | {
            "FACTMILL_DATABASE_URL": url,
            "FACTMILL_BROKER_URL": "redis://127.0.0.1:6379/12",
            "FACTMILL_BROKER_KEY_PREFIX": f"{name}:",
            "FACTMILL_LLM": "simulator",
            "FACTMILL_SIMULATOR_URL": simulator_url,
            "FACTMILL_WEBHOOK_SECRET": SECRET,
            "FACTMILL_SEGMENT_CONCURRENCY": str(args.segment_concurrency),
            "FACTMILL_LLM_CONCURRENCY": str(per_worker),
            "FACTMILL_EMBED_AFTER_EXTRACTION": "false" if args.no_embed else "true",
        }
        procs.append(spawn(["-m", "worker.cli", "serve", "--port", str(api_port)], env, logs / "api.log"))
        wait_http(f"http://127.0.0.1:{sim_port}/_simulator/health")
        wait_http(f"http://127.0.0.1:{api_port}/readyz")

        baseline = sequential_baseline(simulator_url, args.baseline_samples)

        # Phase 1: the webhook alone (no worker yet), one signed page per request.
        bodies = [
            json.dumps(
                {
                    "slug": f"bench/p{i}",
                    "type": "conversation",
                    "title": f"p{i}",
                    "compiled_truth": page_body(i, args.segments),
                }
            ).encode()
            for i in range(args.pages)
        ]
        started = time.perf_counter()
        with httpx.Client(base_url=f"http://127.0.0.1:{api_port}", timeout=30) as client:
            for body in bodies:
                response = client.post(
                    "/v1/pages",
                    content=body,
                    headers=signed_json_headers(body, SECRET, method="POST", path="/v1/pages"),
                )
                assert response.status_code == 202, response.text
        webhook_seconds = time.perf_counter() - started

        # Phase 2: worker processes drain the queue; timed from the moment they are all ready.
        workers = []
        for n in range(args.workers):
            log = logs / f"worker{n}.log"
            workers.append(
                (
                    spawn(
                        [
                            "-m",
                            "worker.cli",
                            "worker",
                            "--queues",
                            "extraction",
                            "--concurrency",
                            str(args.jobs),
                            "--processes",
                            "1",
                            "--pool",
                            "threads",
                            "--loglevel",
                            "info",
                            "--hostname",
                            f"bench{n}@%h",
                        ],
                        env,
                        log,
                    ),
                    log,
                )
            )
        procs += [w for w, _ in workers]
        deadline = time.monotonic() + 60
        while not all("ready." in log.read_text(errors="replace") for _, log in workers):
            if time.monotonic() > deadline:
                raise SystemExit("workers did not start; see " + str(logs))
            time.sleep(0.02)
        started = time.perf_counter()
        worker_ps = [psutil.Process(w.pid) for w, _ in workers]
        cpu_before = sum(p.cpu_times().user + p.cpu_times().system for p in worker_ps)
        total_segments = args.pages * args.segments
        with psycopg.connect(f"postgresql://postgres@127.0.0.1:5432/{name}", autocommit=True) as conn:
            while True:
                done = conn.execute(
                    "SELECT count(*) FROM jobs WHERE status IN ('succeeded','failed')"
                ).fetchone()
                if done and done[0] >= args.pages:
                    break
                if time.perf_counter() - started > 600:
                    raise SystemExit("pipeline did not finish in 10 minutes")
                time.sleep(0.05)
            finished = time.perf_counter()
            vectors_lag = None
            while not args.no_embed and time.perf_counter() - finished < 120:
                missing = conn.execute(
                    "SELECT count(*) FROM facts WHERE embedding IS NULL AND NOT is_audit"
                ).fetchone()
                if missing and missing[0] == 0:
                    vectors_lag = time.perf_counter() - finished
                    break
                time.sleep(0.05)
            failed = conn.execute("SELECT count(*) FROM jobs WHERE status = 'failed'").fetchone()
            segments_done = conn.execute(
                "SELECT count(*) FROM extraction_audit WHERE outcome = 'ok'"
            ).fetchone()
        worker_cpu = sum(p.cpu_times().user + p.cpu_times().system for p in worker_ps) - cpu_before
        elapsed = finished - started
        rate = total_segments / elapsed
        ideal = in_flight / (args.latency_ms / 1000)
        print(
            f"pages {args.pages} × {args.segments} segments = {total_segments} segments; "
            f"{in_flight} LLM calls in flight ({args.workers} worker(s) × {per_worker}; {args.jobs} jobs "
            "each); "
            f"simulator latency {args.latency_ms} ms; failed jobs {failed[0] if failed else '?'}; "
            f"ok segments {segments_done[0] if segments_done else '?'}"
        )
        print(
            f"webhook: {args.pages / webhook_seconds:.0f} requests/s (one signed page per request, "
            "sequential client, no worker running)"
        )
        print(f"pipeline: {rate:.0f} segments/s in {elapsed:.2f} s")
        if vectors_lag is not None:
            print(f"  every fact embedded {vectors_lag:.2f} s after the last job finished")
        print(
            f"  vs ideal ({in_flight} / {args.latency_ms / 1000:.1f} s = {ideal:.0f}/s): {rate / ideal:.2f}"
        )
        print(f"  vs sequential loop with 200 ms pause ({baseline:.2f}/s, measured): {rate / baseline:.0f}x")
        print(
            f"worker CPU: {1000 * worker_cpu / total_segments:.2f} ms per segment "
            f"({worker_cpu:.1f} s over {elapsed:.1f} s on {psutil.cpu_count()} cores)"
        )
    finally:
        stop(procs)
        db.get_engine(url).dispose()
        with psycopg.connect(SERVER, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


if __name__ == "__main__":
    main()
