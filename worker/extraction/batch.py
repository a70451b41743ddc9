"""Batch-mode extraction for backfills: pending segments go out as one provider batch (half price).

They come back through the same per-segment transaction as online extraction.

Differences from an online run, on purpose:
- no repair turn and no bigger-cap retry: a malformed, truncated or refused reply is recorded with its
  outcome (llm_calls + extraction_audit) and its page stops there; the next run (online or batch) asks
  again, except after a refusal or a reply cut off by the context window (they repeat: permanent, counted
  towards skipping the segment);
- a request the batch never ran (expired, cancelled) leaves no row at all: its page stops at it, the
  checkpoint stays before it, and the next run extracts it. Nothing is lost and nothing is duplicated,
  because a page's segments are committed in order and each commit moves the checkpoint guard.
- results a page could not use (after its first failed or missing segment) were paid for, so their
  llm_calls rows are written too, marked as discarded, exactly as online in-flight calls are.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from worker.accounting import Budget, Ledger
from worker.config_store import ConfigReader
from worker.core.conversation import Segment, render_segment_for_extraction, segment_bytes
from worker.core.errors import error_summary
from worker.db import database_unavailable
from worker.extraction.batch_abandoned import abandon_send, cancel_abandoned, owe_abandoned
from worker.extraction.committer import SegmentResults, one_at_a_time
from worker.extraction.options import (
    CheckpointConflictError,
    ExtractionCounters,
    ExtractionProgress,
    ExtractOptions,
    PageReport,
    validate_since,
)
from worker.extraction.planner import PagePlan
from worker.extraction.prompts import extraction_request, first_turn
from worker.extraction.provider_copies import discard_batch
from worker.extraction.segments import REJECTED_REQUEST_STATUSES, Attempt, SegmentResult, classify_reply
from worker.extraction.service import ExtractionRun, extract_pages
from worker.extraction.store import ExtractionStore
from worker.llm.batch_api import BatchItem, BatchLLMClient, BatchStatus
from worker.llm.errors import BudgetExhaustedError, LLMError
from worker.llm.types import ChatRequest

logger = logging.getLogger(__name__)

# Both providers cap a batch (OpenAI 50,000 requests, Anthropic 100,000); pages past the cap wait for
# the next run rather than splitting one page across two batches.
MAX_BATCH_REQUESTS = 50_000
MAX_BATCH_BYTES = 95_000_000  # FACTMILL_BACKFILL_BATCH_MAX_BYTES's default
# The page bodies one batch's plans may hold (a plan keeps its page's parsed messages, about 2.5 times the
# body, for the whole wait, up to a day): measured by requests and request bytes alone, a batch of pages
# with a little new each held ten thousand whole pages, tens of GB. Pages past it wait for the next run.
MAX_HELD_PAGE_BYTES = 256 * 1024 * 1024
DEFAULT_POLL_SECONDS = 30.0
# The providers' completion window is 24 h; past it (plus a little) the batch is cancelled.
DEFAULT_TIMEOUT_SECONDS = 24 * 3600 + 600
COLLECT_ALLOWANCE_SECONDS = 3600.0  # to read and commit an ended batch's results (ProviderCopies.hold)


def cancel_grace(poll_seconds: float) -> float:
    """How long a batch cancelled at the run's timeout is polled for, to end with what it finished."""
    return max(60.0, 10 * poll_seconds)


DISCARDED_NOTE = "discarded: an earlier segment of the page did not complete (batch result)"


@dataclass
class BatchExtractionCounters(ExtractionCounters):
    batch_id: str | None = None
    batch_status: str | None = None  # the provider's last word on the batch
    segments_submitted: int = 0
    segments_missing: int = 0  # submitted, but the batch ended without running them
    pages_incomplete: int = 0  # pages with segments left for the next run (no result for them)
    provider_copy_deleted: bool = False  # the batch's files (page text) deleted at the provider


def custom_id(key: str, plan: PagePlan, index: int) -> str:
    """``<batch key>-p<page id>-s<segment index>-m<end message index>`` (Anthropic allows only
    [A-Za-z0-9_-]; the key first, as a batch is found by it: BatchLLMClient.find)."""
    return f"{key}-p{plan.page_id}-s{index}-m{plan.ends[index]}"


def segment_request(label: str, segment: Segment, max_facts: int, cap: int) -> ChatRequest:
    """A segment's batched request: the online run's first turn (no repair turn in batch mode)."""
    return extraction_request([first_turn(render_segment_for_extraction(label, segment))], max_facts, cap)


