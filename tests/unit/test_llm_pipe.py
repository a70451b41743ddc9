"""The worker process's LLM pipe and follow-up queue, with real threads (calls are held on events)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from worker.llm.pipe import FollowUps, LLMPipe

WAIT = 10.0  # a deadlock guard for the events, not a timing assertion


def page_run(recorded: list[int] | None = None) -> Any:
    """A stand-in for the run OnlineExtraction pages for: it counts nothing, and notes in ``recorded`` the
    index of each result whose spend is recorded as discarded."""
    noted: list[int] = [] if recorded is None else recorded
    return SimpleNamespace(
        counters=SimpleNamespace(add_calls=lambda result: None),
        committer=SimpleNamespace(
            record_discarded=lambda slug, index, segment, result, note: noted.append(index)
        ),
    )


class Gate:
    """Calls that block until released, counting how many run at once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running = 0
        self.peak = 0
        self.started: list[tuple[str, int]] = []
        self.release = threading.Event()
        self.changed = threading.Condition(self.lock)

    def call(self, name: str) -> Callable[[int], str]:
        def run(index: int) -> str:
            with self.lock:
                self.running += 1
                self.peak = max(self.peak, self.running)
                self.started.append((name, index))
                self.changed.notify_all()
            assert self.release.wait(WAIT)
            with self.lock:
                self.running -= 1
            return f"{name}{index}"

        return run

    def wait_running(self, count: int) -> None:
        with self.lock:
            assert self.changed.wait_for(lambda: self.running >= count, WAIT), self.running


def test_calls_in_flight_never_exceed_the_width_and_fill_it_from_every_page():
    pipe = LLMPipe(4)
    gate = Gate()
    feeds = [pipe.open(3, gate.call(name)) for name in "ab"]
    gate.wait_running(4)
    assert pipe.in_flight() == 4
    gate.release.set()
    taken = {name: [] for name in "ab"}
    for name, feed in zip("ab", feeds, strict=True):
        while not feed.finished():
            taken[name] += [o.result() for o in feed.take()]
        assert feed.close() == []
    pipe.close()
    assert gate.peak == 4
    assert taken == {"a": ["a0", "a1", "a2"], "b": ["b0", "b1", "b2"]}


def test_a_page_waiting_for_a_slot_says_it_is_waiting_but_not_while_its_call_runs(monkeypatch):
    """A job's heartbeat lets the lease of a run showing no progress lapse: a page whose calls wait for
    slots other pages hold (a bulk ingest of long pages) must not look stalled, but one whose own call
    hangs (in the database) must."""
    from worker.core import progress

    monkeypatch.setattr(progress, "MARK_EVERY_SECONDS", 0.01)
    marks: list[int] = []
    progress.listen(lambda: marks.append(1))
    try:
        pipe = LLMPipe(1)
        gate = Gate()
        other = pipe.open(1, gate.call("other"))  # holds the pipe's one slot
        gate.wait_running(1)
        threading.Timer(0.3, gate.release.set).start()
        mine = pipe.open(1, lambda index: "mine")
        assert [o.result() for o in mine.take()] == ["mine"] and len(marks) >= 2  # it waited for a slot
        other.take()
        marks.clear()
        gate.release.clear()
        running = pipe.open(1, gate.call("slow"))
        gate.wait_running(1)  # its own call runs
        threading.Timer(0.3, gate.release.set).start()
        assert [o.result() for o in running.take()] == ["slow0"] and marks == []
        for feed in (other, mine, running):
            feed.close()
        pipe.close()
    finally:
        progress.listen(None)


def test_a_call_waiting_on_a_pipe_thread_reaches_its_jobs_heartbeat():
    """A page's calls run on the pipe's threads: a call waiting for its rate-limit place there marked
    progress on a thread no heartbeat listened to, and a long wait let the job's lease lapse. The
    listener is the job's context, which the pipe's calls run in."""
    from worker.core import progress

    marks: list[str] = []
    progress.listen(lambda: marks.append(threading.current_thread().name))
    try:
        pipe = LLMPipe(1)

        def waits_its_turn(index: int) -> str:
            progress.mark()  # as the rate limiter does between the slices of its wait
            return "done"

        feed = pipe.open(1, waits_its_turn)
        assert [o.result() for o in feed.take()] == ["done"]
        feed.close()
        pipe.close()
    finally:
        progress.listen(None)
    assert marks and all(name != threading.current_thread().name for name in marks)


