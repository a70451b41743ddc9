"""The online extraction run: pages → segments → LLM → facts, resumable and exactly-once per segment."""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

from sqlalchemy.orm import Session, sessionmaker

from worker.accounting import Budget, Ledger
from worker.config_store import ConfigReader
from worker.core.conversation import Segment, render_segment_for_extraction
from worker.core.errors import error_summary
from worker.extraction.committer import (
    DISCARDED_UNUSED,
    MAX_SEGMENTS_PER_COMMIT,
    FactsCommitted,
    ResultBatches,
    SegmentCommitter,
)
from worker.extraction.options import (
    CheckpointConflictError,
    ExtractionCounters,
    ExtractionProgress,
    ExtractOptions,
    NoProgress,
    PageReport,
    ensure_enabled,
    resolve_max_facts,
    resolve_max_segment_failures,
    validate_since,
)
from worker.extraction.planner import PagePlan, PagePlanner
from worker.extraction.poison import SkippedRetry
from worker.extraction.segments import DISCARDED_ABORTED, SegmentAbortedError, SegmentResult, extract_segment
from worker.extraction.store import ExtractionStore, PageRef
from worker.jobs.shutdown import WorkerStoppingError, grace_left
from worker.llm.pipe import Feed, LLMPipe, Outcome, WaitOverError
from worker.llm.types import LLMClient
from worker.runtime.page_memory import PageMemory

# How long an interrupted page still waits for its calls in flight, to record what they cost.
INTERRUPTED_WAIT_SECONDS = 30.0

logger = logging.getLogger(__name__)


class ExtractionRun:
    """What the online and the batch path share for one run: options, limits, kill switch, budget,
    the planner and the committer (with the counters and progress they keep)."""

    def __init__(
        self,
        store: ExtractionStore,
        options: ExtractOptions,
        config: ConfigReader,
        budget: Budget,
        *,
        counters: ExtractionCounters | None = None,
        progress: ExtractionProgress | None = None,
        guard: Callable[[], None] | None = None,
        on_facts_committed: FactsCommitted | None = None,
    ) -> None:
        self.options = options
        self.config = config
        self.budget = budget
        self.guard = guard
        self.counters = counters if counters is not None else ExtractionCounters()
        self.progress = progress or NoProgress()
        self.max_facts = resolve_max_facts(options, config)
        self.planner = PagePlanner(store, options, config)
        self.committer = SegmentCommitter(
            store,
            self.planner,
            self.counters,
            self.progress,
            resolve_max_segment_failures(config),
            on_facts_committed,
        )

    def check_switch(self) -> None:
        ensure_enabled(self.options, self.config)

    def waiting_check(self) -> None:
        """While a page waits its turn: the kill switch (turned off, the job pauses now; it waited, then
        read its page only to pause at its first call) and the job's guard (its lease, a stopping worker)."""
        self.check_switch()
        if self.guard is not None:
            self.guard()

    def list_pages(self) -> list[PageRef]:
        """The run's pages, counted and reported to the progress listener."""
        pages = self.planner.pages()
        self.counters.pages_considered = len(pages)
        self.progress.pages_listed(len(pages))
        return pages

    def plan(self, ref: PageRef, *, finish: bool = True) -> PagePlan | None:
        """The page's plan, or None when there is nothing to do (its report is then finished, unless
        ``finish`` is off: the page already has a report of this run)."""
        plan = self.planner.plan(ref)
        if isinstance(plan, PagePlan):
            return plan
        if finish:
            self.committer.finish(plan)
        return None


class PageAbandonedError(RuntimeError):
    """A segment's call asked for another attempt after its page stopped (failed, or interrupted)."""


