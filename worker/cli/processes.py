"""`factmill worker --processes N`: N worker processes under one parent that passes its signals on.

One Python process uses one core at a time (the GIL), so a worker that should use the machine runs one
process per core, each with its own LLM pipe and job threads. The parent only forwards SIGTERM,
SIGINT, SIGQUIT and SIGHUP (the last two as SIGTERM; each child then stops gracefully: see
worker.jobs.shutdown)
and waits; it exits with the first non-zero exit code of its children. When one child exits by itself
the others are stopped too, so a supervisor (systemd, Docker, Kubernetes) restarts the whole worker. A
child still running ``STOP_MARGIN_SECONDS`` past its own grace period (it should have exited by then,
however stuck its jobs) is killed, so a stop always ends.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from types import FrameType
from typing import Any, ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")

# SIGHUP (a closed terminal) is passed on as SIGTERM: Celery restarts on a SIGHUP, and not passed on,
# the parent died and its children (each in a process group of its own, so the terminal's hang-up
# missed them) ran on with no parent, off Linux for good (the parent-death signal is Linux's).
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGHUP)
PR_SET_PDEATHSIG = 1
# Past a child's grace period (FACTMILL_GRACE_SECONDS), the time it may take to exit before it is killed.
STOP_MARGIN_SECONDS = 15.0


def listened(signals: Sequence[int]) -> list[int]:
    """The signals to handle: all but a SIGHUP this process was started ignoring (`nohup`: the command
    must outlive its terminal, and a handler of ours would have undone that)."""
    return [sig for sig in signals if not (sig == signal.SIGHUP and signal.getsignal(sig) is signal.SIG_IGN)]


def default_processes() -> int:
    """One worker process per core this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def worker_processes(asked: int | None, pool: str, *, embedded_database: bool) -> int:
    """How many worker processes `factmill worker` runs: as asked; else one per core for the threads
    pool (prefork forks its own), but one on the embedded Postgres, whose 100 connections a process per
    core at 64 job threads each (about 40 connections apiece) would pass on a laptop of four cores."""
    if asked:
        return asked
    return default_processes() if pool == "threads" and not embedded_database else 1


def child_hostname(hostname: str | None, number: int) -> str:
    """Celery node names must differ: ``name@host`` becomes ``name-N@host``."""
    name, _, host = (hostname or "factmill@%h").partition("@")
    return f"{name}-{number}@{host or '%h'}"


def stop_with_parent() -> None:
    """In the child (Linux): a SIGTERM when the parent dies, even by SIGKILL, so none is orphaned."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def run_children(
    argvs: Sequence[Sequence[str]],
    grace_seconds: float,
    command: Sequence[str] = (sys.executable, "-m", "worker.cli"),
) -> int:
    """Start ``command <argv>`` once per argv, forward signals to them, wait for them all (killing
    any still there ``STOP_MARGIN_SECONDS`` after its grace period); the first non-zero exit code (0
    when all stopped cleanly)."""
    children: list[subprocess.Popen[bytes]] = []
    stopping: int | None = None  # the signal the children are stopped with, once one came
    kill_at: float | None = None

    def forward(signum: int, _frame: FrameType | None) -> None:
        nonlocal stopping, kill_at
        stopping = signal.SIGTERM if signum in (signal.SIGHUP, signal.SIGQUIT) else signum
        if kill_at is None:
            kill_at = time.monotonic() + grace_seconds + STOP_MARGIN_SECONDS
        for child in children:
            if child.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child.pid, stopping)

    previous = {sig: signal.signal(sig, forward) for sig in listened(FORWARDED)}
    try:
        preexec = stop_with_parent if sys.platform.startswith("linux") else None
        for argv in argvs:
            # A process group of its own: a terminal's Ctrl-C reaches the parent only, which passes it
            # on once (a second SIGINT is Celery's cold shutdown, which the threads pool cannot do).
            children.append(subprocess.Popen([*command, *argv], preexec_fn=preexec, process_group=0))
            if stopping is not None:  # a stop came while the children were being started: this one too
                with contextlib.suppress(ProcessLookupError):
                    os.kill(children[-1].pid, stopping)
        codes: dict[int, int] = {}
        while len(codes) < len(children):
            for child in children:
                code = child.poll()
                if code is not None and child.pid not in codes:
                    codes[child.pid] = code
                    if stopping is None:  # one went by itself: stop the rest, let the supervisor restart all
                        forward(signal.SIGTERM, None)
            if kill_at is not None and time.monotonic() > kill_at:
                for child in children:
                    if child.poll() is None:  # past its own grace period: stuck where no flag is read
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(child.pid, signal.SIGKILL)
            time.sleep(0.2)
        # A child killed by a signal has -N: the shell's 128 + N (typer.Exit(-9) exited 247).
        return next((code if code > 0 else 128 - code for code in codes.values() if code != 0), 0)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextmanager
def stopped_by_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP (a `kill`, a CI cancel, a closed terminal) end a command the way Ctrl-C does,
    so its clean-up runs: the demo stops the API, worker and beat (without it Python died at once and
    they ran on, on the embedded servers, with a simulator that had gone); `extract --batch` records the
    batch it leaves at the provider (without it no row knew the batch, its results were never
    collected, and a second run paid for a second batch). Main thread only (where signals are handled)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = {sig: signal.signal(sig, stop) for sig in listened((signal.SIGTERM, signal.SIGHUP))}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def stops_on_signals(command: Callable[P, R]) -> Callable[P, R]:
    """A command that SIGTERM and SIGHUP end as Ctrl-C does (``stopped_by_signals``), so the spend of
    the LLM calls it has in flight is recorded as it stops."""

    @functools.wraps(command)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        with stopped_by_signals():
            return command(*args, **kwargs)

    return run