def test_results_come_back_in_page_order_whatever_order_they_finish_in():
    pipe = LLMPipe(8)
    done = [threading.Event() for _ in range(6)]

    def call(index: int) -> int:
        assert done[index].wait(WAIT)
        return index

    feed = pipe.open(6, call)
    for event in reversed(done):  # the last finishes first
        event.set()
    got: list[int] = []
    while not feed.finished():
        got += [o.result() for o in feed.take()]
    feed.close()
    pipe.close()
    assert got == list(range(6))


def test_take_hands_over_consecutive_ready_results_together_up_to_its_limit():
    pipe = LLMPipe(8)
    feed = pipe.open(6, lambda index: index)
    first = feed.take(limit=4)
    assert [o.index for o in first] == list(range(len(first))) and 1 <= len(first) <= 4
    rest: list[int] = []
    while not feed.finished():
        rest += [o.index for o in feed.take()]
    assert [o.index for o in first] + rest == list(range(6))
    feed.close()
    pipe.close()


def test_a_window_of_one_starts_no_call_before_the_page_asked_for_more():
    pipe = LLMPipe(4)
    calls: list[int] = []
    handled: list[int] = []

    def call(index: int) -> int:
        calls.append(index)
        assert handled == list(range(index)), "a call started before the previous result was handled"
        return index

    feed = pipe.open(5, call, window=1)
    while not feed.finished():
        for outcome in feed.take():
            handled.append(outcome.result())
    feed.close()
    pipe.close()
    assert calls == handled == list(range(5))


def test_an_error_reaches_the_page_at_its_place_and_close_returns_what_was_left():
    pipe = LLMPipe(4)
    gate = threading.Event()
    started = threading.Semaphore(0)

    def call(index: int) -> int:
        if index == 1:
            raise RuntimeError("boom")
        if index >= 2:
            started.release()
            assert gate.wait(WAIT)
        return index

    feed = pipe.open(4, call, window=4)
    got: list[int] = []
    with pytest.raises(RuntimeError, match="boom"):
        while True:
            for outcome in feed.take():
                got.append(outcome.result())
    for _ in range(2):  # both later calls are in flight (the error may reach the page before they start)
        assert started.acquire(timeout=WAIT)
    gate.set()
    left = feed.close()  # waits for the two calls still in flight
    pipe.close()
    assert got == [0]
    assert [o.index for o in left] == [2, 3] and all(o.error is None for o in left)


def test_a_closed_page_starts_nothing_more():
    pipe = LLMPipe(2)
    gate = Gate()
    feed = pipe.open(10, gate.call("a"), window=2)
    gate.wait_running(2)
    gate.release.set()
    feed.close()
    pipe.close()
    assert len(gate.started) == 2


def test_a_lone_page_takes_the_whole_pipe_but_a_second_page_gets_its_share():
    pipe = LLMPipe(4)
    gate = Gate()
    big = pipe.open(100, gate.call("big"))
    gate.wait_running(4)
    small = pipe.open(2, gate.call("small"))
    gate.release.set()
    while not small.finished():
        small.take()
    small.close()
    big.close()
    pipe.close()
    first_six = [name for name, _ in gate.started[:6]]
    assert first_six[:4] == ["big"] * 4
    # The small page's two calls start as soon as slots free, before the big page's queued ones.
    assert first_six[4:] == ["small", "small"]


