"""A deadline for the LLM calls made in a block: a request's own calls end with it (see ``call_deadline``)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

# When the calls made inside ``call_deadline`` must have ended (time.monotonic), or None.
DEADLINE: ContextVar[float | None] = ContextVar("factmill_llm_deadline", default=None)


@contextmanager
def call_deadline(seconds: float) -> Iterator[None]:
    """The calls made inside (in this thread or task) end within ``seconds``: each try's timeouts are
    cut to the time left, a retry's wait ends with it, and no try starts after it (CallDeadlineError,
    in worker.llm.between_tries). A request's own calls (a search's expansion and embeddings) took up
    to five tries of a minute each and two minutes of backoff, long after its client had given up."""
    at = time.monotonic() + seconds
    outer = DEADLINE.get()
    token = DEADLINE.set(at if outer is None else min(at, outer))
    try:
        yield
    finally:
        DEADLINE.reset(token)


def time_left() -> float | None:
    """Seconds left before the calls' deadline (0 when past it); None without one."""
    at = DEADLINE.get()
    return None if at is None else max(0.0, at - time.monotonic())