def request_overhead_bytes(max_facts: int, cap: int) -> int:
    """An upper bound on a batched request's bytes besides its segment: the system prompt, the reply's
    schema and the wire's own fields (custom id, method, model, parameters)."""
    request = extraction_request([first_turn("")], max_facts, cap)
    schema = json.dumps(request.json_schema or {}, ensure_ascii=False)
    return len(request.system.encode()) * 11 // 10 + len(schema.encode()) * 11 // 10 + 1024


def _leading_fit(costs: list[int], requests: int, size: int) -> int:
    """How many of the leading ``costs`` fit in ``requests`` requests and ``size`` bytes."""
    fits = 0
    for cost in costs[: max(0, requests)]:
        if cost > size:
            break
        size -= cost
        fits += 1
    return fits


def batch_segment_result(item: BatchItem, client: BatchLLMClient, max_facts: int, cap: int) -> SegmentResult:
    """One batch result as a segment's single attempt (no repair turn in batch mode)."""
    if item.response is None:
        error = item.error or "the batch request failed"
        provider, model = client.provider, client.model
        # A request the provider rejects (400/413/422, not the deployment's fault) repeats: it counts
        # towards skipping the segment, as online (it failed the page on every pass).
        rejected = item.status in REJECTED_REQUEST_STATUSES and not item.deployment_fault
        failed = Attempt(
            "provider_error",
            None,
            [],
            error,
            provider,
            model,
            batch=True,
            rejected=rejected,
            usage=item.usage,
        )
        return SegmentResult([failed], permanent=rejected)
    attempt = classify_reply(item.response, max_facts, cap)
    attempt.batch = True
    # Without a repair turn or a retry only what repeats is a permanent failure here: a refusal, and a
    # reply cut off by the context window (each pass sent it again at the same cap, paid for).
    permanent = attempt.outcome == "refusal" or item.response.window_full
    return SegmentResult([attempt], permanent=permanent)


@dataclass
class _Submitted:
    """One submitted batch: its plans and requests, and the client it went to."""

    client: BatchLLMClient
    plans: list[PagePlan]
    requests: dict[str, ChatRequest]