def test_follow_ups_batch_pending_items_and_take_one_submitted_while_running_again_later():
    follow = FollowUps(threads=2, batch=3)
    running = threading.Event()
    release = threading.Event()
    runs: list[list[str]] = []
    lock = threading.Lock()

    def work(items: list[str]) -> None:
        with lock:
            runs.append(list(items))
        if items == ["a"]:
            running.set()
            assert release.wait(WAIT)

    follow.submit("embed", "a", work)
    assert running.wait(WAIT)
    for item in ("a", "b", "b", "c", "d", "e"):  # "a" again while its run is open
        follow.submit("embed", item, work)
    release.set()
    follow.close()
    assert runs[0] == ["a"]
    later = [item for run in runs[1:] for item in run]
    assert sorted(later) == ["a", "b", "c", "d", "e"], runs  # each pending once; "a" once more
    assert all(len(run) <= 3 for run in runs)


def test_a_failing_follow_up_is_logged_and_the_queue_goes_on(caplog):
    follow = FollowUps(threads=1)
    done: list[str] = []

    def work(items: list[str]) -> None:
        if "x" in items:
            raise ValueError("embedding model down")
        done.extend(items)

    follow.submit("broken", "x", work)
    follow.submit("fine", "y", work)
    follow.close()
    assert done == ["y"]
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    # Its class and where, not its message, which may quote a page (at DEBUG).
    assert errors == [
        "background work failed: ValueError at follow-up broken (its message is logged at DEBUG)"
    ]


def test_a_failing_follow_up_s_database_error_is_logged_without_the_values_it_quotes(caplog):
    import psycopg
    from sqlalchemy.exc import DataError

    secret = "Alice's private diagnosis"
    follow = FollowUps(threads=1)

    def work(items: list[str]) -> None:
        quoted = psycopg.errors.lookup("22P02")(f'invalid input syntax for type integer: "{secret}"')
        raise DataError("UPDATE facts ...", {"fact": secret}, quoted)

    follow.submit("broken", "x", work)
    follow.close()
    assert "background work failed: DataError: InvalidTextRepresentation (SQLSTATE 22P02)" in caplog.text
    assert secret not in caplog.text


def test_results_taken_with_a_failed_call_are_recorded_as_discarded() -> None:
    """A page takes every ready result in one go; when one of them was an error, the results taken
    after it (paid for) were dropped: no llm_calls row, budgets counting low, the retry paying again."""
    import threading
    from types import SimpleNamespace

    from worker.extraction.committer import DISCARDED_UNUSED
    from worker.extraction.segments import DISCARDED_ABORTED, Attempt, SegmentAbortedError
    from worker.extraction.service import OnlineExtraction

    paid = Attempt("malformed_output", None, [], "not json", "stub", "stub-1")
    others_done = threading.Barrier(4)  # calls 2, 3, 4 and the test's own wait
    recorded: list[int] = []
    notes: dict[int, str] = {}
    run = SimpleNamespace(
        counters=SimpleNamespace(add_calls=lambda result: None),
        committer=SimpleNamespace(
            record_discarded=lambda slug, index, segment, result, note: (
                recorded.append(index) or notes.update({index: note})
            )
        ),
    )
    pipe = LLMPipe(5)
    try:
        extraction = OnlineExtraction(run, llm=None, pipe=pipe, window=None)  # type: ignore[arg-type]

        def call(label: str, segment: int, abandoned: object = None) -> str:
            if segment >= 2:
                others_done.wait(10)
                return f"result {segment}"
            finished.wait(10)  # 0 and 1 end after the others: all five are ready at the first take
            if segment == 1:  # after one paid attempt
                cause = RuntimeError("the budget check could not reach the database")
                raise SegmentAbortedError([paid], cause)
            return "result 0"

        finished = threading.Event()
        extraction.call = call  # type: ignore[method-assign]
        plan = SimpleNamespace(label="page", segments=[0, 1, 2, 3, 4], slug="p")
        batches = extraction.ordered_results(plan)  # type: ignore[arg-type]
        threading.Thread(target=lambda: (others_done.wait(10), finished.set()), daemon=True).start()
        assert [index for index, _, _ in next(batches)] == [0]
        with pytest.raises(RuntimeError, match="could not reach the database"):
            next(batches)
        assert sorted(recorded) == [1, 2, 3, 4]  # the failed one's paid attempt too
        # The one that stopped between its own attempts says so; the others were an earlier one's loss.
        assert notes == {1: DISCARDED_ABORTED} | dict.fromkeys([2, 3, 4], DISCARDED_UNUSED)
    finally:
        pipe.close()


