"""Pipeline benchmark: signed webhooks → Redis → Celery worker → LLM simulator → facts in Postgres.

Prints segments per second against the ideal (calls in flight / latency) and against the original
sequential loop (one segment at a time with a 200 ms pause), both measured in the same run, plus
worker CPU milliseconds per segment and webhook requests per second. The worker's CPU (ms per segment,
cores) is read when the last job ends, over the drain's own time; the embedding that goes on after it
(until every fact has its vector) is printed apart, as the tail.

    .venv/bin/python bench/pipeline.py [--pages 160] [--segments 8] [--latency-ms 100]
                                       [--jobs 16] [--segment-concurrency 4] [--keep-logs]
    .venv/bin/python bench/pipeline.py --pages 1 --segments 4000 --jobs 1 --segment-concurrency 64

It also prints the CPU the rest of the machine spent per segment over the drain (Postgres's
processes, the simulator) and the transactions committed in the bench database (pg_stat_database),
with the segment commits among them: machine-independent counts of the per-page work.

The rate counts the segments measured in the database (distinct segments with an ok extraction), never
the planned count; the in-flight count is sampled from the simulator every 0.1 s over the run. The page
generator spaces segments two hours apart from 2024-06-01 08:00, so any size gives valid timestamps.

Needs the local Postgres (127.0.0.1:5432) and Redis (127.0.0.1:6379); creates and drops its own
database and uses its own Redis key prefix, whose keys it deletes at the end. The services' logs go to
a temporary folder, removed at the end unless --keep-logs is given or the run failed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import psutil
import psycopg
import redis
from sqlalchemy.engine import make_url

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.service import at_least, free_port, fresh_database, stop_cleanly_on_termination  # noqa: E402
from worker import db  # noqa: E402
from worker.core.signing import signed_json_headers  # noqa: E402
from worker.extraction import extract_segment  # noqa: E402
from worker.llm.openai_compat import OpenAIChatClient  # noqa: E402

SERVER = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
SECRET = "bench-secret"
# The benchmarks' Redis database: the test suite takes 13 and down (one per pytest-xdist process,
# tests/service.py), so a benchmark run beside the tests never shares its queues.
BROKER = "redis://127.0.0.1:6379/15"


PAGE_START = datetime(2024, 6, 1, 8, 0)


def page_body(index: int, segments: int) -> str:
    """A conversation page of ``segments`` segments: 3 messages each, segments 2 hours apart (any size)."""
    lines = []
    for s in range(segments):
        opens = PAGE_START + timedelta(hours=2 * s)  # past the 30-minute gap, so each s is a segment
        for m in range(3):
            who = ("Alice Example", "Bob Demo", "Zoë Ångström")[(s + m) % 3]
            stamp = (opens + timedelta(minutes=m)).strftime("%Y-%m-%d %H:%M")
            lines.append(
                f"**{who}** ({stamp}): I moved to Lisbon in {2000 + index % 20} "
                f"and I will run {5 + s} km with Acme Corp colleagues on Sunday {s}-{m}."
            )
    return "\n".join(lines)


def planned_segments(body: str) -> int:
    """How many segments the worker will cut ``body`` into (the generator's intent, checked)."""
    from worker.core.conversation import parse_conversation_messages, split_into_segments

    return len(split_into_segments(parse_conversation_messages(body)))


class InFlightSampler(threading.Thread):
    """Polls the simulator's in-flight count of chat calls (the pipe's; the facts' background embedding
    calls are left out) every ``period`` seconds until stopped."""

    def __init__(self, stats_url: str, period: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.stats_url, self.period = stats_url, period
        self.samples: list[int] = []
        self._stop_event = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=2) as client:
            while not self._stop_event.is_set():
                with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
                    by_route = client.get(self.stats_url).json()["in_flight_by_route"]
                    self.samples.append(sum(n for route, n in by_route.items() if route != "embeddings"))
                self._stop_event.wait(self.period)

    def finish(self) -> list[int]:
        self._stop_event.set()
        self.join()
        return self.samples


def describe_in_flight(samples: list[int], in_flight: int) -> str:
    if not samples:
        return "in flight: no samples"
    return (
        f"chat calls in flight at the simulator over the drain, sampled every 0.1 s ({len(samples)} "
        f"samples): min {min(samples)}, "
        f"median {statistics.median(samples):g}, max {max(samples)}, mean {statistics.fmean(samples):.1f} "
        f"(configured {in_flight}; mean / configured {statistics.fmean(samples) / in_flight:.2f})"
    )


def wait_http(url: str, timeout: float = 180) -> None:
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


@contextlib.contextmanager
def run_logs(name: str, keep: bool = False) -> Iterator[Path]:
    """A fresh folder (under the system's temporary directory) for a run's service logs: removed at
    the end, unless ``keep`` (a bench's --keep-logs) or the run failed (raised, or exited: a run that
    finished with work not done exits 1 after its figures);
    its path is printed (to stderr) when kept."""
    logs = Path(tempfile.mkdtemp(prefix=f"{name}-"))
    failed = False
    try:
        yield logs
    except BaseException:
        failed = True
        raise
    finally:
        if keep or failed:
            print(f"logs kept in {logs}", file=sys.stderr)
        else:
            shutil.rmtree(logs, ignore_errors=True)


def forget_broker_keys(prefix: str, url: str = BROKER) -> int:
    """Delete a run's keys under its own ``prefix`` (FACTMILL_BROKER_KEY_PREFIX: its queues, kombu's
    bindings, rate-limit counters) from the benchmarks' Redis database; how many there were."""
    if not prefix:
        raise ValueError("a run's own key prefix is needed: an empty one would match every key")
    client = redis.Redis.from_url(url)
    try:
        keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
        for start in range(0, len(keys), 1000):
            client.delete(*keys[start : start + 1000])
        return len(keys)
    finally:
        client.close()


def postgres_processes() -> list[psutil.Process]:
    """The local Postgres server's processes (the postmaster and every backend), where readable."""
    found = []
    for proc in psutil.process_iter(["name"]):
        if proc.info["name"] in {"postgres", "postmaster"}:
            found.append(proc)
    return found


def cpu_by_pid(procs: list[psutil.Process]) -> dict[int, float]:
    """User + system CPU seconds of each of ``procs`` still running, by pid, with their children that
    ended and were reaped: a Postgres backend that exits mid-run (a pool's overflow connection)
    counts in its postmaster's children times."""
    seconds = {}
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            times = proc.cpu_times()
            seconds[proc.pid] = times.user + times.system + times.children_user + times.children_system
    return seconds


def cpu_since(before: dict[int, float], now: dict[int, float]) -> float:
    """CPU seconds spent between two ``cpu_by_pid`` readings, counting processes started in between
    (a connection pool's new backends) from zero; one that ended in between counts through its
    parent's children times."""
    return sum(seconds - before.get(pid, 0.0) for pid, seconds in now.items())


# The benchmark's own readings and autovacuum commit a few transactions elsewhere during a run.
OTHER_COMMITS_NOTED = 100


def commits_elsewhere(server: str, name: str) -> dict[int, int] | None:
    """Transactions committed so far in each database but ``name`` on ``server`` (an SQLAlchemy URL), by
    database id; None when it cannot be read. Read before and after a run: the work the Postgres CPU
    figures count though it is not the benchmark's (they add up the CPU of every Postgres process on
    the machine: a test suite beside the run, another benchmark)."""
    url = make_url(server).set(drivername="postgresql", database="postgres")
    try:
        with psycopg.connect(url.render_as_string(hide_password=False), autocommit=True) as conn:
            conn.execute("SELECT pg_stat_clear_snapshot()")
            rows = conn.execute(
                "SELECT datid, xact_commit FROM pg_stat_database WHERE datname IS NOT NULL AND datname <> %s",
                (name,),
            ).fetchall()
    except psycopg.Error:
        return None
    return {int(datid): int(commits) for datid, commits in rows}


def busy_elsewhere(before: dict[int, int], after: dict[int, int]) -> tuple[int, bool]:
    """(transactions other databases committed between the readings, whether one was dropped meanwhile:
    its commits leave the statistics with it, so someone else was at work whatever the count says)."""
    committed = sum(max(0, after.get(datid, 0) - before.get(datid, 0)) for datid in {*before, *after})
    return committed, bool(set(before) - set(after))


def warn_if_busy_elsewhere(before: dict[int, int] | None, after: dict[int, int] | None) -> None:
    if before is None or after is None:
        print("note: the other databases' work during the run could not be read")
        return
    committed, dropped = busy_elsewhere(before, after)
    if committed > OTHER_COMMITS_NOTED or dropped:
        also = " and a database was dropped" if dropped else ""
        print(
            f"warning: other databases committed {committed:,} transactions during the run{also}; the "
            "Postgres CPU figures count their work too (measure on a quiet machine)"
        )


def database_counts(conn: psycopg.Connection[tuple[int, int]], name: str) -> tuple[int, int]:
    """(transactions committed, connections opened) so far in database ``name`` (statistics are
    flushed within a second)."""
    conn.execute("SELECT pg_stat_clear_snapshot()")
    row = conn.execute(
        "SELECT xact_commit, sessions FROM pg_stat_database WHERE datname = %s", (name,)
    ).fetchone()
    return (int(row[0]), int(row[1])) if row else (0, 0)


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


@dataclass(frozen=True)
class Figures:
    planned: int  # segments the pages split into (by the worker's own splitter)
    ok: int  # distinct segments with an ok extraction, counted in the database
    attempted: int  # distinct segments with any audit row
    elapsed: float
    worker_cpu: float  # CPU seconds of the workers over the drain (until the last job ended)
    tail_seconds: float  # from the last job's end until every fact had its vector (0 with --no-embed)
    tail_worker_cpu: float  # CPU seconds of the workers over that tail (the embedding follow-ups)
    baseline: float  # sequential loop, segments/s, measured in this run
    webhook_rps: float
    failed_jobs: int
    others_cpu: dict[str, float]  # CPU seconds of the other processes over the drain (postgres, simulator)
    tail_others_cpu: dict[str, float]  # the same over the embedding tail
    transactions: int  # transactions committed in the bench database over the drain (pg_stat_database)
    connections: int  # connections opened to the bench database over the drain (pg_stat_database)
    segment_commits: int  # transactions that committed ok segments (facts + audit + checkpoint)


def report(args: argparse.Namespace, f: Figures, in_flight: int, samples: list[int]) -> None:
    # bench/ab.py reads "pipeline: ", "  vs ideal", "worker CPU: " and "  the rest of the machine per ok
    # segment: postgres " from this output: keep those beginnings.
    rate = f.ok / f.elapsed
    ideal = in_flight / (args.latency_ms / 1000)
    print(
        f"pages {args.pages} × {args.segments} segments: {f.planned} segments planned, {f.attempted} "
        f"attempted, {f.ok} ok (measured in extraction_audit); {in_flight} LLM calls in flight "
        f"({args.workers} worker(s) × {in_flight // args.workers} calls, {args.jobs} jobs each); "
        f"simulator latency {args.latency_ms} ms; failed jobs {f.failed_jobs}"
    )
    if f.ok != f.planned:
        print(
            f"  WARNING: {f.planned - f.ok} planned segments did not finish ok; the rate counts only ok ones"
        )
    print(
        f"webhook: {f.webhook_rps:.0f} requests/s (one signed page per request, sequential client, no worker)"
    )
    print(f"pipeline: {rate:.1f} segments/s ({f.ok} ok segments in {f.elapsed:.2f} s)")
    print(f"  vs ideal ({in_flight} / {args.latency_ms / 1000:g} s = {ideal:.0f}/s): {rate / ideal:.2f}")
    print(
        f"  vs sequential loop with 200 ms pause ({f.baseline:.2f}/s, measured in this run): "
        f"{rate / f.baseline:.0f}x"
    )
    print(f"  {describe_in_flight(samples, in_flight)}")
    print(
        f"worker CPU: {1000 * f.worker_cpu / max(f.ok, 1):.2f} ms per ok segment "
        f"({f.worker_cpu:.1f} s over the {f.elapsed:.1f} s drain = {f.worker_cpu / f.elapsed:.2f} core, "
        f"{psutil.cpu_count()} cores)"
    )
    others = ", ".join(
        f"{name} {1000 * seconds / max(f.ok, 1):.2f} ms" for name, seconds in f.others_cpu.items()
    )
    print(f"  the rest of the machine per ok segment: {others} (over the drain)")
    if f.tail_seconds:
        tail_others = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in f.tail_others_cpu.items())
        print(
            f"embedding tail ({f.tail_seconds:.1f} s from the last job's end until every fact had its "
            f"vector, or the 120 s limit): worker CPU {f.tail_worker_cpu:.1f} s "
            f"({f.tail_worker_cpu / f.tail_seconds:.2f} core), {tail_others}; drain and tail together "
            f"{1000 * (f.worker_cpu + f.tail_worker_cpu) / max(f.ok, 1):.2f} worker ms per ok segment"
        )
    print(
        f"postgres: {f.transactions} transactions committed over the drain, "
        f"{f.transactions / max(f.ok, 1):.2f} per ok segment, "
        f"{f.transactions * args.segments / max(f.ok, 1):.1f} per page; "
        f"{f.segment_commits} segment commits, {f.ok / max(f.segment_commits, 1):.2f} segments each; "
        f"{f.connections} connections opened ({f.connections / f.elapsed:.1f} a second)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pages", type=int, default=160)
    parser.add_argument("--segments", type=int, default=8, help="segments per page")
    parser.add_argument("--latency-ms", type=at_least(1, "the ideal rate divides by it"), default=100)
    parser.add_argument("--jobs", type=int, default=16, help="worker threads (pages in flight)")
    parser.add_argument(
        "--segment-concurrency",
        type=int,
        default=4,
        help="sizes the default pipe (FACTMILL_LLM_CONCURRENCY = --jobs × this); no page has a window",
    )
    parser.add_argument(
        "--baseline-samples", type=at_least(1, "the baseline's rate needs a sample"), default=12
    )
    parser.add_argument("--workers", type=int, default=1, help="worker processes (each with --jobs threads)")
    parser.add_argument("--no-embed", action="store_true", help="leave embeddings to `factmill embed`")
    parser.add_argument("--keep-logs", action="store_true", help="keep the services' logs (path printed)")
    parser.add_argument(
        "--task-events",
        action="store_true",
        help="workers send Celery task events from the start, as under Flower (FACTMILL_TASK_EVENTS)",
    )
    parser.add_argument(
        "--llm-concurrency",
        type=int,
        default=0,
        help="LLM calls in flight per worker (FACTMILL_LLM_CONCURRENCY); default jobs × segment calls",
    )
    args = parser.parse_args()
    per_worker = args.llm_concurrency or args.jobs * args.segment_concurrency
    in_flight = per_worker * args.workers
    with fresh_database(SERVER, "bench") as url:
        drain(args, url, per_worker, in_flight)


