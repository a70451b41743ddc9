"""The worker process's one LLM pipe: a fixed number of calls in flight, fed by every page it works on.

Why a shared bounded pool of threads, not an asyncio loop or a Celery pool: the gateway's layers (the
retry policy, the Redis rate limiter, the budget check, the ledger's listener) and both providers are
synchronous and shared with the API and the CLI; an asyncio pipe would need a second, async copy of
each, and it would not make a call cheaper: 64 asyncio tasks on one ``AsyncOpenAI`` client spent
1.03-1.20x the client CPU a call of 64 threads on one sync client (``bench/gateway.py`` part 3). A
thread blocked in a socket read holds no GIL and costs its stack only (measured in BENCHMARKS.md),
and one pool for the process gives what the per-page windows could not: a page that
has segments left takes any slot another page left free, so the pipe stays full while any page has
work. Celery's own pools bound tasks (pages), not calls.

``LLMPipe.open`` gives a page a ``Feed``: the pipe's threads run the page's calls (oldest page first,
so pages finish and free their job slot instead of moving in lockstep) and the page's own thread takes
the results back in page order, as many consecutive ones as are ready, so it can commit them together.
``FollowUps`` runs work that may lag a little (embedding a page's new facts) on a few threads of its
own, one pending run per key, so it never holds a job slot or a pipe slot.
"""

from __future__ import annotations

import atexit
import contextvars
import logging
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

from worker.core import progress
from worker.core.errors import unsorted_error_note

logger = logging.getLogger(__name__)


T = TypeVar("T")

# After the system refuses the pipe a thread, how long it goes on with those it has before asking again.
REFUSED_THREAD_PAUSE_SECONDS = 10.0


class WaitOverError(Exception):
    """A page stopped waiting for its next result (``Feed.take``'s patience ran out)."""


@dataclass(frozen=True)
class Outcome(Generic[T]):
    """What one call gave: its value, or the exception it raised (re-raised to the page, in order)."""

    index: int
    value: T | None = None
    error: BaseException | None = None

    def result(self) -> T:
        if self.error is not None:
            raise self.error
        return self.value  # type: ignore[return-value]


class Feed(Generic[T]):
    """One page's calls on the pipe: started in index order, taken back in index order.

    At most ``window`` calls are started and not yet handed over. The window frees only when the page
    asks for more (``take``) after handling what it got, so with ``window=1`` a page is strictly
    sequential: no call starts before the previous result was committed or refused.
    """

    def __init__(self, pipe: LLMPipe, count: int, call: Callable[[int], T], window: int) -> None:
        self._pipe = pipe
        self.count = count
        self._call = call
        self.window = max(1, window)
        self._ready = threading.Condition(pipe.lock)
        self._done: dict[int, Outcome[T]] = {}
        self.started = 0  # calls handed to the pipe's threads (index of the next one)
        self.in_flight = 0
        self._handed = 0  # results handed to the page
        self._acked = 0  # results the page is done with (it asked for more since)
        self.closed = False

    # Called by the pipe's threads, under the pipe's lock.
    def startable(self) -> bool:
        return not self.closed and self.started < self.count and self.started - self._acked < self.window

    def _start(self) -> int:
        index = self.started
        self.started += 1
        self.in_flight += 1
        return index

    def _finish(self, outcome: Outcome[T]) -> None:
        self.in_flight -= 1
        self._done[outcome.index] = outcome
        if outcome.index == self._handed or self.closed:
            self._ready.notify()

    # Called by the page's thread.
    def finished(self) -> bool:
        return self._handed >= self.count

    def take(
        self, limit: int | None = None, patience: Callable[[], float | None] | None = None
    ) -> list[Outcome[T]]:
        """The next results in page order (at least one; waits for it), as many as are ready up to
        ``limit``; taking also frees the window of what the previous ``take`` returned. ``patience``
        says how many seconds more the page may wait (None: no limit); past it, WaitOverError."""
        with self._pipe.lock:
            if self._acked < self._handed:
                self._pipe.wake(self._handed - self._acked)
                self._acked = self._handed
            if self.finished():
                return []
            marked = time.monotonic()
            while self._handed not in self._done:
                left = patience() if patience is not None else None
                if left is not None and left <= 0:
                    raise WaitOverError(f"result {self._handed} of the page did not come in time")
                # With patience, looked at every second: a stop's short grace (10 s) began while the page
                # waited a whole MARK_EVERY_SECONDS, and it woke past the exit.
                every = progress.MARK_EVERY_SECONDS
                self._ready.wait(
                    timeout=every if patience is None else min(1.0, left if left is not None else 1.0)
                )
                # Waiting for a slot other pages hold is no stall: say so now and then. Not once the
                # call is running (it has the provider's timeouts; one that hangs in the database is
                # the stall the job's heartbeat looks for).
                if time.monotonic() - marked >= every and self._handed not in self._done:
                    marked = time.monotonic()
                    if self.started <= self._handed:
                        progress.mark()
            taken: list[Outcome[T]] = []
            while self._handed in self._done and (limit is None or len(taken) < limit):
                taken.append(self._done.pop(self._handed))
                self._handed += 1
            return taken

    def close(
        self, timeout: float | None = None, patience: Callable[[], float | None] | None = None
    ) -> list[Outcome[T]]:
        """Start nothing more, wait for the calls in flight (``timeout``: at most that long; ``patience``:
        as long as it says, read again every second, as ``take`` reads it), and return every result not
        handed over (they were paid for: the page records them)."""
        with self._pipe.lock:
            self.closed = True
            self._pipe.drop(self)
            deadline = None if timeout is None else time.monotonic() + timeout
            while self.in_flight:
                left_seconds = None if deadline is None else deadline - time.monotonic()
                if patience is not None and (patient := patience()) is not None:
                    # A stop that began during the wait: read it then, not once before (waited past the
                    # grace period, the process exited with the page's verdict unsettled).
                    left_seconds = patient if left_seconds is None else min(left_seconds, patient)
                if left_seconds is not None and left_seconds <= 0:
                    break
                self._ready.wait(left_seconds if patience is None else min(1.0, left_seconds or 1.0))
            left = [self._done[i] for i in sorted(self._done)]
            self._done.clear()
            return left