def test_an_interrupt_while_a_stopped_page_waits_for_its_calls_records_what_they_cost(monkeypatch) -> None:
    """Ctrl-C (or the CLI's SIGTERM) while a page that had failed waited for its calls in flight lost
    their spend and that of the results taken with the failure: nothing was recorded."""
    import threading
    from types import SimpleNamespace

    from worker.extraction.segments import Attempt, SegmentAbortedError
    from worker.extraction.service import OnlineExtraction
    from worker.llm.pipe import Feed

    paid = Attempt("malformed_output", None, [], "not json", "stub", "stub-1")
    release = threading.Event()
    recorded: list[int] = []
    run = page_run(recorded)
    real_close = Feed.close

    def interrupted(self: Feed, timeout: float | None = None, patience: Any = None) -> list:  # type: ignore[type-arg]
        if timeout is None:  # the first wait: the user presses Ctrl-C, the calls end soon after
            threading.Timer(0.2, release.set).start()
            raise KeyboardInterrupt
        return real_close(self, timeout, patience)

    monkeypatch.setattr(Feed, "close", interrupted)
    pipe = LLMPipe(5)
    try:
        extraction = OnlineExtraction(run, llm=None, pipe=pipe, window=None)  # type: ignore[arg-type]

        started = threading.Barrier(3)  # the failure comes once both others are in flight

        def call(label: str, segment: int, abandoned: object = None) -> str:
            started.wait(10)
            if segment == 0:
                raise SegmentAbortedError([paid], RuntimeError("the provider refused"))
            release.wait(10)
            return f"result {segment}"

        extraction.call = call  # type: ignore[method-assign]
        plan = SimpleNamespace(label="page", segments=[0, 1, 2], slug="p")
        with pytest.raises(KeyboardInterrupt):
            next(extraction.ordered_results(plan))  # type: ignore[arg-type]
        assert sorted(recorded) == [0, 1, 2]  # the failure's paid attempt, and the two in flight
    finally:
        release.set()
        pipe.close()


def test_a_retry_of_skipped_segments_takes_a_slot_of_the_pipe() -> None:
    """`jobs retry --skipped` ran its calls on the job's own thread, beside the pipe: up to one more
    call per job thread than FACTMILL_LLM_CONCURRENCY, which operators match to a provider's limit."""
    import threading
    from types import SimpleNamespace

    from worker.extraction.service import OnlineExtraction

    pipe = LLMPipe(1)
    release = threading.Event()
    running, most = [0], [0]
    lock = threading.Lock()

    def counted(result: str, wait: bool) -> str:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        if wait:
            release.wait(10)
        with lock:
            running[0] -= 1
        return result

    try:
        busy = pipe.open(1, lambda _: counted("other page", wait=True), window=1)
        extraction = OnlineExtraction(SimpleNamespace(), llm=None, pipe=pipe, window=None)  # type: ignore[arg-type]
        extraction.call = lambda label, segment, abandoned: counted(f"retried {segment}", wait=False)  # type: ignore[method-assign]
        answers: list[str] = []
        retry = threading.Thread(target=lambda: answers.append(extraction.piped_call("page", 7)))  # type: ignore[arg-type]
        retry.start()
        retry.join(0.5)
        assert retry.is_alive() and answers == []  # waits for the slot the other page holds
        release.set()
        assert [o.result() for o in busy.take()] == ["other page"]
        busy.close()
        retry.join(10)
        assert answers == ["retried 7"] and most[0] == 1
    finally:
        release.set()
        pipe.close()