class OnlineExtraction:
    """Segments sent to the LLM through a pipe (the worker process's shared one, or one of
    ``segment_concurrency`` slots for this run), committed in page order, consecutive ready ones
    together."""

    def __init__(self, run: ExtractionRun, llm: LLMClient, pipe: LLMPipe, window: int | None) -> None:
        self.run = run
        self.llm = llm
        self.pipe = pipe
        self.window = window  # calls a page may start ahead of its commits (None: the pipe's default)

    def extract_page(self, plan: PagePlan, earlier: PageReport | None = None) -> None:
        """Extract and commit the plan's segments; ``earlier`` is what a `--skipped` pass already did on
        the page (one page, one report)."""
        run = self.run
        report = run.committer.commit_page(plan, self.ordered_results(plan))
        if earlier is not None:
            report.segments += earlier.segments
            report.facts += earlier.facts
            report.skipped += earlier.skipped
        run.committer.finish(report)

    def retry_skipped(self, ref: PageRef) -> PageReport | None:
        """Re-extract the page's skipped segments first (ExtractOptions.retry_skipped)."""
        run = self.run
        retry = SkippedRetry(run.planner.store, run.planner, run.committer, run.counters, self.piped_call)
        return retry.retry_page(ref)

    def piped_call(self, label: str, segment: Segment) -> SegmentResult:
        """``call`` in one of the pipe's slots: a retry of skipped segments ran on the job's own thread,
        past the process's FACTMILL_LLM_CONCURRENCY (64 job threads could add 64 calls to a provider
        limit the setting matched)."""
        abandoned = threading.Event()  # set, the call starts no other attempt (a retry, a repair turn)
        feed: Feed[SegmentResult] = self.pipe.open(
            1, lambda _: self.call(label, segment, abandoned.is_set), window=1
        )
        try:
            # As a page's wait: a stopping worker waits only while its grace lasts (waited through it,
            # the exit left the job unreleased, a worker loss, its paid attempts unrecorded).
            taken = feed.take(patience=_stop_patience)
        except BaseException as stopped:  # (SIGTERM in the CLI): the call in flight finishes, paid for
            abandoned.set()
            if isinstance(stopped, WaitOverError):  # what ended meanwhile is recorded; the rest is left
                stopped, left = WorkerStoppingError(), feed.close(timeout=0)
            else:
                left = feed.close(patience=_stop_patience)
            paid = [result for result in map(_paid_result, left) if result is not None]
            if paid:  # the caller records its attempts, then raises on
                raise SegmentAbortedError(paid[0].attempts, stopped) from stopped
            if isinstance(stopped, WorkerStoppingError):
                raise stopped from None  # (the wait that ran out)
            raise
        feed.close()
        [outcome] = taken
        if outcome.error is not None:
            raise outcome.error  # a SegmentAbortedError too: the retry records its attempts
        return outcome.result()

    def call(
        self, label: str, segment: Segment, abandoned: Callable[[], bool] = lambda: False
    ) -> SegmentResult:
        """One segment's LLM attempts; runs on the pipe's threads, so it touches no shared state. The
        kill switch, the guard (lease, stopping worker) and the budget are read before every attempt:
        read before the first only, a malformed first reply was followed by up to three paid retries
        and repair turns (the whole segment's text again) after the switch went off or the page was
        erased. A raise between attempts keeps the attempts made (SegmentAbortedError); a stopping worker
        (the one guard that costs) stops at the segment's end, not between its attempts. Once its page is
        ``abandoned`` (it failed, or the run was interrupted) a call starts no other attempt: a malformed
        first reply still sent its repair turn (the segment's text again), paid and thrown away, and the
        page's thread waited for it."""
        run = self.run
        paid = False  # an attempt made: a stopping worker finishes the segment it began paying for

        def before_call() -> None:
            nonlocal paid
            if abandoned():
                raise PageAbandonedError("the page stopped: its results are discarded")
            run.check_switch()
            if run.guard is not None:
                try:
                    run.guard()
                except WorkerStoppingError:
                    if not paid:
                        raise  # (released at this segment's boundary, costing nothing)
            run.budget.check(run.options.job_id)
            paid = True

        return extract_segment(
            self.llm,
            render_segment_for_extraction(label, segment),
            run.max_facts,
            run.options.max_output_tokens,
            before_call=before_call,
        )

    def ordered_results(self, plan: PagePlan) -> ResultBatches:
        """The page's segment results in page order, in runs of those ready together.

        Committing strictly in order keeps the checkpoint monotonic. When the consumer stops early (a
        failed segment, the kill switch), calls already in flight still finish and are recorded (they
        cost money) but their facts are discarded; calls not yet started never are. A stopping worker
        waits for them only while its grace period lasts (_stop_patience): what is still out then is
        left, the rest recorded.
        """
        counters, label, segments = self.run.counters, plan.label, plan.segments
        abandoned = threading.Event()
        feed: Feed[SegmentResult] = self.pipe.open(
            len(segments),
            lambda index: self.call(label, segments[index], abandoned.is_set),
            window=self.window,
        )
        taken_after_error: list[Outcome[SegmentResult]] = []
        try:
            while not feed.finished():
                ready: list[tuple[int, Segment, SegmentResult]] = []
                try:
                    taken = feed.take(MAX_SEGMENTS_PER_COMMIT, patience=_stop_patience)
                except WaitOverError:
                    # The worker is stopping and the page's next result is still out (a long retry): the
                    # results ready behind it are recorded now, before the grace period's exit loses
                    # them; the job is released, and its next run asks for them again.
                    raise WorkerStoppingError() from None
                for position, outcome in enumerate(taken):
                    if outcome.error is not None:
                        # It, if it had paid attempts, and those taken with it and finished after it:
                        # paid for, never handed on (recorded below).
                        taken_after_error = taken[position:]
                        if ready:
                            yield ready
                        error = outcome.error
                        raise error.cause if isinstance(error, SegmentAbortedError) else error
                    result = outcome.result()
                    counters.add_calls(result)
                    ready.append((outcome.index, segments[outcome.index], result))
                yield ready
        finally:
            # The calls in flight start no other attempt, the feed stops (it started calls for a failed
            # page while the spend was written), then what is paid already is recorded, before any wait.
            abandoned.set()
            self._record_discarded(plan, [*taken_after_error, *feed.close(timeout=0)])
            interrupted = sys.exc_info()[0]
            if (
                feed.in_flight
                and interrupted is not None
                and issubclass(interrupted, (KeyboardInterrupt, SystemExit))
            ):
                # Ctrl-C, or the CLI's SIGTERM: a CLI that waited without a word looked stuck.
                logger.warning(
                    "stopping: waiting for %d LLM call(s) in flight (paid for: recorded as they end); "
                    "interrupted again, it waits %d s at most",
                    feed.in_flight,
                    INTERRUPTED_WAIT_SECONDS,
                )
            try:
                left = feed.close(patience=_stop_patience)  # stopping: only while the grace lasts
            except BaseException:
                # Interrupted while the calls in flight finished (Ctrl-C, or the SIGTERM the CLI turns
                # into SystemExit, at a CLI that looked stuck): they are paid for. A while more for them,
                # what came back recorded, and the stop goes on.
                self._record_discarded(plan, feed.close(timeout=INTERRUPTED_WAIT_SECONDS))
                raise
            self._record_discarded(plan, left)

    def _record_discarded(self, plan: PagePlan, outcomes: list[Outcome[SegmentResult]]) -> None:
        """The spend of results paid for and never handed on. Each recorded on its own, and none raised
        from here: one that failed (the database away) lost the others' spend, and hid the error that
        ended the page."""
        lost, why = 0, ""
        for outcome in outcomes:
            paid = _paid_result(outcome)
            if paid is None:
                continue
            try:
                # A segment stopped between its own attempts is no casualty of an earlier one.
                aborted = isinstance(outcome.error, SegmentAbortedError)
                note = DISCARDED_ABORTED if aborted else DISCARDED_UNUSED
                self.run.committer.record_discarded(
                    plan.slug, outcome.index, plan.segments[outcome.index], paid, note
                )
            except Exception as exc:
                lost += 1
                why = error_summary(exc)
        if lost:
            logger.warning("could not record the spend of %d result(s) in flight: %s", lost, why)


