"""The page text a worker process holds parsed at once: pages wait their turn, in order."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from worker.runtime.page_memory import PageMemory


def wait_until(condition: Callable[[], bool]) -> None:
    for _ in range(1000):
        if condition():
            return
        threading.Event().wait(0.01)
    raise AssertionError("the condition never held")


def hold_in_thread(
    memory: PageMemory, size: int, order: list[int], release: threading.Event
) -> threading.Thread:
    def run() -> None:
        with memory.holding(size):
            order.append(size)
            release.wait(10)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_page_waits_while_those_held_fill_the_budget_and_goes_in_order() -> None:
    memory, order, release = PageMemory(100), [], threading.Event()
    with memory.holding(60):
        big = hold_in_thread(memory, 70, order, release)
        wait_until(lambda: memory.waiting == 1)
        small = hold_in_thread(memory, 10, order, release)  # would fit now, but comes after the big one
        wait_until(lambda: memory.waiting == 2)
        threading.Event().wait(0.05)
        assert order == [] and memory.held == 60
    wait_until(lambda: len(order) == 2)
    assert order == [70, 10] and memory.held == 80  # in turn; 70 + 10 fit together
    release.set()
    for thread in (big, small):
        thread.join(10)
    assert memory.held == 0 and memory.waiting == 0


def test_a_page_larger_than_the_budget_waits_for_all_of_it(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="worker.runtime.page_memory")
    memory, order, release = PageMemory(100), [], threading.Event()
    waits = lambda: [r.getMessage() for r in caplog.records]  # noqa: E731
    with memory.holding(1):
        with memory.holding(1):
            huge = hold_in_thread(memory, 25 * 1024 * 1024, order, release)
            wait_until(lambda: memory.waiting == 1)
            assert order == [] and waits() == []  # not said on a first look: it may be let in at once
        # Woken (2 bytes became 1), it looks again and still waits: now the log says why (a waiting job
        # looks like any running one).
        wait_until(lambda: len(waits()) == 1)
        assert "waits for page memory" in waits()[0] and "0 page(s) ahead" in waits()[0]
        assert order == []
    wait_until(lambda: order == [25 * 1024 * 1024])
    assert memory.held == 100  # the whole budget, not more
    release.set()
    huge.join(10)
    assert memory.held == 0
    assert len(waits()) == 2 and waits()[1].startswith("a page waited")


def test_a_wait_its_check_ends_gives_its_turn_to_the_next() -> None:
    """A job whose worker is stopping (or whose lease went) stops waiting, and holds no one up."""
    memory, order, release = PageMemory(100), [], threading.Event()
    stopping = threading.Event()
    failures: list[BaseException] = []

    def check() -> None:
        if stopping.is_set():
            raise RuntimeError("the worker is stopping")

    def wait_and_stop() -> None:
        try:
            with memory.holding(90, check):
                order.append(90)
        except RuntimeError as exc:
            failures.append(exc)

    with memory.holding(50):
        first = threading.Thread(target=wait_and_stop, daemon=True)
        first.start()
        wait_until(lambda: memory.waiting == 1)
        second = hold_in_thread(memory, 40, order, release)  # fits beside the 50, behind the 90
        wait_until(lambda: memory.waiting == 2)
        stopping.set()
        first.join(10)
        assert [str(f) for f in failures] == ["the worker is stopping"]
        wait_until(lambda: order == [40])  # its turn came without the 50 being given back
    release.set()
    second.join(10)
    assert memory.held == 0 and memory.waiting == 0 and order == [40]


@pytest.mark.parametrize("size", [0, 10**12])
def test_no_budget_holds_nothing_up(size: int) -> None:
    memory = PageMemory(0)
    with memory.holding(size), memory.holding(size):
        assert memory.held == 0