def test_follow_up_work_runs_in_its_submitters_context() -> None:
    """The embedding and consolidation follow-ups logged with no job id and traced apart from their
    job: their threads never had the submitter's context (its bound fields, its span)."""
    from worker.runtime.logs import bound_fields, log_context

    follow = FollowUps(threads=1)
    seen: list[dict[str, object]] = []
    done = threading.Event()

    def work(items: list[object]) -> None:
        seen.append(bound_fields())
        done.set()

    try:
        with log_context(job_id=42, job_kind="extraction"):
            follow.submit("embed", "page-1", work)
        assert done.wait(10)
    finally:
        follow.close()
    assert seen == [{"job_id": 42, "job_kind": "extraction"}]


def test_a_follow_up_run_of_several_jobs_items_names_none_of_them() -> None:
    """One embedding call for several pages, each its own job's: run in the first's context, every line
    named that job, and the others' consolidation jobs joined its trace."""
    from worker.runtime.logs import bound_fields, log_context

    follow = FollowUps(threads=1, batch=4)
    seen: list[tuple[list[object], dict[str, object]]] = []
    hold, started, done = threading.Event(), threading.Event(), threading.Event()

    def work(items: list[object]) -> None:
        if items == ["first"]:
            started.set()
            hold.wait(10)  # the next two queue up meanwhile, and go as one run
        seen.append((items, bound_fields()))
        if len(seen) == 2:
            done.set()

    try:
        with log_context(job_id=1):
            follow.submit("embed", "first", work)
        assert started.wait(10)
        with log_context(job_id=2):
            follow.submit("embed", "page-2", work)
        with log_context(job_id=3):
            follow.submit("embed", "page-3", work)
        hold.set()
        assert done.wait(10)
    finally:
        follow.close()
    assert seen == [(["first"], {"job_id": 1}), (["page-2", "page-3"], {})]


def test_an_interrupt_that_waits_for_calls_in_flight_says_so(monkeypatch, caplog) -> None:
    """Ctrl-C during `factmill extract` waited for the calls in flight without a word: a CLI that looked
    stuck. It says what it waits for, and that a second Ctrl-C stops now."""
    import threading
    from types import SimpleNamespace

    from worker.extraction.service import OnlineExtraction
    from worker.llm.pipe import Feed

    release = threading.Event()
    in_flight = threading.Barrier(3)  # the two calls and the page's thread
    run = page_run()

    def pressed(self: Feed, limit: int | None = None, patience: Any = None) -> list:  # type: ignore[type-arg]
        in_flight.wait(10)
        threading.Timer(0.2, release.set).start()
        raise KeyboardInterrupt

    monkeypatch.setattr(Feed, "take", pressed)
    pipe = LLMPipe(5)
    try:
        extraction = OnlineExtraction(run, llm=None, pipe=pipe, window=None)  # type: ignore[arg-type]

        def call(label: str, segment: int, abandoned: object = None) -> str:
            in_flight.wait(10)
            release.wait(10)
            return f"result {segment}"

        extraction.call = call  # type: ignore[method-assign]
        plan = SimpleNamespace(label="page", segments=[0, 1], slug="p")
        with caplog.at_level("WARNING", logger="worker.extraction.service"), pytest.raises(KeyboardInterrupt):
            next(extraction.ordered_results(plan))  # type: ignore[arg-type]
        assert caplog.messages == [
            "stopping: waiting for 2 LLM call(s) in flight (paid for: recorded as they end); interrupted "
            "again, it waits 30 s at most"
        ]
    finally:
        release.set()
        pipe.close()