def drain(args: argparse.Namespace, url: str, per_worker: int, in_flight: int) -> None:
    """Webhook the pages into a fresh database, then time worker processes draining them."""
    name = str(make_url(url).database)
    with run_logs(name, args.keep_logs) as logs:
        run_drain(args, url, name, logs, per_worker, in_flight)


def run_drain(
    args: argparse.Namespace, url: str, name: str, logs: Path, per_worker: int, in_flight: int
) -> None:
    procs: list[subprocess.Popen[bytes]] = []
    try:
        db.upgrade(url)
        sim_port, api_port = free_port(), free_port()
        base_env = {k: v for k, v in os.environ.items() if not k.startswith("FACTMILL_")}
        simulator = ["-m", "worker.simulator", "--port", str(sim_port), "--latency-ms", str(args.latency_ms)]
        procs.append(spawn(simulator, base_env, logs / "simulator.log"))
        simulator_url = f"http://127.0.0.1:{sim_port}/v1"
        env = base_env | {
            "FACTMILL_DATABASE_URL": url,
            "FACTMILL_BROKER_URL": BROKER,
            "FACTMILL_BROKER_KEY_PREFIX": f"{name}:",
            "FACTMILL_LLM": "simulator",
            "FACTMILL_SIMULATOR_URL": simulator_url,
            "FACTMILL_WEBHOOK_SECRET": SECRET,
            "FACTMILL_LLM_CONCURRENCY": str(per_worker),
            "FACTMILL_EMBED_AFTER_EXTRACTION": "false" if args.no_embed else "true",
            "FACTMILL_TASK_EVENTS": "true" if args.task_events else "false",
        }
        procs.append(spawn(["-m", "worker.cli", "serve", "--port", str(api_port)], env, logs / "api.log"))
        wait_http(f"http://127.0.0.1:{sim_port}/_simulator/health")
        wait_http(f"http://127.0.0.1:{api_port}/readyz")

        baseline = sequential_baseline(simulator_url, args.baseline_samples)
        planned, webhook_rps = post_pages(args, api_port)
        workers = start_workers(args, env, logs)
        procs += workers
        figures, samples, vectors_lag = time_drain(
            args,
            name,
            workers,
            logs,
            procs[0],
            sim_port,
            planned=planned,
            baseline=baseline,
            webhook_rps=webhook_rps,
        )
        report(args, figures, in_flight, samples)
        if vectors_lag is not None:
            print(f"  every fact embedded {vectors_lag:.2f} s after the last job finished")
        if figures.ok != figures.planned:  # a failed run exits 1 and keeps its services' logs (run_logs)
            raise SystemExit(f"{figures.planned - figures.ok} planned segment(s) did not finish ok")
        if vectors_lag is None and not args.no_embed:
            raise SystemExit("some facts were still without a vector 120 s after the last job finished")
    finally:
        stop(procs)
        forget_broker_keys(f"{name}:")