class BatchExtraction:
    """The batch path over an ExtractionRun: plan every page, submit one batch, wait, commit page by page."""

    def __init__(
        self,
        run: ExtractionRun,
        counters: BatchExtractionCounters,
        max_bytes: int = MAX_BATCH_BYTES,
        max_requests: int = MAX_BATCH_REQUESTS,
        max_held: int | None = None,  # MAX_HELD_PAGE_BYTES
    ) -> None:
        self.run = run
        self.batch = counters
        self.max_bytes, self.max_requests = max_bytes, max_requests
        self.max_held = MAX_HELD_PAGE_BYTES if max_held is None else max_held
        self.sendable: dict[str, int] = {}  # per planned page: how many of its segments the batch holds
        self.key = f"fx{secrets.token_hex(6)}"  # what the batch is sent, and looked up, under

    def finish(self, report: PageReport) -> None:
        if report.status != "incomplete":
            self.run.committer.finish(report)
            return
        self.batch.pages_incomplete += 1
        self.batch.pages.append(report)
        self.run.progress.page_finished(report)

    def plans(self) -> list[PagePlan]:
        """The pages one batch holds, by requests and by bytes (the providers refuse a file over about
        200 MB: a run of tens of thousands of pending segments failed alike on every run). A page past
        what is left waits for the next run; the first page alone past a batch sends its first segments
        (the next run extracts the rest), unless it is replaced whole, which needs every result at once."""
        plans: list[PagePlan] = []
        queued = size = held = 0
        overhead = request_overhead_bytes(self.run.max_facts, self.run.options.max_output_tokens)
        for ref in self.run.list_pages():
            plan = self.run.plan(ref)
            if plan is None:
                continue
            if plans and held + ref.size > self.max_held:  # a page with work (the parse is dropped)
                full = f"the batch holds {held} bytes of pages, as many as one run keeps; run again"
                self.finish(PageReport(ref.slug, "skipped", full))
                continue
            costs = [overhead + segment_bytes(segment, plan.label) for segment in plan.segments]
            fits = _leading_fit(costs, self.max_requests - queued, self.max_bytes - size)
            if fits == 0 and not plans:  # held with no request, it left every page after it waiting
                alone = f"its next segment alone is more than a batch takes ({self.max_bytes} bytes)"
                self.finish(
                    PageReport(ref.slug, "failed", f"{alone}; extract it online (`factmill extract --slug`)")
                )
            elif fits < len(costs) and plans:
                full = f"the batch is full ({queued} requests, about {size} bytes); run again"
                self.finish(PageReport(ref.slug, "skipped", full))
            elif fits < len(costs) and plan.replace:
                self.finish(
                    PageReport(
                        ref.slug,
                        "failed",
                        f"it is re-extracted whole and its {len(costs)} segments are more than one batch "
                        "takes; extract it online (`factmill extract --slug`)",
                    )
                )
            else:
                plans.append(plan)
                self.sendable[plan.slug] = fits
                queued += fits
                size += sum(costs[:fits])
                held += ref.size
        return plans

    def requests(self, plans: list[PagePlan]) -> dict[str, ChatRequest]:
        requests: dict[str, ChatRequest] = {}
        cap = self.run.options.max_output_tokens
        for plan in plans:
            for index, segment in enumerate(plan.segments[: self.sendable.get(plan.slug)]):
                requests[custom_id(self.key, plan, index)] = segment_request(
                    plan.label, segment, self.run.max_facts, cap
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
            if self.run.guard is not None:
                self.run.guard()
            self._check_switch(batch_id)
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
                try:
                    client.cancel(batch_id)
                except LLMError as exc:  # it ended since the last poll (a 400): the next poll tells
                    logger.warning("batch %s: the cancel was refused (%s); polling it", batch_id, exc)
                cancelled = True
                deadline = time.monotonic() + cancel_grace(poll_seconds)
            sleep(poll_seconds)

    def _check_switch(self, batch_id: str) -> None:
        """Switched off in a wait of hours (a model writing bad facts), the run stops; the switch
        unreadable a moment (the database restarting) throws no batch away: the next poll reads it."""
        try:
            self.run.check_switch()
        except OperationalError as exc:
            if not database_unavailable(exc):
                raise
            logger.warning(
                "batch %s: the kill switch could not be read (%s); polling on", batch_id, error_summary(exc)
            )

    def result_of(self, item: BatchItem, client: BatchLLMClient) -> SegmentResult:
        return batch_segment_result(item, client, self.run.max_facts, self.run.options.max_output_tokens)

    def commit(
        self, plan: PagePlan, items: dict[str, BatchItem], client: BatchLLMClient, batch_label: str
    ) -> PageReport:
        consumed: set[int] = set()

        def results() -> SegmentResults:
            for index, segment in enumerate(plan.segments):
                item = items.get(custom_id(self.key, plan, index))
                if item is None:
                    return  # never ran: the page stops here, the next run extracts the rest
                result = self.result_of(item, client)
                self.batch.add_calls(result)
                consumed.add(index)
                yield index, segment, result

        try:
            report = self.run.committer.commit_page(plan, one_at_a_time(results()))
        except CheckpointConflictError as exc:
            report = PageReport(plan.slug, "failed", str(exc), outcome="checkpoint_conflict")
        settled = report.segments + report.skipped  # a skipped segment is settled: the page went past it
        if report.status == "processed" and settled < len(plan.segments):
            report.status = "incomplete"
            report.reason = (
                f"segments {settled + 1}-{len(plan.segments)} have no result in {batch_label}; "
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
            item = items.get(custom_id(self.key, plan, index))
            if index not in consumed and item is not None:
                result = self.result_of(item, client)
                self.run.committer.record_discarded(plan.slug, index, segment, result, DISCARDED_NOTE)

    def submit(self, client: BatchLLMClient) -> _Submitted | None:
        """Plan the pages and submit their segments as one batch; None when there is nothing to send
        (or the budget is spent: every planned page is then finished as budget_exhausted)."""
        plans = self.plans()
        requests = self.requests(plans)
        if not requests:
            return None
        try:
            self.run.budget.check(self.run.options.job_id)
        except BudgetExhaustedError as exc:
            for plan in plans:
                self.finish(PageReport(plan.slug, "failed", str(exc), outcome="budget_exhausted"))
            return None
        self.run.check_switch()  # switched off while the pages were planned (minutes): nothing goes out
        if self.run.guard is not None:
            self.run.guard()
        started = datetime.now(UTC)
        try:
            self.batch.batch_id = client.submit(list(requests.items()), key=self.key)
        except BaseException as exc:  # Ctrl-C or SIGTERM in an upload of minutes, or no answer
            abandon_send(self.run.committer.store, client, self.key, started, exc)
            raise
        self.batch.segments_submitted = len(requests)
        logger.info(
            "submitted batch %s to %s (%s): %d segment(s) from %d page(s)",
            self.batch.batch_id,
            client.provider,
            client.model,
            len(requests),
            len(plans),
        )
        return _Submitted(client, plans, requests)

    def collect(self, sent: _Submitted, status: BatchStatus | None) -> None:
        """Commit what the ended batch answered, page by page; a batch that never ended commits nothing."""
        batch_id = self.batch.batch_id
        assert batch_id is not None
        self.batch.batch_status = status.said() if status is not None else None
        label = f"batch {batch_id} ({self.batch.batch_status or 'unknown status'})"
        copies = self.run.committer.store.provider_copies
        if status is None or not status.ended:
            # Its results are never read now (the next run sends these segments again); its files are
            # deleted by beat's backfill poll once it has ended.
            copies.owe(sent.client.provider, batch_id, f"{label} did not end in time")
            logger.warning("%s did not end: its files are deleted once it has", label)
            for plan in sent.plans:
                reason = f"{label} did not end in time; the next run submits these segments again"
                self.finish(PageReport(plan.slug, "incomplete", reason, segments=0))
            self.batch.segments_missing = len(sent.requests)
            return
        items = sent.client.results(batch_id, sent.requests)
        self.batch.segments_missing = sum(1 for key in sent.requests if key not in items)
        for plan in sent.plans:
            self.finish(self.commit(plan, items, sent.client, label))
        self.batch.provider_copy_deleted = discard_batch(sent.client, batch_id, copies)
        logger.info("committed %s: %s", label, self.batch.as_dict(with_pages=False))


def batch_extraction(
    store: ExtractionStore,
    client: BatchLLMClient | None,
    options: ExtractOptions,
    config: ConfigReader,
    budget: Budget,
    *,
    poll_seconds: float = DEFAULT_POLL_SECONDS,
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
    progress: ExtractionProgress | None = None,
    guard: Callable[[], None] | None = None,
    sleep: Callable[[float], None] = time.sleep,
    max_bytes: int = MAX_BATCH_BYTES,
    max_requests: int = MAX_BATCH_REQUESTS,
) -> BatchExtractionCounters:
    """The batch run over a store: see ``run_batch_extraction``."""
    counters = BatchExtractionCounters()
    run = ExtractionRun(store, options, config, budget, counters=counters, progress=progress, guard=guard)
    validate_since(options.since_iso, options.force)
    if options.dry_run:
        extract_pages(run, None)  # counts pages and segments; no LLM, no batch
        return counters
    if client is None:
        raise ValueError("a batch LLM client is required unless dry_run is set")
    run.check_switch()
    batch = BatchExtraction(run, counters, max_bytes, max_requests)
    sent = batch.submit(client)
    if sent is not None:
        assert counters.batch_id is not None
        status: BatchStatus | None = None
        try:
            held = timeout_seconds + cancel_grace(poll_seconds) + COLLECT_ALLOWANCE_SECONDS
            store.provider_copies.hold(client.provider, counters.batch_id, timedelta(seconds=held))
            status = batch.wait(client, counters.batch_id, poll_seconds, timeout_seconds, sleep)
            batch.collect(sent, status)
        except BaseException as exc:  # Ctrl-C in a wait of hours, a cancel or a download that failed
            owe_abandoned(store, client.provider, counters.batch_id, exc)  # first: a stop in the cancel
            if status is None or not status.ended:
                cancel_abandoned(client, counters.batch_id)
            raise
    return counters


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
    ledger: Ledger | None = None,
    sleep: Callable[[float], None] = time.sleep,
    max_bytes: int = MAX_BATCH_BYTES,
    max_requests: int = MAX_BATCH_REQUESTS,
) -> BatchExtractionCounters:
    """Extract the pending segments of one source (or one page) through the provider's batch API.

    Same page selection, kill switch, size cap and resume rules as ``run_extract_conversation_facts``;
    one batch per run of at most ``max_requests`` and ``max_bytes`` (the FACTMILL_BACKFILL_BATCH_MAX_*
    settings), polled every ``poll_seconds``; results are committed page by page, in segment
    order, through the online run's per-segment transaction. Blocks until the batch ends (or
    ``timeout_seconds``, when it is cancelled and whatever finished is committed).
    """
    options = options or ExtractOptions()
    config = config or ConfigReader(factory, ttl=0)
    return batch_extraction(
        ExtractionStore(factory, ledger or Ledger(config.get)),
        client,
        options,
        config,
        budget or Budget(factory, config.get, fresh_config=config.fresh),
        poll_seconds=poll_seconds,
        timeout_seconds=timeout_seconds,
        progress=progress,
        guard=guard,
        sleep=sleep,
        max_bytes=max_bytes,
        max_requests=max_requests,
    )
