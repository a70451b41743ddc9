"""A deadline for the LLM calls made in a block: a request's own calls end with it (see ``call_deadline``)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass


@dataclass
class _Clock:
    seconds: float
    outer: _Clock | None
    at: float | None = None  # started by the first call made inside (time.monotonic)

    def left(self) -> float:
        if self.at is None:
            self.at = time.monotonic() + self.seconds
        own = max(0.0, self.at - time.monotonic())
        return own if self.outer is None else min(own, self.outer.left())


# The deadline of the calls made inside ``call_deadline``, or None.
DEADLINE: ContextVar[_Clock | None] = ContextVar("factmill_llm_deadline", default=None)


@contextmanager
def call_deadline(seconds: float) -> Iterator[None]:
    """The calls made inside (in this thread or task) end within ``seconds`` of the first of them
    (what the block does before, a search's database reads, is not their time): each try's timeouts
    are cut to the time left, a retry's wait ends with it, and no try starts after it
    (CallDeadlineError, in worker.llm.between_tries). A request's own calls (a search's expansion and
    embeddings) took up to five tries of a minute each and two minutes of backoff, long after its
    client had given up."""
    token = DEADLINE.set(_Clock(seconds, DEADLINE.get()))
    try:
        yield
    finally:
        DEADLINE.reset(token)


def time_left() -> float | None:
    """Seconds left before the calls' deadline (0 when past it); None without one. The first ask
    inside ``call_deadline`` starts its clock."""
    clock = DEADLINE.get()
    return None if clock is None else clock.left()
