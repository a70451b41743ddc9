"""A thread's sign of life: a job's heartbeat listens for one, and a long wait that is no stall gives one.

The threads pool enforces no time limit, so a job's heartbeat stops renewing the lease of a run that
shows no progress for long (worker.jobs.leases.Heartbeat). A run that waits its turn (a page whose LLM
calls wait for slots other pages hold) is not stalled: its waits call ``mark``, which reaches the
heartbeat listening on that thread, if any.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

_local = threading.local()


def listen(callback: Callable[[], None] | None) -> None:
    """Call ``callback`` on each ``mark`` made on this thread (None: stop)."""
    _local.callback = callback


def mark() -> None:
    """This thread is waiting, not stalled."""
    callback = getattr(_local, "callback", None)
    if callback is not None:
        callback()
