"""How much page text a worker process holds parsed at once: a page waits its turn rather than be read
while the pages already held fill the process's memory."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

logger = logging.getLogger(__name__)

MIB = 1024 * 1024
# A waiting page checks its job (the kill switch, a lost lease, a stopping worker) this often.
CHECK_EVERY_SECONDS = 1.0


class PageMemory:
    """The body bytes of the pages this process's jobs hold parsed at once
    (FACTMILL_EXTRACTION_PAGE_BYTES_HELD).

    A page is held parsed for its whole run (its messages, about 4.5 times its body: bench/parse_segment.py
    traced 112 MiB for a 25 MiB page), and a worker runs up to --concurrency pages: 64 pages of a few MiB
    each passed a 1 GiB pod's limit, and every job on it lost its run to the OOM kill, again on the next
    pod. Pages wait in arrival order (a large one is not passed over by small ones for ever); one larger
    than the whole budget waits for all of it. 0: no limit.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._held = 0
        self._turns: deque[object] = deque()
        self._changed = threading.Condition()

    @property
    def held(self) -> int:
        with self._changed:
            return self._held

    @property
    def waiting(self) -> int:
        """Pages waiting for their turn."""
        with self._changed:
            return len(self._turns)

    @contextmanager
    def holding(self, size: int, check: Callable[[], None] | None = None) -> Iterator[None]:
        """Hold ``size`` bytes of the budget while the block runs, waiting for them first; ``check`` is
        called every CHECK_EVERY_SECONDS meanwhile (what it raises ends the wait)."""
        if self.capacity <= 0:
            yield
            return
        need = max(1, min(size, self.capacity))
        self._wait_for(need, check)
        try:
            yield
        finally:
            with self._changed:
                self._held -= need
                self._changed.notify_all()

    def _wait_for(self, need: int, check: Callable[[], None] | None) -> None:
        turn, began, waits, said = object(), time.monotonic(), 0, False
        with self._changed:
            self._turns.append(turn)
        try:
            while True:
                state = None
                with self._changed:
                    if self._turns[0] is turn and self._held + need <= self.capacity:
                        self._turns.popleft()
                        self._held += need
                        self._changed.notify_all()  # the next in line may fit too
                        break
                    # Said once it has truly waited (a burst's pages pass each other's first looks).
                    if waits and not said:
                        state, said = (self._held, self._turns.index(turn)), True
                    self._changed.wait(CHECK_EVERY_SECONDS)
                    waits += 1
                if state is not None:  # (a waiting job looks like any running one: the log says why)
                    logger.info(
                        "a page of %.1f MiB waits for page memory: %.1f of %.1f MiB held, %s page(s) "
                        "ahead of it (FACTMILL_EXTRACTION_PAGE_BYTES_HELD)",
                        need / MIB,
                        state[0] / MIB,
                        self.capacity / MIB,
                        state[1],
                    )
                if check is not None:
                    check()  # (outside the lock: it may read the database)
        except BaseException:
            with self._changed:
                if turn in self._turns:
                    self._turns.remove(turn)
                self._changed.notify_all()
            raise
        if said:
            logger.info("a page waited %.1f s for page memory", time.monotonic() - began)


__all__ = ["CHECK_EVERY_SECONDS", "PageMemory"]
