"""TtlCache: values kept for ttl seconds, and one load per key however many threads ask at once."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from tests.clock import FakeClock
from worker.core.ttl_cache import TtlCache


class Loads:
    """A loader that counts its calls, answers ``<key>:<n>``, and can be held until released."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.started = threading.Event()
        self.release = threading.Event()
        self.release.set()
        self.failing: set[int] = set()  # the calls (1-based) that raise

    def __call__(self, key: str) -> str:
        self.calls.append(key)
        number = len(self.calls)
        self.started.set()
        assert self.release.wait(10)
        if number in self.failing:
            raise RuntimeError("database down")
        return f"{key}:{number}"

    def hold(self) -> None:
        self.started.clear()
        self.release.clear()


def in_threads(count: int, work: Callable[[], str]) -> tuple[list[threading.Thread], list[str]]:
    results: list[str] = []
    threads = [threading.Thread(target=lambda: results.append(work())) for _ in range(count)]
    for thread in threads:
        thread.start()
    return threads, results


def refresh_held(cache: TtlCache[str, str], loads: Loads) -> list[threading.Thread]:
    """A thread whose load of "a" is held (until ``loads.release``) once it has begun."""
    loads.hold()
    thread, _ = in_threads(1, lambda: cache.get("a"))
    assert loads.started.wait(10)
    return thread


def wait_for_calls(loads: Loads, count: int) -> None:
    """Until ``count`` loads began (or 10 s passed), then a moment more: no further one begins."""
    for _ in range(1000):
        if len(loads.calls) >= count:
            break
        threading.Event().wait(0.01)
    threading.Event().wait(0.1)


def test_a_value_is_served_for_ttl_seconds_then_loaded_again() -> None:
    clock, loads = FakeClock(), Loads()
    cache: TtlCache[str, str] = TtlCache(loads, ttl=2.0, clock=clock)
    assert cache.get("a") == "a:1"
    clock.now += 1.9
    assert cache.get("a") == "a:1"
    assert cache.get("b") == "b:2"
    clock.now += 0.2
    assert cache.get("a") == "a:3"
    assert loads.calls == ["a", "b", "a"]


def test_ttl_zero_loads_on_every_get() -> None:
    loads = Loads()
    cache: TtlCache[str, str] = TtlCache(loads, ttl=0, clock=FakeClock())
    assert [cache.get("a"), cache.get("a")] == ["a:1", "a:2"]


def test_load_reads_now_and_keeps_what_it_read() -> None:
    clock, loads = FakeClock(), Loads()
    cache: TtlCache[str, str] = TtlCache(loads, ttl=5.0, clock=clock)
    assert cache.get("a") == "a:1"
    assert cache.load("a") == "a:2"
    assert cache.get("a") == "a:2"
    assert cache.last("a") == "a:2" and cache.last("b") is None
    cache.invalidate()
    assert cache.get("a") == "a:3"


def test_threads_that_find_a_key_expired_together_cost_one_load_and_take_the_old_value_meanwhile() -> None:
    clock, loads = FakeClock(), Loads()
    cache: TtlCache[str, str] = TtlCache(loads, ttl=2.0, clock=clock)
    assert cache.get("a") == "a:1"
    clock.now += 3
    loads.hold()
    refresher, fresh = in_threads(1, lambda: cache.get("a"))
    assert loads.started.wait(10)
    # While the refresh runs, every other reader is answered at once with the value it replaces.
    readers, old = in_threads(16, lambda: cache.get("a"))
    for thread in readers:
        thread.join(10)
    assert old == ["a:1"] * 16
    loads.release.set()
    refresher[0].join(10)
    assert fresh == ["a:2"] and cache.get("a") == "a:2"
    assert loads.calls == ["a", "a"]


def test_a_value_is_not_served_while_its_refresh_hangs_and_no_herd_loads_it() -> None:
    """While a refresh hung (a pool exhausted, a query stuck), every reader was told the old value for
    as long as it hung: a kill switch turned off went unseen. A refresh running past a ttl is taken for
    hung: one more load runs, and the other readers wait for one to end (not a load each: a herd)."""
    clock, loads = FakeClock(), Loads()
    cache: TtlCache[str, str] = TtlCache(loads, ttl=2.0, clock=clock)
    assert cache.get("a") == "a:1"
    clock.now += 3  # the value is stale, but under two ttl, and its refresh has only just begun
    refresher = refresh_held(cache, loads)
    readers, old = in_threads(16, lambda: cache.get("a"))
    for thread in readers:
        thread.join(10)
    assert old == ["a:1"] * 16 and len(loads.calls) == 2  # served at once, no herd
    clock.now += 3  # the refresh has run past a ttl: hung
    waiting, fresh = in_threads(16, lambda: cache.get("a"))
    wait_for_calls(loads, 3)
    assert len(loads.calls) == 3 and fresh == []  # one more load; the others wait for one
    loads.release.set()
    for thread in (*refresher, *waiting):
        thread.join(10)
    assert len(fresh) == 16 and "a:1" not in fresh and len(loads.calls) == 3