def test_an_interrupt_while_committing_still_says_what_it_waits_for(monkeypatch, caplog) -> None:
    """Ctrl-C more often lands in the commit than in the wait for a result: the results' generator was
    then closed (GeneratorExit), and its wait for the calls in flight said nothing."""
    import threading
    from types import SimpleNamespace

    from worker.extraction.committer import SegmentCommitter
    from worker.extraction.service import OnlineExtraction

    release = threading.Event()
    in_flight = threading.Barrier(2)  # the second call and the committer
    run = page_run()
    pipe = LLMPipe(5)
    try:
        extraction = OnlineExtraction(run, llm=None, pipe=pipe, window=None)  # type: ignore[arg-type]

        def call(label: str, segment: int, abandoned: object = None) -> str:
            if segment == 1:
                in_flight.wait(10)
                release.wait(10)
            return f"result {segment}"

        extraction.call = call  # type: ignore[method-assign]
        plan = SimpleNamespace(label="page", segments=[0, 1], slug="p", replace=False, version=None)

        def commit(self: SegmentCommitter, plan: object, results: object) -> None:
            next(results)  # type: ignore[call-overload]  # the first result, while the second is in flight
            in_flight.wait(10)
            threading.Timer(0.2, release.set).start()
            raise KeyboardInterrupt  # pressed while committing it

        monkeypatch.setattr(SegmentCommitter, "_commit_incremental", commit)
        committer = SegmentCommitter.__new__(SegmentCommitter)
        committer.progress = SimpleNamespace(page_started=lambda *args: None)  # type: ignore[assignment]
        with caplog.at_level("WARNING", logger="worker.extraction.service"), pytest.raises(KeyboardInterrupt):
            committer.commit_page(plan, extraction.ordered_results(plan))  # type: ignore[arg-type]
        assert [m.split(";")[0] for m in caplog.messages] == [
            "stopping: waiting for 1 LLM call(s) in flight (paid for: recorded as they end)"
        ]
    finally:
        release.set()
        pipe.close()