def post_pages(args: argparse.Namespace, api_port: int) -> tuple[int, float]:
    """Phase 1, the webhook alone (no worker yet): one signed page a request. Returns the segments
    planned (by the worker's own splitter) and the pages a second the webhook took."""
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
    planned = sum(planned_segments(json.loads(body)["compiled_truth"]) for body in bodies)
    started = time.perf_counter()
    with httpx.Client(base_url=f"http://127.0.0.1:{api_port}", timeout=30) as client:
        for body in bodies:
            response = client.post(
                "/v1/pages",
                content=body,
                headers=signed_json_headers(body, SECRET, method="POST", path="/v1/pages"),
            )
            assert response.status_code == 202, response.text
    return planned, args.pages / (time.perf_counter() - started)


def start_workers(args: argparse.Namespace, env: dict[str, str], logs: Path) -> list[subprocess.Popen[bytes]]:
    """Phase 2's worker processes, started (``time_drain`` waits for each to be ready)."""
    workers = []
    for n in range(args.workers):
        command = ["-m", "worker.cli", "worker", "--queues", "extraction", "--concurrency", str(args.jobs),
                   "--processes", "1", "--pool", "threads", "--loglevel", "info"]  # fmt: skip
        workers.append(spawn([*command, "--hostname", f"bench{n}@%h"], env, logs / f"worker{n}.log"))
    return workers


