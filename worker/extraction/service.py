"""The online extraction run: pages → segments → LLM → facts, resumable and exactly-once per segment."""

from __future__ import annotations

import contextvars
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import islice

from sqlalchemy.orm import Session, sessionmaker

from worker.accounting import Budget, Ledger
from worker.config_store import ConfigReader
from worker.core.conversation import Segment, render_segment_for_extraction
from worker.extraction.committer import SegmentCommitter, SegmentResults
from worker.extraction.options import (
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
from worker.extraction.segments import SegmentResult, extract_segment
from worker.extraction.store import ExtractionStore, PageRef
from worker.llm.types import LLMClient

DISCARDED_IN_FLIGHT = "discarded: an earlier segment did not complete"


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
            store, self.planner, self.counters, self.progress, resolve_max_segment_failures(config)
        )

    def check_switch(self) -> None:
        ensure_enabled(self.options, self.config)

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


class OnlineExtraction:
    """Segments sent to the LLM one call at a time (or ``segment_concurrency`` in flight), committed in
    page order."""

    def __init__(self, run: ExtractionRun, llm: LLMClient) -> None:
        self.run = run
        self.llm = llm

    def extract_page(self, plan: PagePlan, earlier: PageReport | None = None) -> None:
        """Extract and commit the plan's segments; ``earlier`` is what a `--skipped` pass already did on
        the page (one page, one report)."""
        run = self.run
        report = run.committer.commit_page(plan, self.ordered_results(plan.slug, plan.label, plan.segments))
        if earlier is not None:
            report.segments += earlier.segments
            report.facts += earlier.facts
            report.skipped += earlier.skipped
        run.committer.finish(report)

    def retry_skipped(self, ref: PageRef) -> PageReport | None:
        """Re-extract the page's skipped segments first (ExtractOptions.retry_skipped)."""
        run = self.run
        retry = SkippedRetry(run.planner.store, run.planner, run.committer, run.counters, self.call)
        return retry.retry_page(ref)

    def call(self, label: str, segment: Segment) -> SegmentResult:
        """One segment's LLM attempts; runs on pool threads, so it touches no shared state."""
        run = self.run
        run.check_switch()
        if run.guard is not None:
            run.guard()
        return extract_segment(
            self.llm,
            render_segment_for_extraction(label, segment),
            run.max_facts,
            run.options.max_output_tokens,
            before_call=lambda: run.budget.check(run.options.job_id),
        )

    def submit(self, pool: ThreadPoolExecutor, label: str, segment: Segment) -> Future[SegmentResult]:
        """The call on a pool thread, in the caller's context (its trace: the job's span is the parent)."""
        return pool.submit(contextvars.copy_context().run, self.call, label, segment)

    def ordered_results(self, slug: str, label: str, segments: Sequence[Segment]) -> SegmentResults:
        """Segment results in page order, with up to ``segment_concurrency`` LLM calls in flight.

        Committing strictly in order keeps the checkpoint monotonic. When the consumer stops
        early (a failed segment, the kill switch), calls already in flight still finish and are
        recorded (they cost money) but their facts are discarded; calls not yet started never are.
        """
        counters = self.run.counters
        width = max(1, self.run.options.segment_concurrency)
        if width == 1:
            for index, segment in enumerate(segments):
                result = self.call(label, segment)
                counters.add_calls(result)
                yield index, segment, result
            return
        pool = ThreadPoolExecutor(max_workers=width, thread_name_prefix="segment")
        pending: deque[tuple[int, Segment, Future[SegmentResult]]] = deque()
        upcoming = iter(enumerate(segments))
        try:
            for index, segment in islice(upcoming, width):
                pending.append((index, segment, self.submit(pool, label, segment)))
            while pending:
                index, segment, future = pending.popleft()
                result = future.result()
                counters.add_calls(result)
                yield index, segment, result
                for next_index, next_segment in islice(upcoming, 1):
                    pending.append((next_index, next_segment, self.submit(pool, label, next_segment)))
        finally:
            for _, _, future in pending:
                future.cancel()
            pool.shutdown(wait=True)
            for index, segment, future in pending:
                if not future.cancelled() and future.exception() is None:
                    self.run.committer.record_discarded(
                        slug, index, segment, future.result(), DISCARDED_IN_FLIGHT
                    )


def extract_conversation_facts(
    store: ExtractionStore,
    llm: LLMClient | None,
    options: ExtractOptions,
    config: ConfigReader,
    budget: Budget,
    *,
    progress: ExtractionProgress | None = None,
    guard: Callable[[], None] | None = None,
) -> ExtractionCounters:
    """The run over a store: see ``run_extract_conversation_facts``."""
    return extract_pages(ExtractionRun(store, options, config, budget, progress=progress, guard=guard), llm)


def extract_pages(run: ExtractionRun, llm: LLMClient | None) -> ExtractionCounters:
    """Extract the run's pages one after another (a dry run only counts their pages and segments)."""
    validate_since(run.options.since_iso)
    online = None
    if not run.options.dry_run:
        run.check_switch()
        if llm is None:
            raise ValueError("an LLM client is required unless dry_run is set")
        online = OnlineExtraction(run, llm)
    for ref in run.list_pages():
        earlier = online.retry_skipped(ref) if online is not None and run.options.retry_skipped else None
        if earlier is not None and earlier.status == "failed":
            run.committer.finish(earlier)  # the job retries; its later segments wait for that
            continue
        plan = run.plan(ref, finish=earlier is None)
        if plan is None and earlier is not None:
            run.committer.finish(earlier)  # nothing new on the page: the skipped ones were all it had
        elif plan is not None:
            assert online is not None  # a dry run plans no page: each comes back as a finished report
            online.extract_page(plan, earlier)
    return run.counters


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
) -> ExtractionCounters:
    """Extract facts from the conversation pages of one source (or one page), resuming from checkpoints.

    Raises ExtractionDisabledError when the kill switch is off (unless ``override_disabled``),
    ValueError on bad options, and whatever ``guard`` raises (it is called before every LLM call,
    e.g. to stop a job whose lease was lost). Per-page problems never raise: they are counted and reported.
    """
    options = options or ExtractOptions()
    config = config or ConfigReader(factory, ttl=2.0)
    store = ExtractionStore(factory, ledger or Ledger(config.get))
    return extract_conversation_facts(
        store, llm, options, config, budget or Budget(factory, config.get), progress=progress, guard=guard
    )