class RefusedThreads:
    """``threading.Thread`` in the pipe's module, refusing starts past ``allowed`` as a container's
    process limit does (RuntimeError: can't start new thread)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, allowed: int) -> None:
        import worker.llm.pipe as pipe_module

        self.allowed = allowed
        refusals = self

        class Thread(threading.Thread):
            def start(self) -> None:
                if refusals.allowed <= 0:
                    raise RuntimeError("can't start new thread")
                refusals.allowed -= 1
                super().start()

        monkeypatch.setattr(pipe_module.threading, "Thread", Thread)


def test_a_page_the_pipe_has_no_thread_for_is_refused_and_not_left_to_run_later(monkeypatch) -> None:
    """Its feed stayed open with no one to take its results: the next page's thread ran its calls
    (paid, never recorded), and each refused thread was counted, so the pipe ran narrower for good."""
    refused = RefusedThreads(monkeypatch, allowed=0)
    gate = Gate()
    gate.release.set()
    pipe = LLMPipe(2)
    try:
        with pytest.raises(RuntimeError, match="can't start new thread"):
            pipe.open(3, gate.call("orphan"))
        refused.allowed = 2
        later = pipe.open(2, gate.call("later"))
        results: list[str] = []
        while not later.finished():
            results.extend(outcome.result() for outcome in later.take())
        assert results == ["later0", "later1"]
        assert [name for name, _ in gate.started] == ["later", "later"]  # the refused page's never ran
        later.close()
    finally:
        pipe.close()


def test_a_pipe_refused_more_threads_runs_every_call_on_those_it_has(monkeypatch, caplog) -> None:
    """Each refusal took a slot for good; once every slot was refused, no thread ran and each page waited
    for its first result forever, its lease kept fresh by the wait."""
    RefusedThreads(monkeypatch, allowed=1)
    gate = Gate()
    gate.release.set()
    pipe = LLMPipe(4)
    try:
        with caplog.at_level("WARNING", logger="worker.llm.pipe"):
            feed = pipe.open(6, gate.call("p"))
            results: list[str] = []
            while not feed.finished():
                results.extend(outcome.result() for outcome in feed.take())
        assert results == [f"p{i}" for i in range(6)] and gate.peak == 1
        assert "runs 1 of its 4 slots" in caplog.text
        feed.close()
    finally:
        pipe.close()


def test_on_a_pipe_narrowed_by_refused_threads_a_second_page_still_gets_its_share(monkeypatch) -> None:
    """A page's share was half the width: on a pipe the system had let start one thread of four, a page
    never reached it, took every slot, and a second page's first call waited for all of the first's."""
    RefusedThreads(monkeypatch, allowed=2)
    gate = Gate()
    pipe = LLMPipe(8)
    try:
        first = pipe.open(40, gate.call("a"))
        gate.wait_running(2)
        second = pipe.open(3, gate.call("b"))
        gate.release.set()
        for feed in (first, second):
            while not feed.finished():
                feed.take()
        order = [name for name, _ in gate.started]
        assert order.index("b") < 10, order  # soon after it opened, not after all forty of a's
        first.close()
        second.close()
    finally:
        pipe.close()


@contextlib.contextmanager
def page_behind_a_slow_call(
    monkeypatch: pytest.MonkeyPatch, grace_left: Callable[[], float | None], segments: int
) -> Iterator[tuple[Any, list[int], threading.Event]]:
    """A page whose first segment's call does not end (a long retry) while the others return: its
    result batches, the indexes whose spend was recorded as discarded, and the event that ends the
    slow call."""
    from types import SimpleNamespace

    from worker.extraction import service
    from worker.extraction.service import OnlineExtraction

    monkeypatch.setattr(service, "grace_left", grace_left)
    recorded: list[int] = []
    run = page_run(recorded)
    slow = threading.Event()
    pipe = LLMPipe(4)
    try:
        extraction = OnlineExtraction(run, llm=None, pipe=pipe, window=None)  # type: ignore[arg-type]

        def call(label: str, segment: int, abandoned: object = None) -> str:
            if segment == 0:
                assert slow.wait(WAIT)  # the page's next result: a call still retrying
            return f"result {segment}"

        extraction.call = call  # type: ignore[method-assign]
        plan = SimpleNamespace(label="page", segments=list(range(segments)), slug="p")
        yield extraction.ordered_results(plan), recorded, slow  # type: ignore[arg-type]
    finally:
        slow.set()
        pipe.close()


def test_a_stopping_worker_records_the_results_ready_behind_a_slow_one_before_its_grace_ends(
    monkeypatch,
) -> None:
    """The page waited for its next result (a long retry) however long the stop's grace lasted: the exit
    then lost every paid result ready behind it (no llm_calls row, paid for again by the next worker).
    While stopping it waits only until the grace nears its end, records what is ready, and releases."""
    from worker.extraction.service import STOP_RECORD_SECONDS
    from worker.jobs.shutdown import WorkerStoppingError

    # The grace left, as the page reads it: a third of a second more than the time kept to record, then
    # exactly that. A page that waited past it (its patience the whole grace) would read it again and
    # again until the slow call's end (WAIT), and hand that result on instead of stopping.
    reads = iter([STOP_RECORD_SECONDS + 0.3])
    with page_behind_a_slow_call(monkeypatch, lambda: next(reads, STOP_RECORD_SECONDS), 4) as (
        batches,
        recorded,
        _,
    ):
        with pytest.raises(WorkerStoppingError):
            next(batches)
        assert sorted(recorded) == [1, 2, 3]  # paid and ready: recorded before the exit


def test_a_page_may_wait_only_for_the_grace_less_the_time_kept_to_record(monkeypatch) -> None:
    from worker.extraction import service

    for left, patience in ((None, None), (service.STOP_RECORD_SECONDS + 0.5, 0.5), (1.0, 0.0)):
        monkeypatch.setattr(service, "grace_left", lambda left=left: left)
        assert service._stop_patience() == patience


def test_a_stop_that_begins_while_the_page_waits_is_noticed_before_a_short_grace_ends(monkeypatch) -> None:
    """The page looked at its patience only when its wait (MARK_EVERY_SECONDS, 10 s) ended: a stop with a
    short grace that began during the wait was noticed past the exit, the ready results lost."""
    import time

    from worker.core import progress
    from worker.extraction.service import STOP_RECORD_SECONDS
    from worker.jobs.shutdown import WorkerStoppingError

    exits_at: list[float] = []  # set once the stop begins, after the page began to wait

    def grace_left() -> float | None:
        return exits_at[0] - time.monotonic() if exits_at else None

    with page_behind_a_slow_call(monkeypatch, grace_left, 3) as (batches, recorded, slow):
        grace = STOP_RECORD_SECONDS + 1.0
        assert grace + 0.3 < progress.MARK_EVERY_SECONDS  # a page that looked only then: past the exit
        threading.Timer(0.3, lambda: exits_at.append(time.monotonic() + grace)).start()
        # The exit ends the slow call: a page that noticed the stop only after it hands its result on.
        threading.Timer(0.3 + grace, slow.set).start()
        with pytest.raises(WorkerStoppingError):
            next(batches)
        assert sorted(recorded) == [1, 2]


def stop_after(seconds: float, grace: float) -> Callable[[], float | None]:
    """``grace_left`` of a worker whose stop begins ``seconds`` from now, with ``grace`` seconds of grace."""
    import time

    begins = time.monotonic() + seconds
    return lambda: None if time.monotonic() < begins else begins + grace - time.monotonic()


def test_a_retry_of_skipped_segments_waits_for_its_call_only_while_a_stops_grace_lasts(monkeypatch) -> None:
    """`--skipped`'s call waited with no patience: through the grace period, so the exit came first, the
    job unreleased (a worker loss) and the attempts it had paid for unrecorded."""
    from types import SimpleNamespace

    from worker.extraction import service
    from worker.extraction.service import STOP_RECORD_SECONDS, OnlineExtraction
    from worker.jobs.shutdown import WorkerStoppingError

    grace = STOP_RECORD_SECONDS + 0.5
    monkeypatch.setattr(service, "grace_left", stop_after(0.3, grace))
    slow = threading.Event()
    pipe = LLMPipe(1)
    try:
        extraction = OnlineExtraction(SimpleNamespace(), llm=None, pipe=pipe, window=None)  # type: ignore[arg-type]
        told: list[bool] = []

        def call(label: str, segment: int, abandoned: Callable[[], bool]) -> str:
            slow.wait(WAIT)
            told.append(abandoned())  # what it asks before another attempt
            return "late"

        extraction.call = call  # type: ignore[method-assign]
        threading.Timer(0.3 + grace + 3.0, slow.set).start()  # well past the exit
        with pytest.raises(WorkerStoppingError):
            extraction.piped_call("page", 7)  # type: ignore[arg-type]
        assert not slow.is_set(), "released within the grace, not once the call ended"
        slow.set()
        pipe.close()  # the call ends: it was told its job let it go (it starts no other paid attempt)
        assert told == [True]
    finally:
        slow.set()
        pipe.close()


def test_a_failed_pages_wait_for_its_calls_in_flight_ends_with_a_stop_that_begins_during_it(
    monkeypatch,
) -> None:
    """A page that failed waits for its calls in flight (paid for: recorded); the wait read the grace
    once, before the stop began, and so ran past the exit, the run's verdict never settled."""
    from types import SimpleNamespace

    from worker.extraction import service
    from worker.extraction.service import STOP_RECORD_SECONDS, OnlineExtraction

    grace = STOP_RECORD_SECONDS + 0.5
    monkeypatch.setattr(service, "grace_left", stop_after(0.5, grace))
    run = page_run()
    slow = threading.Event()
    pipe = LLMPipe(2)
    try:
        extraction = OnlineExtraction(run, llm=None, pipe=pipe, window=None)  # type: ignore[arg-type]

        def call(label: str, segment: int, abandoned: object = None) -> str:
            if segment == 0:
                raise RuntimeError("segment 0 failed")
            assert slow.wait(WAIT)  # still out when the page fails
            return "late"

        extraction.call = call  # type: ignore[method-assign]
        plan = SimpleNamespace(label="page", segments=[0, 1], slug="p")
        threading.Timer(0.5 + grace + 3.0, slow.set).start()  # well past the exit
        with pytest.raises(RuntimeError, match="segment 0 failed"):
            next(extraction.ordered_results(plan))  # type: ignore[arg-type]
        assert not slow.is_set(), "its wait ended with the grace, not with the call"
    finally:
        slow.set()
        pipe.close()
