"""A run's sign of life: a job's heartbeat listens for one, and a long wait that is no stall gives one.

The threads pool enforces no time limit, so a job's heartbeat stops renewing the lease of a run that
shows no progress for long (worker.jobs.leases.Heartbeat). A run that waits its turn (a page whose LLM
calls wait for slots other pages hold, a call waiting for its place under the rate limit) is not
stalled: its waits call ``mark``, which reaches the heartbeat listening in that context, if any.

The listener is a context variable, not a thread's: the LLM pipe runs a page's calls on its own
threads in a copy of the job's context, so a call waiting for its rate-limit turn there (hours, at a
tight limit behind a long queue) reaches its job's heartbeat too; a thread's listener left it to lapse.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from typing import Final

# How often a long wait says it is a wait (well inside any stall limit: FACTMILL_TASK_TIME_LIMIT_SECONDS).
MARK_EVERY_SECONDS: Final = 10.0

_listener: ContextVar[Callable[[], None] | None] = ContextVar("factmill_progress_listener", default=None)


def listen(callback: Callable[[], None] | None) -> None:
    """Call ``callback`` on each ``mark`` made in this context and the copies made of it after this
    (None: stop)."""
    _listener.set(callback)


def mark() -> None:
    """This run is waiting, not stalled."""
    callback = _listener.get()
    if callback is not None:
        callback()