def test_a_value_older_than_two_ttl_is_not_served_while_it_is_refreshed() -> None:
    """A key nobody read for an hour: its value was served, an hour old, to every reader while its
    refresh ran; a kill switch turned off in that hour let a burst of jobs through."""
    clock, loads = FakeClock(), Loads()
    cache: TtlCache[str, str] = TtlCache(loads, ttl=2.0, clock=clock)
    assert cache.get("a") == "a:1"
    clock.now += 3600
    refresher = refresh_held(cache, loads)
    readers, seen = in_threads(16, lambda: cache.get("a"))
    threading.Event().wait(0.1)
    assert seen == [] and len(loads.calls) == 2  # waiting for the refresh, not loading a herd
    loads.release.set()
    for thread in (*refresher, *readers):
        thread.join(10)
    assert seen == ["a:2"] * 16 and len(loads.calls) == 2


def test_readers_waiting_on_an_old_value_start_the_one_more_load_when_its_refresh_hangs() -> None:
    """They waited for the refresh without a time limit: hung, it held them all for as long as it hung,
    and the one more load a hung refresh gets began only if another reader came."""
    import time

    loads = Loads()
    cache: TtlCache[str, str] = TtlCache(loads, ttl=0.2)  # the real clock: the wait is the readers' own
    assert cache.get("a") == "a:1"
    time.sleep(0.5)  # older than two ttl: not served while refreshed
    refresher = refresh_held(cache, loads)
    readers, seen = in_threads(4, lambda: cache.get("a"))
    wait_for_calls(loads, 3)
    assert len(loads.calls) == 3 and seen == []  # one more load, begun by a reader already waiting
    loads.release.set()
    for thread in (*refresher, *readers):
        thread.join(10)
    assert len(seen) == 4 and "a:1" not in seen and len(loads.calls) == 3


def test_readers_of_a_first_value_start_the_one_more_load_when_it_hangs() -> None:
    """No value yet (a first read, or after invalidate): they waited for a hung first load for as long
    as it hung, and no second load began."""

    loads = Loads()
    cache: TtlCache[str, str] = TtlCache(loads, ttl=0.2)
    first = refresh_held(cache, loads)  # the first load, held
    readers, seen = in_threads(4, lambda: cache.get("a"))
    wait_for_calls(loads, 2)
    assert len(loads.calls) == 2 and seen == []  # one more load, no herd
    loads.release.set()
    for thread in (*first, *readers):
        thread.join(10)
    assert len(seen) == 4 and len(loads.calls) == 2


def test_threads_asking_for_a_first_value_wait_for_the_one_load() -> None:
    loads = Loads()
    loads.hold()
    cache: TtlCache[str, str] = TtlCache(loads, ttl=2.0, clock=FakeClock())
    threads, results = in_threads(16, lambda: cache.get("a"))
    assert loads.started.wait(10)
    loads.release.set()
    for thread in threads:
        thread.join(10)
    assert results == ["a:1"] * 16
    assert loads.calls == ["a"]


def test_a_failed_load_raises_where_it_ran_and_a_waiting_thread_loads_again() -> None:
    loads = Loads()
    loads.hold()
    loads.failing = {1}
    cache: TtlCache[str, str] = TtlCache(loads, ttl=2.0, clock=FakeClock())
    errors: list[BaseException] = []

    def first() -> None:
        try:
            cache.get("a")
        except RuntimeError as exc:
            errors.append(exc)

    failing = threading.Thread(target=first)
    failing.start()
    assert loads.started.wait(10)
    waiter, results = in_threads(1, lambda: cache.get("a"))
    loads.release.set()
    failing.join(10)
    waiter[0].join(10)
    assert [str(e) for e in errors] == ["database down"]
    assert results == ["a:2"]
    assert loads.calls == ["a", "a"]


def test_a_failed_load_keeps_no_value() -> None:
    loads = Loads()
    loads.failing = {1}
    cache: TtlCache[str, str] = TtlCache(loads, ttl=2.0, clock=FakeClock())
    with pytest.raises(RuntimeError):
        cache.get("a")
    assert cache.last("a") is None
