"""What the embedded servers share: the error, the lazy library import, and process checks."""

from __future__ import annotations

import importlib
import logging
import os
import re
import signal
import subprocess
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Literal

from worker.core.errors import EmbeddedUnavailableError  # defined there: the CLI's top catches it

logger = logging.getLogger(__name__)

StopState = Literal["stopped", "not running", "still running"]


@dataclass(frozen=True)
class StopOutcome:
    """What stopping one embedded server did, in words `factmill db stop` prints."""

    server: str  # "Postgres" or "Redis"
    state: StopState
    detail: str = ""

    def describe(self) -> str:
        return f"embedded {self.server}: {self.state}" + (f" ({self.detail})" if self.detail else "")


def to_sqlalchemy_url(url: str) -> str:
    """Make a libpq-style URL use the psycopg 3 driver."""
    for prefix in ("postgresql+psycopg://", "postgresql+psycopg2://", "postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url


@contextmanager
def quiet_runtime_dir() -> Iterator[None]:
    """Hide platformdirs' RuntimeDirWarning, which pgserver triggers when it is imported (and when it
    starts or stops a server) wherever XDG_RUNTIME_DIR is unset (containers, CI, `sudo`): it says
    platformdirs falls back to /tmp/runtime-<uid>, which is harmless here, and it would otherwise
    reach the user's terminal on every command that uses the embedded Postgres."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module=r"platformdirs(\.|$)")
        yield


def server_library(name: str, setting: str) -> ModuleType:
    """Import pgserver. Only here, on first use: a deployment that sets the server URLs never loads it."""
    try:
        with quiet_runtime_dir():
            return importlib.import_module(name)
    except ImportError as exc:  # left out where it has no build (pgserver: Python 3.13+, Linux on ARM)
        raise EmbeddedUnavailableError(
            f"{name} is not installed (it has no build for every Python and platform: pgserver has none "
            f"for Python 3.13 nor for Linux on ARM); set {setting}, or use Python 3.11 or 3.12 on another "
            "platform"
        ) from exc


def folder(data_dir: Path, name: str) -> Path:
    path = (data_dir / name).resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path


def read_pid(path: Path) -> int | None:
    """The pid on the first line of a pid file (Redis's, Postgres's postmaster.pid), None if unreadable."""
    try:
        first = path.read_text().split("\n", 1)[0].strip()
    except OSError:
        return None
    return int(first) if first.isdigit() and int(first) > 0 else None


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs. A zombie (exited, not yet reaped: a container whose init never reaps
    does that) counts as gone, or a stopped server would look alive for good."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists; another user's process
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc (macOS): the kill probe is all we know
    return stat.rpartition(")")[2].split()[:1] != ["Z"]


def command_line(pid: int) -> str | None:
    """The process's command line (or title) as one string, None if it cannot be read."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
        return raw.replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        pass
    try:  # no /proc (macOS)
        shown = subprocess.run(
            ["ps", "-o", "command=", "-p", str(pid)], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return shown.stdout.strip() or None


def is_process_of(pid: int, marker: str) -> bool:
    """Is ``pid`` alive and the server whose command line names ``marker`` (its data folder or socket)?
    A pid file outlives a crashed server and the pid may since belong to something else."""
    if not pid_alive(pid):
        return False
    line = command_line(pid)
    return line is not None and names_path(line, marker)


def names_path(line: str, path: str) -> bool:
    """Whether a command line names ``path`` whole (an argument, or after "name:" or "name="): as a
    substring, /work/main/var's socket was found in /home/alice/work/main/var's server's title, and
    starting the one folder's Redis stopped the other's."""
    return re.search(rf"(?:^|[\s:=]){re.escape(path)}(?:$|\s)", line) is not None


def wait_exited(pid: int, timeout: float, interval: float = 0.1) -> bool:
    """Poll until ``pid`` is gone; False if it still runs after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while pid_alive(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
    return True


def signal_and_wait(server: str, pid: int, signum: int, timeout: float) -> StopOutcome:
    """Send ``signum`` to a server and report only what really happened to it."""
    try:
        os.kill(pid, signum)
        if signum != signal.SIGCONT:
            os.kill(pid, signal.SIGCONT)  # a stopped (SIGSTOP) process handles the signal only once resumed
    except ProcessLookupError:
        return StopOutcome(server, "stopped", f"pid {pid}")
    except PermissionError:
        return StopOutcome(
            server, "still running", f"pid {pid} belongs to another user; stop it as that user"
        )
    if wait_exited(pid, timeout):
        return StopOutcome(server, "stopped", f"pid {pid}")
    return StopOutcome(server, "still running", f"pid {pid} did not exit within {timeout:.0f} s")