class LLMPipe:
    """``width`` threads, each running one call at a time for whichever open feed may start one."""

    def __init__(self, width: int, *, name: str = "llm-pipe") -> None:
        if width < 1:
            raise ValueError(f"the LLM pipe needs at least one slot, got {width}")
        self.width = width
        self.name = name
        self.lock = threading.Lock()
        self._work = threading.Condition(self.lock)
        self._feeds: list[Feed[object]] = []  # oldest first
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._closing = False
        self._refused_until = 0.0  # the system refused a thread: no other is asked for until then

    def open(self, count: int, call: Callable[[int], T], *, window: int | None = None) -> Feed[T]:
        """A feed of ``count`` calls (``call(index)``); ``window`` caps its calls started and not yet
        handed back (default: twice the pipe, so a lone page keeps every slot busy while it commits)."""
        # Each call runs in a copy of the opener's context (its trace: the job's span is the parent).
        opener = contextvars.copy_context()

        def in_context(index: int) -> T:
            return opener.copy().run(call, index)

        feed: Feed[T] = Feed(self, count, in_context, window or 2 * self.width)
        with self.lock:
            if self._closing:
                raise RuntimeError("the LLM pipe is closed")
            self._feeds.append(feed)  # type: ignore[arg-type]
            try:
                self._grow(self._demand())
            except BaseException:
                # No thread to run it: left open, the page's calls ran later for no one (unrecorded,
                # paid again by the job's retry).
                self._feeds.remove(feed)  # type: ignore[arg-type]
                raise
            self._work.notify(min(count, feed.window))
        return feed

    def in_flight(self) -> int:
        with self.lock:
            return sum(feed.in_flight for feed in self._feeds)

    def wake(self, slots: int) -> None:
        """Under the lock: ``slots`` more calls may start (a feed's window moved)."""
        self._grow(self._demand())
        self._work.notify(slots)

    def _demand(self) -> int:
        """Under the lock: how many calls the open feeds could start now. Threads are counted against
        all of it, not one feed's: an idle thread just started for one feed is not free for the next."""
        return sum(
            min(f.count - f.started, f.window - (f.started - f._acked)) for f in self._feeds if not f.closed
        )

    def drop(self, feed: Feed[T]) -> None:
        """Under the lock: the feed starts nothing more."""
        if feed in self._feeds:
            self._feeds.remove(feed)  # type: ignore[arg-type]

    def close(self) -> None:
        """Stop the threads once the calls in flight are done (open feeds start nothing more)."""
        with self.lock:
            self._closing = True
            self._work.notify_all()
            threads = list(self._threads)
        for thread in threads:
            thread.join(timeout=60)

    def _grow(self, wanted: int) -> None:
        """Under the lock: start threads (up to the width) so ``wanted`` calls can run at once.

        A thread the system refuses (``can't start new thread``: a container's process limit) is not
        counted: counted, each refusal took a slot for good and, once all had been refused, no thread ran
        and every page waited for its first result forever (its lease kept fresh by the wait). With
        threads running, the pipe goes on narrower (and tries again a while later); with none, the
        refusal is raised to the page that needed one."""
        if time.monotonic() < self._refused_until:
            if self._threads:
                return
            self._refused_until = 0.0
        while len(self._threads) < self.width and self._idle < wanted:
            thread = threading.Thread(
                target=self._serve, name=f"{self.name}-{len(self._threads)}", daemon=True
            )
            try:
                thread.start()
            except RuntimeError as exc:
                if not self._threads:
                    raise
                self._refused_until = time.monotonic() + REFUSED_THREAD_PAUSE_SECONDS
                logger.warning(
                    "the LLM pipe runs %d of its %d slots: the system refused another thread (%s)",
                    len(self._threads),
                    self.width,
                    exc,
                )
                return
            self._threads.append(thread)  # (it waits for the lock this holds before taking work)
            self._idle += 1

    def _pick(self) -> Feed[object] | None:
        """Under the lock: the oldest feed that may start a call and holds less than its share, else
        the oldest that may start one at all (a lone large page takes the whole pipe)."""
        fallback = None
        # A feed's share: half the threads running (fewer than the width when the system refused some:
        # half the width, a page on a narrowed pipe never reached its share and took every slot).
        share = max(1, len(self._threads) // 2)
        for feed in self._feeds:
            if feed.startable():
                if feed.in_flight < share:
                    return feed
                if fallback is None:
                    fallback = feed
        return fallback

    def _serve(self) -> None:
        with self.lock:
            while True:
                feed = self._pick()
                if feed is None:
                    if self._closing:
                        self._idle -= 1
                        return
                    self._work.wait()
                    continue
                self._idle -= 1
                index = feed._start()
                self.lock.release()
                try:
                    try:
                        outcome: Outcome[object] = Outcome(index, value=feed._call(index))
                    except BaseException as exc:  # handed to the page, which raises it in order
                        outcome = Outcome(index, error=exc)
                finally:
                    self.lock.acquire()
                self._idle += 1
                feed._finish(outcome)


class FollowUps:
    """Background work on items (pages), batched per kind of work (``key``): a run takes up to
    ``batch`` pending items of one key, so one embedding call can cover several pages. An item
    submitted again while pending is not queued twice; one submitted while a run has it is taken by a
    later run (its new facts may have committed after the run read its rows), never by two at once.
    Exceptions are logged, never raised."""

    def __init__(
        self, threads: int = 2, *, batch: int = 16, name: str = "follow-up", drain_seconds: float = 10.0
    ) -> None:
        self._cond = threading.Condition()
        self._pending: dict[Hashable, dict[Hashable, None]] = {}  # key -> items, in submission order
        self._work: dict[Hashable, Callable[[list[Hashable]], object]] = {}
        self._running: set[tuple[Hashable, Hashable]] = set()
        # Each item's submitter's context (its job's bound log fields, its trace): a run of one item goes
        # on in it, so its lines name the job and its calls join the job's trace. A run of several (one
        # embedding call for several pages, each its own job's) is no one job's: it runs in none.
        self._contexts: dict[tuple[Hashable, Hashable], contextvars.Context] = {}
        self._batch = max(1, batch)
        self._closing = False
        self._drain_seconds = drain_seconds
        self._threads = [
            threading.Thread(target=self._serve, name=f"{name}-{n}", daemon=True) for n in range(threads)
        ]
        for thread in self._threads:
            thread.start()
        atexit.register(self.close)

    def submit(self, key: Hashable, item: Hashable, work: Callable[[list[Hashable]], object]) -> None:
        """Run ``work`` on ``item`` (with other pending items of ``key``) soon."""
        with self._cond:
            self._work[key] = work
            self._pending.setdefault(key, {})[item] = None
            self._contexts[(key, item)] = contextvars.copy_context()
            self._cond.notify()

    def pending(self) -> int:
        with self._cond:
            return sum(len(items) for items in self._pending.values()) + len(self._running)

    def close(self) -> None:
        """Let what is queued finish (up to ``drain_seconds``), then stop the threads."""
        atexit.unregister(self.close)
        deadline = time.monotonic() + self._drain_seconds
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            while (self._pending or self._running) and time.monotonic() < deadline:
                self._cond.wait(timeout=max(0.0, deadline - time.monotonic()))
            self._pending.clear()
            self._contexts.clear()
            self._cond.notify_all()
        for thread in self._threads:
            thread.join(timeout=1)

    def _take(self) -> tuple[Hashable, list[Hashable]] | None:
        """Under the lock: a key and up to ``batch`` of its pending items that no run has now."""
        for key, items in self._pending.items():
            taken = [item for item in items if (key, item) not in self._running][: self._batch]
            if taken:
                for item in taken:
                    del items[item]
                    self._running.add((key, item))
                if not items:
                    del self._pending[key]
                return key, taken
        return None

    def _serve(self) -> None:
        with self._cond:
            while True:
                chosen = self._take()
                if chosen is None:
                    if self._closing and not self._pending:
                        return
                    self._cond.wait()
                    continue
                key, items = chosen
                work = self._work[key]
                contexts = [self._contexts.pop((key, item), None) for item in items]
                self._cond.release()
                try:
                    context = contexts[0] if len(contexts) == 1 else None
                    if context is None:
                        work(items)
                    else:
                        context.run(work, items)
                except Exception as exc:  # its message may quote a page: at DEBUG, with the traceback
                    logger.error("background work failed: %s", unsorted_error_note(exc, f"follow-up {key}"))
                    logger.debug("the background work's error: %s", exc, exc_info=exc)
                finally:
                    self._cond.acquire()
                self._running.difference_update((key, item) for item in items)
                self._cond.notify_all()