# What a stopping worker keeps of its grace period to record what its pages' calls cost.
STOP_RECORD_SECONDS = 5.0


def _stop_patience() -> float | None:
    """While the worker stops: how long a page may still wait for a result (the grace period less
    STOP_RECORD_SECONDS); None otherwise. Waited out, the exit lost every paid result ready behind a
    slow one (up to twice the pipe): no llm_calls row, and the next worker paid for them again."""
    left = grace_left()
    return None if left is None else max(0.0, left - STOP_RECORD_SECONDS)


def _paid_result(outcome: Outcome[SegmentResult]) -> SegmentResult | None:
    """What a call left that was paid for: its result, or the attempts an error cut short."""
    if outcome.error is None:
        return outcome.result()
    if isinstance(outcome.error, SegmentAbortedError):
        return SegmentResult(outcome.error.attempts)
    return None


@contextmanager
def run_pipe(options: ExtractOptions, shared: LLMPipe | None) -> Iterator[tuple[LLMPipe, int | None]]:
    """(the pipe, a page's window): the shared pipe when there is one (a worker process's), where a
    page may run ahead of its commits so a lone page keeps every slot busy; else one of
    ``segment_concurrency`` slots for this run alone, keeping that window (1: strictly one call,
    then its commit)."""
    if shared is not None:
        yield shared, None
        return
    width = max(1, options.segment_concurrency)
    pipe = LLMPipe(width, name="run-pipe")
    try:
        yield pipe, width
    finally:
        pipe.close()