def wait_ready(logs: Path, cpu_of: list[Callable[[], float]], first_ready: Callable[[], None]) -> float:
    """Until each worker logged "ready.": the sum of their CPU seconds, each read as that worker became
    ready (its start-up not counted), ``first_ready`` called the moment the first one was. The first
    one drains the queue while the others start, so the drain is timed from it, not from the last."""
    at_ready: dict[int, float] = {}
    deadline = time.monotonic() + 180  # a loaded machine takes a while to import the worker
    while len(at_ready) < len(cpu_of):
        for n, cpu in enumerate(cpu_of):
            if n not in at_ready and "ready." in (logs / f"worker{n}.log").read_text(errors="replace"):
                if not at_ready:
                    first_ready()
                at_ready[n] = cpu()
        if time.monotonic() > deadline:
            raise SystemExit("workers did not start; see " + str(logs))
        time.sleep(0.02)
    return sum(at_ready.values())


def time_drain(
    args: argparse.Namespace,
    name: str,
    workers: list[subprocess.Popen[bytes]],
    logs: Path,
    simulator: subprocess.Popen[bytes],
    sim_port: int,
    *,
    planned: int,
    baseline: float,
    webhook_rps: float,
) -> tuple[Figures, list[int], float | None]:
    """Phase 2, timed from the moment the first worker is ready: wait for every job to end (and every
    fact's vector), counting the CPU of the workers (each from its own ready moment), Postgres and the
    simulator meanwhile: over the drain (until the last job ended), and apart from it over the
    embedding tail after it."""
    sampler = InFlightSampler(f"http://127.0.0.1:{sim_port}/_simulator/stats")
    worker_ps = [psutil.Process(w.pid) for w in workers]
    others = {"postgres": postgres_processes, "simulator": lambda: [psutil.Process(simulator.pid)]}

    def cpu_of(process: psutil.Process) -> float:
        times = process.cpu_times()
        return float(times.user + times.system)

    def workers_cpu() -> float:
        return sum(cpu_of(p) for p in worker_ps)

    def others_cpu_now() -> dict[str, dict[int, float]]:
        return {label: cpu_by_pid(group()) for label, group in others.items()}

    with psycopg.connect(f"postgresql://postgres@127.0.0.1:5432/{name}", autocommit=True) as conn:
        start: dict[str, Any] = {}

        def first_ready() -> None:
            start["at"] = time.perf_counter()
            sampler.start()
            start["others"] = others_cpu_now()
            start["database"] = database_counts(conn, name)
            start["elsewhere"] = commits_elsewhere(SERVER, name)

        cpu_before = wait_ready(logs, [partial(cpu_of, p) for p in worker_ps], first_ready)
        started, others_before = float(start["at"]), start["others"]
        transactions_before, connections_before = start["database"]
        while True:
            done = conn.execute("SELECT count(*) FROM jobs WHERE status IN ('succeeded','failed')").fetchone()
            if done and done[0] >= args.pages:
                break
            if time.perf_counter() - started > 600:
                raise SystemExit("pipeline did not finish in 10 minutes")
            time.sleep(0.05)
        # When the last job ended, by the database's clock (this machine's): the first worker may have
        # drained the queue before the last one was ready, when this loop began.
        since = conn.execute(
            "SELECT EXTRACT(EPOCH FROM clock_timestamp() - max(finished_at)) FROM jobs"
        ).fetchone()
        finished = (
            time.perf_counter() - max(0.0, float(since[0]))
            if since and since[0] is not None
            else time.perf_counter()
        )
        # The drain's CPU and the pipe's occupancy, read as it ends: the embedding tail and the pauses
        # below are counted apart (sampled through the tail, the occupancy counted up to 120 s of an
        # empty pipe, and its median and mean read a quarter of the pipe busy).
        cpu_drained, others_drained = workers_cpu(), others_cpu_now()
        samples = sampler.finish()
        vectors_lag = None
        while not args.no_embed and time.perf_counter() - finished < 120:
            missing = conn.execute(
                "SELECT count(*) FROM facts WHERE embedding IS NULL AND NOT is_audit"
            ).fetchone()
            if missing and missing[0] == 0:
                vectors_lag = time.perf_counter() - finished
                break
            time.sleep(0.05)
        tail_end = time.perf_counter() if not args.no_embed else finished
        cpu_tailed, others_tailed = workers_cpu(), others_cpu_now()
        others_cpu = {label: cpu_since(others_before[label], others_drained[label]) for label in others}
        tail_others_cpu = {label: cpu_since(others_drained[label], others_tailed[label]) for label in others}
        time.sleep(1.5)  # backends flush their statistics at most once a second
        warn_if_busy_elsewhere(start["elsewhere"], commits_elsewhere(SERVER, name))
        transactions, connections = database_counts(conn, name)
        transactions, connections = transactions - transactions_before, connections - connections_before
        failed = conn.execute("SELECT count(*) FROM jobs WHERE status = 'failed'").fetchone()
        # Measured, not planned: the distinct segments that ended with an extraction (any outcome).
        measured = conn.execute(
            "SELECT count(DISTINCT (page_slug, segment_index)) FILTER (WHERE outcome = 'ok'), "
            "count(DISTINCT (page_slug, segment_index)) FROM extraction_audit"
        ).fetchone()
        # A transaction's rows share now(): distinct (page, created_at) pairs are its segment commits.
        commits = conn.execute(
            "SELECT count(DISTINCT (page_slug, created_at)) FROM extraction_audit WHERE outcome = 'ok'"
        ).fetchone()
    worker_cpu = cpu_drained - cpu_before
    ok_segments, attempted = (measured[0], measured[1]) if measured else (0, 0)

    figures = Figures(planned, ok_segments, attempted, finished - started, worker_cpu, tail_end - finished,
                      cpu_tailed - cpu_drained, baseline, webhook_rps, failed[0] if failed else -1,
                      others_cpu, tail_others_cpu, transactions, connections,
                      commits[0] if commits else 0)  # fmt: skip
    return figures, samples, vectors_lag


if __name__ == "__main__":
    stop_cleanly_on_termination()
    main()
