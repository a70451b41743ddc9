"""Batch-mode extraction for backfills: pending segments go out as one provider batch (half price) and
come back through the same per-segment transaction as online extraction.

Differences from an online run, on purpose:
- no repair turn and no bigger-cap retry: a malformed, truncated or refused reply is recorded with its
  outcome (llm_calls + extraction_audit) and its page stops there; the next run (online or batch) asks again;
- a request the batch never ran (expired, cancelled) leaves no row at all: its page stops at it, the
  checkpoint stays before it, and the next run extracts it. Nothing is lost and nothing is duplicated,
  because a page's segments are committed in order and each commit moves the checkpoint guard.
- results a page could not use (after its first failed or missing segment) were paid for, so their
  llm_calls rows are written too, marked as discarded, exactly as online in-flight calls are.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass

from sqlalchemy.orm import Session, sessionmaker

from worker.accounting import Budget
from worker.config_store import ConfigReader
from worker.core.conversation import Segment, render_segment_for_extraction
from worker.core.facts import segment_user_message
from worker.extraction import (
    Attempt,
    CheckpointConflictError,
    ExtractionCounters,
    ExtractionProgress,
    ExtractOptions,
    PagePlan,
    PageReport,
    SegmentResult,
    _NoProgress,
    _Run,
    _validate_since,
    _write_attempts,
    classify_reply,
    extraction_request,
)
from worker.llm.batches import BatchItem, BatchLLMClient, BatchStatus
from worker.llm.errors import BudgetExhaustedError, LLMError
from worker.llm.types import ChatRequest

logger = logging.getLogger(__name__)

# Both providers cap a batch (OpenAI 50,000 requests, Anthropic 100,000); pages past the cap wait for
# the next run rather than splitting one page across two batches.
MAX_BATCH_REQUESTS = 50_000
DEFAULT_POLL_SECONDS = 30.0
# The providers' completion window is 24 h; past it (plus a little) the batch is cancelled.
DEFAULT_TIMEOUT_SECONDS = 24 * 3600 + 600
DISCARDED_NOTE = "discarded: an earlier segment of the page did not complete (batch result)"


@dataclass
class BatchExtractionCounters(ExtractionCounters):
    batch_id: str | None = None
    batch_status: str | None = None  # the provider's last word on the batch
    segments_submitted: int = 0
    segments_missing: int = 0  # submitted, but the batch ended without running them
    pages_incomplete: int = 0  # pages with segments left for the next run (no result for them)


def custom_id(plan: PagePlan, index: int) -> str:
    """``p<page id>-s<segment index>-m<end message index>`` (Anthropic allows only [A-Za-z0-9_-])."""
    return f"p{plan.page_id}-s{index}-m{plan.ends[index]}"


def batch_segment_result(item: BatchItem, client: BatchLLMClient, max_facts: int, cap: int) -> SegmentResult:
    """One batch result as a segment's single attempt (no repair turn in batch mode)."""
    if item.response is None:
        error = item.error or "the batch request failed"
        return SegmentResult(
            [Attempt("provider_error", None, [], error, client.provider, client.model, batch=True)]
        )
    attempt = classify_reply(item.response, max_facts, cap)
    attempt.batch = True
    return SegmentResult([attempt])