def extract_conversation_facts(
    store: ExtractionStore,
    llm: LLMClient | None,
    options: ExtractOptions,
    config: ConfigReader,
    budget: Budget,
    *,
    progress: ExtractionProgress | None = None,
    guard: Callable[[], None] | None = None,
    lease: Callable[[], None] | None = None,
    pipe: LLMPipe | None = None,
    on_facts_committed: FactsCommitted | None = None,
    memory: PageMemory | None = None,
) -> ExtractionCounters:
    """The run over a store: see ``run_extract_conversation_facts``. ``lease`` (a job's) is checked
    before each commit; ``guard`` before each call, and while its page waits for ``memory`` (the
    process's: a job's page is read only when it fits)."""
    run = ExtractionRun(
        store, options, config, budget, progress=progress, guard=guard, on_facts_committed=on_facts_committed
    )
    run.committer.lease = lease
    return extract_pages(run, llm, pipe, memory)


def extract_pages(
    run: ExtractionRun, llm: LLMClient | None, pipe: LLMPipe | None = None, memory: PageMemory | None = None
) -> ExtractionCounters:
    """Extract the run's pages one after another (a dry run only counts their pages and segments)."""
    validate_since(run.options.since_iso, run.options.force)
    if run.options.dry_run:
        for ref in run.list_pages():
            run.plan(ref)  # a dry run plans no page: each comes back as a finished report
        return run.counters
    run.check_switch()
    if llm is None:
        raise ValueError("an LLM client is required unless dry_run is set")
    with run_pipe(run.options, pipe) as (chosen, window):
        online = OnlineExtraction(run, llm, chosen, window)
        for ref in run.list_pages():
            try:
                with memory.holding(ref.size, run.waiting_check) if memory is not None else nullcontext():
                    _extract_page(run, online, ref)
            except CheckpointConflictError as exc:
                # A run outside a job (the CLI) reports a page another run changed under it, its skipped
                # segments' retry too, and goes on to the next (it raised out of the run: the pages after
                # it were never extracted, nothing was counted, and the CLI printed a traceback). A job
                # raises, so the lifecycle retries it on the page as it is.
                if run.options.job_id is not None:
                    raise
                run.committer.finish(PageReport(ref.slug, "failed", f"{exc}; run again to extract it"))
    return run.counters


def _extract_page(run: ExtractionRun, online: OnlineExtraction, ref: PageRef) -> None:
    """One page: its skipped segments first when the run retries them, then what is new."""
    earlier = online.retry_skipped(ref) if run.options.retry_skipped else None
    if earlier is not None and earlier.status == "failed":
        run.committer.finish(earlier)  # the job retries; its later segments wait for that
        return
    plan = run.plan(ref, finish=earlier is None)
    if plan is None and earlier is not None:
        run.committer.finish(earlier)  # nothing new on the page: the skipped ones were all it had
    elif plan is not None:
        online.extract_page(plan, earlier)


def run_extract_conversation_facts(
    factory: sessionmaker[Session],
    llm: LLMClient | None,
    options: ExtractOptions | None = None,
    *,
    config: ConfigReader | None = None,
    progress: ExtractionProgress | None = None,
    guard: Callable[[], None] | None = None,
    budget: Budget | None = None,
    ledger: Ledger | None = None,
    pipe: LLMPipe | None = None,
) -> ExtractionCounters:
    """Extract facts from the conversation pages of one source (or one page), resuming from checkpoints.

    Raises ExtractionDisabledError when the kill switch is off (unless ``override_disabled``),
    ValueError on bad options, and whatever ``guard`` raises (it is called before every LLM call,
    e.g. to stop a job whose lease was lost). Per-page problems never raise: they are counted and reported.
    ``pipe`` is a worker process's shared LLM pipe; without one the run has its own of
    ``options.segment_concurrency`` slots.
    """
    options = options or ExtractOptions()
    config = config or ConfigReader(factory, ttl=2.0)
    store = ExtractionStore(factory, ledger or Ledger(config.get))
    budget = budget or Budget(factory, config.get, fresh_config=config.fresh)
    return extract_conversation_facts(
        store, llm, options, config, budget, progress=progress, guard=guard, pipe=pipe
    )
