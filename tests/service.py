"""Test harness: real `factmill worker` / `beat` / `serve` processes against the test database and Redis."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import redis

REPO = Path(__file__).resolve().parent.parent
TEST_REDIS_DB = 13


def broker_url_for_tests() -> str:
    from worker.settings import Settings

    configured = Settings().broker_url
    return configured or f"redis://127.0.0.1:6379/{TEST_REDIS_DB}"


def redis_reachable(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=2).ping())
    except redis.RedisError:
        return False


def service_env(database_url: str, broker_url: str, simulator_url: str, **extra: Any) -> dict[str, str]:
    """Environment for service processes: fast heartbeats and sweeps so failures recover in seconds."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FACTMILL_")}
    env.update(
        {
            "FACTMILL_DATABASE_URL": database_url,
            "FACTMILL_BROKER_URL": broker_url,
            "FACTMILL_BROKER_KEY_PREFIX": f"factmill-test-{uuid.uuid4().hex[:8]}:",
            "FACTMILL_LLM": "simulator",
            "FACTMILL_SIMULATOR_URL": simulator_url,
            "FACTMILL_CONFIG_CACHE_SECONDS": "0.5",
            "FACTMILL_JOB_HEARTBEAT_SECONDS": "0.5",
            "FACTMILL_JOB_STALE_AFTER_SECONDS": "4",
            "FACTMILL_JOB_REQUEUE_AFTER_SECONDS": "4",
            "FACTMILL_SWEEP_INTERVAL_SECONDS": "1",
            "FACTMILL_SEGMENT_CONCURRENCY": "4",
            "FACTMILL_WEBHOOK_SECRET": "test-secret",
            "FACTMILL_ADMIN_TOKEN": "test-admin",
            "PYTHONUNBUFFERED": "1",
        }
    )
    env.update({f"FACTMILL_{k.upper()}": str(v) for k, v in extra.items()})
    return env


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
        if self.ready_marker is not None and not self._ready.wait(timeout):
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

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()


def start_worker(
    env: dict[str, str], queues: str = "extraction,maintenance", concurrency: int = 8, name: str | None = None
) -> ServiceProcess:
    node = name or f"w{uuid.uuid4().hex[:6]}@%h"
    return ServiceProcess(
        [
            "worker",
            "--queues",
            queues,
            "--concurrency",
            str(concurrency),
            "--pool",
            "threads",
            "--loglevel",
            "info",
            "--hostname",
            node,
        ],
        env,
        ready_marker="ready.",
        name="worker",
    ).start()


def start_beat(env: dict[str, str], data_dir: Path) -> ServiceProcess:
    return ServiceProcess(
        ["beat"], {**env, "FACTMILL_DATA_DIR": str(data_dir)}, ready_marker="beat: Starting", name="beat"
    ).start()


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
