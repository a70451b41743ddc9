"""Graceful stop: the worker process's "stopping" flag, and the grace period that bounds a stop.

On SIGTERM Celery stops consuming and waits for the tasks it holds (warm shutdown). A running job
sees the flag at its next guard check (between segments), hands its lease back and re-sends its
message, so another worker takes it over at once instead of waiting for the stale-lease sweep. If a
job still holds the process after the grace period, the process exits anyway and the sweeper (a
worker loss) covers what it held.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from typing import Any

from worker.settings import get_settings

logger = logging.getLogger(__name__)

_stopping = threading.Event()
_deadline: threading.Timer | None = None
_exits_at: float | None = None  # time.monotonic() at which the grace period ends


RELEASED = "the worker is stopping; the job is released to another worker"


class WorkerStoppingError(RuntimeError):
    """The worker is shutting down: stop at this segment boundary and release the job (costs nothing)."""

    def __init__(self, message: str = RELEASED) -> None:
        super().__init__(message)


def stopping() -> bool:
    return _stopping.is_set()


def grace_left() -> float | None:
    """Seconds until the grace period ends and the process exits (None: not stopping, or no deadline)."""
    return None if _exits_at is None else _exits_at - time.monotonic()


def check_stopping() -> None:
    if _stopping.is_set():
        raise WorkerStoppingError


def _grace_over(grace_seconds: float) -> None:
    logger.warning(
        "grace period of %.0fs is over with jobs still running; exiting (the sweeper requeues them)",
        grace_seconds,
    )
    logging.shutdown()
    os._exit(1)


def request_stop(grace_seconds: float) -> None:
    """Set the flag (running jobs release at their next check) and arm the grace-period deadline.
    Called from signal handlers, which Python runs on the main thread only: no lock, no logging."""
    global _deadline, _exits_at
    _stopping.set()
    if _deadline is None:
        _exits_at = time.monotonic() + grace_seconds
        _deadline = threading.Timer(grace_seconds, _grace_over, args=(grace_seconds,))
        _deadline.daemon = True
        _deadline.start()


def on_worker_shutdown(**_: Any) -> None:
    """Celery's ``worker_shutdown``: its pool has ended (every job finished or released), so the
    deadline has nothing left to bound. Left armed, it fired during the exit's own clean-up (the
    embedding follow-ups' drain) and turned a clean stop into exit 1, dropping what was still queued."""
    global _deadline, _exits_at
    if _deadline is not None:
        _deadline.cancel()
        _deadline = None
        _exits_at = None


# The prefork pool's children learn of the stop by this signal: Celery sends ``worker_shutting_down`` in
# the main process only, and a child's copy of the flag (forked before) never changed, so its job was
# cut off at the grace period's exit instead of released. SIGURG: ignored by default (a child forked
# after a loss, its handler not yet installed, is not killed by it), and none of billiard's: with its
# signal protection on it resets SIGUSR1/SIGUSR2 in children to an exit (a job cut off, not released).
CHILD_STOP_SIGNAL = signal.SIGURG
_pool: Any = None  # the worker's pool (Celery's ``worker_ready`` names its consumer)


def on_worker_shutting_down(**_: Any) -> None:
    """Celery's ``worker_shutting_down`` signal (SIGTERM, SIGINT, and SIGQUIT: see below), in the main
    process: the flag and the deadline here, and the prefork pool's children told (none on threads)."""
    request_stop(get_settings().grace_seconds)
    for pid in _child_pids():
        with contextlib.suppress(OSError):  # (one that exited meanwhile)
            os.kill(pid, CHILD_STOP_SIGNAL)


def _child_pids() -> list[int]:
    """The prefork pool's processes (its ``info``; the threads and solo pools have none)."""
    try:
        processes = (_pool.info or {}).get("processes", ()) if _pool is not None else ()
    except Exception:  # (a pool not started, or gone): nothing to tell
        return []
    return [pid for pid in processes if isinstance(pid, int) and pid != os.getpid()]


def listen_for_stop_in_child(**_: Any) -> None:
    """Celery's ``worker_process_init``, in each prefork child: its parent's stop reaches it."""
    grace = get_settings().grace_seconds
    signal.signal(CHILD_STOP_SIGNAL, lambda _signum, _frame: request_stop(grace))


def on_worker_ready(sender: Any = None, **_: Any) -> None:
    """Celery's ``worker_ready`` (its consumer the sender): the pool remembered, SIGQUIT taken as SIGTERM."""
    global _pool
    _pool = getattr(sender, "pool", None)
    quit_as_term()


def quit_as_term() -> None:
    """Celery's ``worker_ready``, its own signal handlers installed: SIGQUIT stops the worker as SIGTERM
    does. Celery's SIGQUIT (a cold shutdown) first asks the pool to kill the running tasks, which the
    threads pool (the workers' default) cannot do: it raised before ``worker_shutting_down`` was sent,
    so no job was handed back, no grace period was armed, and the worker waited for its jobs however
    long they took (the jobs stayed running until the sweeper). Here a job is handed back at its next
    check, and the grace period bounds the stop, the same on every pool."""
    if threading.current_thread() is not threading.main_thread():  # signal handlers: the main thread's
        logger.warning("worker_ready came on another thread; SIGQUIT keeps Celery's cold shutdown")
        return
    signal.signal(signal.SIGQUIT, signal.getsignal(signal.SIGTERM))


__all__ = [
    "WorkerStoppingError",
    "check_stopping",
    "grace_left",
    "listen_for_stop_in_child",
    "on_worker_ready",
    "on_worker_shutdown",
    "on_worker_shutting_down",
    "quit_as_term",
    "request_stop",
    "stopping",
]