class _BatchRun(_Run):
    def __init__(
        self,
        factory: sessionmaker[Session],
        options: ExtractOptions,
        config: ConfigReader,
        progress: ExtractionProgress,
        guard: Callable[[], None] | None,
        budget: Budget | None,
    ) -> None:
        super().__init__(factory, None, options, config, progress, guard, budget)
        self.batch = BatchExtractionCounters()
        self.counters = self.batch

    def finish(self, report: PageReport) -> None:
        if report.status != "incomplete":
            super().finish(report)
            return
        self.batch.pages_incomplete += 1
        self.batch.pages.append(report)
        self.progress.page_finished(report)

    def plans(self) -> list[PagePlan]:
        pages = self.list_pages()
        self.counters.pages_considered = len(pages)
        self.progress.pages_listed(len(pages))
        plans: list[PagePlan] = []
        queued = 0
        for page_id, slug, size in pages:
            plan = self.plan_page(page_id, slug, size)
            if isinstance(plan, PageReport):
                self.finish(plan)
            elif queued + len(plan.segments) > MAX_BATCH_REQUESTS and plans:
                self.finish(PageReport(slug, "skipped", f"the batch is full ({queued} requests); run again"))
            else:
                plans.append(plan)
                queued += len(plan.segments)
        return plans

    def requests(self, plans: list[PagePlan]) -> dict[str, ChatRequest]:
        requests: dict[str, ChatRequest] = {}
        for plan in plans:
            for index, segment in enumerate(plan.segments):
                turn = ("user", segment_user_message(render_segment_for_extraction(plan.label, segment)))
                requests[custom_id(plan, index)] = extraction_request(
                    [turn], self.max_facts, self.options.max_output_tokens
                )
        return requests

    def wait(
        self,
        client: BatchLLMClient,
        batch_id: str,
        poll_seconds: float,
        timeout_seconds: float,
        sleep: Callable[[float], None],
    ) -> BatchStatus | None:
        """Poll until the batch ends; past the timeout, cancel it and give it a grace period to end."""
        started = time.monotonic()
        deadline = started + timeout_seconds
        cancelled = False
        last: BatchStatus | None = None
        while True:
            if self.guard is not None:
                self.guard()
            try:
                last = client.status(batch_id)
            except LLMError as exc:
                if not exc.retryable:
                    raise
                logger.warning("polling batch %s failed (%s); polling again", batch_id, exc)
            if last is not None and last.ended:
                logger.info(
                    "batch %s ended %s after %.1fs: %s",
                    batch_id,
                    last.status,
                    time.monotonic() - started,
                    last.counts,
                )
                return last
            if time.monotonic() >= deadline:
                if cancelled:
                    return last
                logger.warning("batch %s did not end within %.0fs; cancelling it", batch_id, timeout_seconds)
                client.cancel(batch_id)
                cancelled = True
                deadline = time.monotonic() + max(60.0, 10 * poll_seconds)
            sleep(poll_seconds)

    def commit(
        self, plan: PagePlan, items: dict[str, BatchItem], client: BatchLLMClient, batch_label: str
    ) -> PageReport:
        consumed: set[int] = set()

        def results() -> Generator[tuple[int, Segment, SegmentResult], None, None]:
            for index, segment in enumerate(plan.segments):
                item = items.get(custom_id(plan, index))
                if item is None:
                    return  # never ran: the page stops here, the next run extracts the rest
                result = batch_segment_result(item, client, self.max_facts, self.options.max_output_tokens)
                self.count_calls(result)
                consumed.add(index)
                yield index, segment, result

        try:
            report = self.commit_page(plan, results())
        except CheckpointConflictError as exc:
            report = PageReport(plan.slug, "failed", str(exc), outcome="checkpoint_conflict")
        if report.status == "processed" and report.segments < len(plan.segments):
            report.status = "incomplete"
            report.reason = (
                f"segments {report.segments + 1}-{len(plan.segments)} have no result in {batch_label}; "
                "the next run extracts them"
            )
        elif report.status == "incomplete":
            report.reason += f" ({batch_label})"
        self.record_discarded(plan, items, client, consumed)
        return report

    def record_discarded(
        self, plan: PagePlan, items: dict[str, BatchItem], client: BatchLLMClient, consumed: set[int]
    ) -> None:
        """Results after a page's stopping point cost money too: record them, facts unused."""
        for index, segment in enumerate(plan.segments):
            item = items.get(custom_id(plan, index))
            if index in consumed or item is None:
                continue
            result = batch_segment_result(item, client, self.max_facts, self.options.max_output_tokens)
            self.count_calls(result)
            with self.factory.begin() as session:
                _write_attempts(
                    session,
                    result.attempts,
                    options=self.options,
                    slug=plan.slug,
                    index=index,
                    segment=segment,
                    prices=self.prices,
                    note=DISCARDED_NOTE,
                )


def run_batch_extraction(
    factory: sessionmaker[Session],
    client: BatchLLMClient | None,
    options: ExtractOptions | None = None,
    *,
    config: ConfigReader | None = None,
    poll_seconds: float = DEFAULT_POLL_SECONDS,
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
    progress: ExtractionProgress | None = None,
    guard: Callable[[], None] | None = None,
    budget: Budget | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> BatchExtractionCounters:
    """Extract the pending segments of one source (or one page) through the provider's batch API.

    Same page selection, kill switch, size cap and resume rules as ``run_extract_conversation_facts``;
    one batch per run, polled every ``poll_seconds``; results are committed page by page, in segment
    order, through the online run's per-segment transaction. Blocks until the batch ends (or
    ``timeout_seconds``, when it is cancelled and whatever finished is committed).
    """
    options = options or ExtractOptions()
    config = config or ConfigReader(factory, ttl=0)
    run = _BatchRun(factory, options, config, progress or _NoProgress(), guard, budget)
    _validate_since(options.since_iso)
    if options.dry_run:
        run.run()  # counts pages and segments; no LLM, no batch
        return run.batch
    if client is None:
        raise ValueError("a batch LLM client is required unless dry_run is set")
    run.check_switch()
    plans = run.plans()
    requests = run.requests(plans)
    if not requests:
        return run.batch
    try:
        run.budget.check(options.job_id)
    except BudgetExhaustedError as exc:
        for plan in plans:
            run.finish(PageReport(plan.slug, "failed", str(exc), outcome="budget_exhausted"))
        return run.batch
    if guard is not None:
        guard()

    batch_id = client.submit(list(requests.items()))
    run.batch.batch_id = batch_id
    run.batch.segments_submitted = len(requests)
    logger.info(
        "submitted batch %s to %s (%s): %d segment(s) from %d page(s)",
        batch_id,
        client.provider,
        client.model,
        len(requests),
        len(plans),
    )
    status = run.wait(client, batch_id, poll_seconds, timeout_seconds, sleep)
    run.batch.batch_status = status.status if status is not None else None
    label = f"batch {batch_id} ({run.batch.batch_status or 'unknown status'})"
    if status is None or not status.ended:
        for plan in plans:
            reason = f"{label} did not end in time; the next run submits these segments again"
            run.finish(PageReport(plan.slug, "incomplete", reason, segments=0))
        run.batch.segments_missing = len(requests)
        return run.batch

    items = client.results(batch_id, requests)
    run.batch.segments_missing = sum(1 for key in requests if key not in items)
    for plan in plans:
        run.finish(run.commit(plan, items, client, label))
    logger.info("committed %s: %s", label, run.batch.as_dict(with_pages=False))
    return run.batch
