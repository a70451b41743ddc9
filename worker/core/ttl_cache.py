"""A read-through cache whose entries expire after a few seconds, loaded once per key at a time."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


@dataclass
class _Entry(Generic[V]):
    value: V
    loaded_at: float


class TtlCache(Generic[K, V]):
    """Values ``load(key)`` gave, served for ``ttl`` seconds; thread-safe, and one load per key at a time.

    A worker reads its switches, budgets and threshold from many threads at once. When a key expires,
    the first thread to ask loads it; the others take the value it had meanwhile while that is under two
    ``ttl`` old (or else wait for that load) instead of each running the same query on a connection of
    its own: a value served is never older than two ``ttl``.
    A load (a refresh, or a first one) that has run for longer than ``ttl`` is taken for hung: one more
    load starts, and the readers wait for one to end rather than be told the old value, or wait on it,
    for as long as it hangs.
    ``ttl`` 0 keeps nothing: every ``get`` loads. A load that raises raises in the thread that ran
    it; threads waiting for a first value then try again themselves.
    """

    def __init__(
        self, load: Callable[[K], V], ttl: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._load = load
        self._ttl = ttl
        self._clock = clock
        self._lock = threading.Lock()
        self._loaded = threading.Condition(self._lock)
        self._entries: dict[K, _Entry[V]] = {}
        self._loading: dict[K, int] = {}  # loads running per key
        self._load_began: dict[K, list[float]] = {}  # when each load running began, per key

    def get(self, key: K) -> V:
        """The key's value, loaded if it is missing or older than ``ttl``."""
        if self._ttl <= 0:
            return self.load(key)
        with self._lock:
            while True:
                entry = self._entries.get(key)
                if entry is not None and self._clock() - entry.loaded_at < self._ttl:
                    return entry.value
                if not self._loading.get(key):
                    break
                now = self._clock()
                loading_for = now - min(self._load_began[key])
                if loading_for < self._ttl:
                    # Another thread is loading it: an old value is served if under two ttl old. A
                    # value read an hour before (a quiet key) was served as the truth while its
                    # refresh ran: a kill switch turned off since let every job of a burst through.
                    if entry is not None and now - entry.loaded_at < 2 * self._ttl:
                        return entry.value
                    self._loaded.wait(self._ttl - loading_for)  # then that load counts as hung
                    continue
                if self._loading[key] < 2:
                    # That load hangs (a pool exhausted, a query stuck): no value is served on its word
                    # for as long as it hangs (a kill switch turned off went unseen), and no reader
                    # waits on it; one more load runs here, and every other reader waits for one to end.
                    break
                self._loaded.wait()
            began = self._start(key)
        return self._run_load(key, began)

    def load(self, key: K) -> V:
        """Load the key now, whatever the cache holds, and keep what it gives."""
        with self._lock:
            began = self._start(key)
        return self._run_load(key, began)

    def last(self, key: K) -> V | None:
        """The value held for the key, however old (None if there is none)."""
        with self._lock:
            entry = self._entries.get(key)
            return None if entry is None else entry.value

    def invalidate(self) -> None:
        """Forget every value: the next ``get`` of each key loads it."""
        with self._lock:
            self._entries.clear()

    def _start(self, key: K) -> float:
        """Under the lock: a load of ``key`` begins; when it began."""
        began = self._clock()
        self._load_began.setdefault(key, []).append(began)
        self._loading[key] = self._loading.get(key, 0) + 1
        return began

    def _run_load(self, key: K, started: float) -> V:
        try:
            value = self._load(key)
        except BaseException:
            with self._lock:
                self._done(key, started)
            raise
        with self._lock:
            held = self._entries.get(key)
            if held is None or held.loaded_at <= started:  # a load begun later may have ended first
                self._entries[key] = _Entry(value, started)
            self._done(key, started)
        return value

    def _done(self, key: K, began: float) -> None:
        """Under the lock: the load of ``key`` that began at ``began`` ended; wake the threads waiting."""
        self._load_began[key].remove(began)
        if self._loading[key] > 1:
            self._loading[key] -= 1
        else:
            del self._loading[key]
            del self._load_began[key]
        self._loaded.notify_all()
