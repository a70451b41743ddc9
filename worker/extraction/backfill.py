"""Backfills on the queue: a batch_extraction job plans pages, stores its batches, sends them and collects
their results as they end, resumable at every step.

Each pass of the job (its first run, then one per beat poll while provider batches run):
1. plans the selected pages and stores every batch and its requests (custom ids) in one transaction;
2. sends each stored batch: it first commits ``submitting``, then calls the provider, then stores the
   provider's id. A batch found ``submitting`` (its sender died) is looked up at the provider by its key
   (which begins every custom id) and is sent again only when the provider has no such batch;
3. polls the sent batches and commits an ended batch's results page by page, in segment order, through
   the online run's per-segment transaction, which here also marks the request recorded (a result is
   paid and committed once, whoever dies when); then the provider's copy is deleted, before the batch
   is marked collected, so a pass that dies in between deletes it again (a 404 is fine);
4. waits (paused, reason "batch") while batches run; beat wakes it every ``backfill_poll_seconds``.

A result commits only onto the segment it was asked for (same end message, same messages' digest) when
that segment is still the page's next one. A paid result whose page has moved on (edited during the
batch, or an earlier segment failed or expired) is recorded as discarded: its llm_calls row is written,
its facts are not. Requests an expired, cancelled or failed batch never ran are left for the next run.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import func
from sqlalchemy.orm import Session, sessionmaker

from models import Backfill
from worker.accounting import Budget, Ledger
from worker.accounting.prices import estimated_batch_cost
from worker.config_store import ConfigReader
from worker.core.facts import DEFAULT_MAX_FACTS
from worker.extraction import backfill_limits as limits
from worker.extraction.backfill_matching import group_by_page, matching_run
from worker.extraction.backfill_plan import BackfillPlanner, BatchBounds
from worker.extraction.backfill_request import (
    GONE,
    RESEND_AFTER_SECONDS,
    WINDING_DOWN,
    BackfillNotFoundError,
    BackfillSelection,
    BatchSendFailedError,
)
from worker.extraction.backfill_rows import BatchRow, RequestRow
from worker.extraction.backfill_store import SEND_FAILED, BackfillSegmentStore, BackfillStore
from worker.extraction.batch import MAX_BATCH_BYTES, MAX_BATCH_REQUESTS, batch_segment_result, segment_request
from worker.extraction.committer import FactsCommitted, SegmentResults, one_at_a_time
from worker.extraction.options import CheckpointConflictError, ExtractOptions
from worker.extraction.planner import PagePlan
from worker.extraction.prompts import extraction_request, first_turn
from worker.extraction.provider_copies import ProviderCopies, discard_batch, forget_uploads
from worker.extraction.service import ExtractionRun
from worker.extraction.store import PageRef
from worker.llm.batch_api import PROVIDER_KEEPS, UNDETERMINED, BatchItem, BatchLLMClient, BatchStatus
from worker.llm.errors import BudgetExhaustedError, LLMError, provider_cannot_serve
from worker.llm.types import ChatRequest

logger = logging.getLogger(__name__)


@dataclass
class BackfillDeps:
    """What one pass needs: the database, the ledger, the switch and budget, the provider's batch API."""

    factory: sessionmaker[Session]
    ledger: Ledger
    config: ConfigReader
    budget: Budget
    client: BatchLLMClient
    job_id: int | None
    max_requests: int = MAX_BATCH_REQUESTS
    max_bytes: int = MAX_BATCH_BYTES
    max_output_tokens: int = 1024
    default_max_facts: int = DEFAULT_MAX_FACTS  # FACTMILL_EXTRACTION_MAX_FACTS
    guard: Callable[[], None] = field(default=lambda: None)
    # Called once per transaction that committed a page's facts, as an online run does (embedding them).
    on_facts_committed: FactsCommitted | None = None


@dataclass(frozen=True)
class PassResult:
    finished: bool
    open_batches: int
    status: str
    troubled: bool = False  # a send failed, or waits after failing: the job's budgets are not renewed


class BackfillPass:
    """One pass of a backfill job over its stored state (see the module docstring)."""

    def __init__(self, deps: BackfillDeps, backfill: Backfill) -> None:
        self.deps = deps
        self.backfill = backfill
        self.selection = BackfillSelection.of(backfill)
        self.store = BackfillStore(deps.factory)
        self.segments = BackfillSegmentStore(deps.factory, deps.ledger)
        self.troubled = False
        options = ExtractOptions(
            source_id=backfill.source_id,
            since_iso=self.selection.since_iso,
            force=self.selection.force,
            job_id=deps.job_id,
            max_output_tokens=deps.max_output_tokens,
            default_max_facts=deps.default_max_facts,
        )
        self.run = ExtractionRun(
            self.segments,
            options,
            deps.config,
            deps.budget,
            guard=deps.guard,
            on_facts_committed=deps.on_facts_committed,
        )

    # --- planning -----------------------------------------------------------------------------------

    def planner(self) -> BackfillPlanner:
        deps = self.deps
        bounds = BatchBounds(deps.max_requests, deps.max_bytes, deps.max_output_tokens)
        return BackfillPlanner(self.run, self.selection, self.store, deps.client, bounds)

    def plan(self) -> None:
        """Store every batch and request of the backfill (worker.extraction.backfill_plan)."""
        self.planner().plan(self.backfill.id)

    # --- sending ------------------------------------------------------------------------------------

    def page_plan(self, page_id: int, slug: str) -> PagePlan | None:
        return self.run.plan(PageRef(page_id, slug, 0), finish=False)

    def requests_to_send(self, batch: BatchRow) -> dict[str, ChatRequest]:
        """The batch's requests rebuilt from their pages as they are now. What the page can no longer
        use is dropped, never sent: a request whose segment changed (an edit before sending), those
        after it, all of a page now re-extracted whole that they do not cover, and a page another live
        backfill has requests out for."""
        requests: dict[str, ChatRequest] = {}
        dropped: dict[bool, list[int]] = {True: [], False: []}  # by whether another backfill took the page
        # A page another live backfill sent requests for since this one planned it (this one's job had
        # failed, and was retried): paid twice, and the second to collect discarded its results. (Only
        # sent ones: two both still unsent would each drop the page, and neither extract it.)
        taken = self.store.pages_in_flight(but=self.backfill.id, sent_only=True)
        for (page_id, slug), rows in group_by_page(self.store.pending_requests(batch.id)):
            plan = None if page_id in taken else self.page_plan(page_id, slug)
            if plan is not None:
                run = matching_run(plan, rows)
                if plan.replace and len(run) < len(plan.segments):
                    run = []  # swapped only once every segment has its result: a part buys nothing
                for _, segment, row in run:
                    requests[row.custom_id] = segment_request(
                        plan.label, segment, self.run.max_facts, self.deps.max_output_tokens
                    )
            dropped[page_id in taken] += [row.id for row in rows if row.custom_id not in requests]
        self.store.leave_pages(self.backfill.id, dropped[True])  # counted as left to the other backfill
        self.store.mark_requests(dropped[False], "dropped")
        return requests

    def send(self, batch: BatchRow) -> bool:
        """Send one stored batch, at most once: a batch whose send began is looked up first. False when
        it waits for the batches in flight (the budget), and the batches after it wait too."""
        client = self.deps.client
        if self.held_elsewhere(batch):
            return False  # the batches after it wait too
        if batch.since_failed_send is not None and batch.since_failed_send < RESEND_AFTER_SECONDS:
            logger.info(
                "backfill %s: batch %s is sent again %.0f s after its send failed",
                self.backfill.id, batch.key, RESEND_AFTER_SECONDS - batch.since_failed_send,
            )  # fmt: skip
            self.troubled = True
            return False  # the batches after it wait too (and it is looked up then, not each pass)
        if batch.status == "submitting":
            found = client.find(batch.key, batch.submit_started_at)
            if found is UNDETERMINED:
                logger.info(
                    "batch %s: the provider cannot tell yet whether it holds it; next pass", batch.key
                )
                return True
            if isinstance(found, str):
                logger.info("batch %s was accepted before its sender died: %s", batch.key, found)
                if not self.store.record_sent(batch.id, found):
                    self.second_copy(batch, found)
                return True
        if batch.status == "submitting" or batch.since_failed_send is not None:
            # No batch holds it: what an earlier send uploaded (its create failed, or timed out) is the
            # pages' text, named nowhere; it goes before the batch is sent again.
            forget_uploads(self.deps.client, batch.key)
        # Before the requests are rebuilt (the batch's pages read and parsed again, each poll it waits).
        if not limits.within_budget(self, batch, Decimal(0)):
            self.deps.budget.check(self.deps.job_id)  # spent: the job pauses for budget, not batches
            return False
        requests = self.requests_to_send(batch)
        if not requests:
            # (Unless another run sent it meanwhile: then it is polled as sent.)
            self.store.set_batch(
                batch.id, unsent_only=True, status="collected", provider_status="nothing to send"
            )
            return True
        self.deps.budget.check(self.deps.job_id)  # spent already: the job pauses for budget
        estimate = estimated_batch_cost(client.model, requests.values(), self.deps.ledger.prices())
        if not limits.within_budget(self, batch, estimate):
            return False
        self.run.check_switch()  # switched off during a pass: the job pauses and this batch waits, unsent
        self.deps.guard()
        # Committed before the provider hears of it; counted against the budgets until collected. Not
        # when another run recorded its send meanwhile (it is sent: this run has nothing to do), nor once
        # a cancel was asked (then the batch is cancelled here).
        began = self.store.set_batch(
            batch.id,
            unsent_only=True,
            status="submitting",
            estimated_cost_usd=estimate,
            provider=client.provider,  # where it goes: planned under another, it was never sent
            model=client.model,
        )
        if not began:
            if self.cancelling():  # cancelled now, not at the next poll (the job paused "waiting")
                self.cancel(batch)
            return True
        try:
            provider_id = client.submit(list(requests.items()), key=batch.key)
        except LLMError as exc:
            failed: dict[str, Any] = {"provider_status": f"{SEND_FAILED} ({type(exc).__name__})"}
            failed["submit_started_at"] = func.now()  # the resend waits from the failure, not the start
            # Refused outright (a 4xx): nothing at the provider, nothing in flight; left "submitting",
            # its estimate counted in flight for good though no batch held it. Any other error (no
            # status: the create's answer could not be read) may follow an accepted create: it stays
            # "submitting", looked up by its key before any resend (else a second, paid copy).
            if not exc.retryable and exc.status is not None and 400 <= exc.status < 500:
                failed |= {"status": "planned", "estimated_cost_usd": None}
            if not self.store.set_batch(batch.id, unsent_only=True, **failed):
                return True  # another run's send is recorded: the batch is in flight, not failed
            raise
        if not self.store.record_sent(batch.id, provider_id):
            self.second_copy(batch, provider_id)
            return True
        logger.info("backfill %s sent batch %s (%d requests)", self.backfill.id, provider_id, len(requests))
        return True

    def second_copy(self, batch: BatchRow, provider_id: str) -> None:
        """Another run recorded this batch's send while this one sent it (its lease lapsed in a long
        upload): this copy is cancelled, its delete owed (overwritten, the first was never collected)."""
        logger.warning(
            "backfill %s: batch %s was sent by another run meanwhile; cancelling this run's copy %s",
            self.backfill.id, batch.key, provider_id,
        )  # fmt: skip
        # Owed first: a worker that dies in the cancel leaves it on record, to be deleted once it ends.
        copies = ProviderCopies(self.deps.factory)
        copies.owe(self.deps.client.provider, provider_id, "a second copy of a batch sent by another run")
        try:
            self.deps.client.cancel(provider_id)
        except LLMError as exc:
            logger.warning("cancelling the second copy %s failed (%s)", provider_id, exc)

    def cancel(self, batch: BatchRow) -> bool:
        """Cancel one batch: unsent ones never go; sent ones are cancelled at the provider, then collected
        as usual (what they finished was paid for). False: it is asked again next pass (refused, its
        state unknown now, or collected as gone), which ends neither this pass nor the job."""
        if self.held_elsewhere(batch):
            return True  # that run cancels it
        if batch.status == "submitting":
            found = self.deps.client.find(batch.key, batch.submit_started_at)
            if found is UNDETERMINED:
                return False
            if isinstance(found, str):
                if not self.store.record_sent(batch.id, found):
                    self.second_copy(batch, found)
                    return True
                batch = replace(batch, status="submitted", provider_batch_id=found)
        if batch.provider_batch_id is None:
            if batch.status == "submitting" or batch.since_failed_send is not None:
                # What an earlier send uploaded (the pages' text), which no batch holds and no send will
                # now: left at the provider for good before.
                forget_uploads(self.deps.client, batch.key)
            # Not one another run recorded a send of meanwhile: that one is cancelled at the provider
            # by the pass (next), as every sent batch is.
            self.store.set_batch(batch.id, unsent_only=True, status="cancelled")
            return True
        status = self.status_of(batch)
        if status is None:
            return False
        if status.ended or status.status in WINDING_DOWN:
            return True
        try:
            self.deps.client.cancel(batch.provider_batch_id)
        except LLMError as exc:  # it may have ended meanwhile: polling, as the pass goes on, will tell
            logger.warning("cancelling batch %s failed (%s); next pass", batch.provider_batch_id, exc)
            return False
        return True

    # --- collecting ---------------------------------------------------------------------------------

    def poll(self, batch: BatchRow) -> None:
        assert batch.provider_batch_id is not None
        if self.held_elsewhere(batch):
            return
        self.deps.guard()
        status = self.status_of(batch)
        if status is None:
            return
        if not status.ended:
            self.store.set_batch(batch.id, provider_status=status.status)
        elif not limits.planned_again(self, batch, status):  # (the queued-token limit: sent again later)
            self.collect(batch, status.said())  # a batch failed as a whole keeps why (`backfill show`)

    def status_of(self, batch: BatchRow) -> BatchStatus | None:
        """A sent batch's status at the provider; None when it holds the batch no more (``not_found``)
        or a passing fault hid it (asked again next pass: one batch's 429 ended the whole pass)."""
        assert batch.provider_batch_id is not None
        try:
            return self.deps.client.status(batch.provider_batch_id)
        except LLMError as exc:
            if exc.status == 404:
                self.not_found(batch)
                return None
            if not exc.retryable:
                raise
            logger.warning("asking for batch %s failed (%s); next pass", batch.provider_batch_id, exc)
            return None

    def collect(self, batch: BatchRow, provider_status: str, *, fetch: bool = True) -> None:
        """Commit an ended batch's results page by page (the kill switch is read before each page);
        without ``fetch`` (the provider holds the batch no more) its pending requests are missing."""
        assert batch.provider_batch_id is not None
        pending = self.store.pending_requests(batch.id)
        items: dict[str, BatchItem] = {}
        if pending and fetch:  # none left: a pass that died after committing them (the copy may be gone)
            generic = extraction_request([first_turn("")], self.run.max_facts, self.deps.max_output_tokens)
            asked = {r.custom_id: generic for r in pending}
            items = limits.results_kept(self.deps.client, batch.provider_batch_id, asked)
        # Anthropic says "ended" of a cancelled batch too: the backfill's own request says it was cancelled.
        cancelled = provider_status in ("cancelled", "canceling") or self.cancelling()
        missing = "cancelled" if cancelled else "expired"
        for (page_id, slug), rows in group_by_page(pending):
            self.run.check_switch()
            self.deps.guard()
            self.commit_page(page_id, slug, rows, items, missing)
        # Before the batch is marked collected, so a pass that dies in between deletes it next time.
        discard_batch(self.deps.client, batch.provider_batch_id, ProviderCopies(self.deps.factory))
        self.store.set_batch(batch.id, status="collected", provider_status=provider_status)
        logger.info(
            "backfill %s collected batch %s (%s)", self.backfill.id, batch.provider_batch_id, provider_status
        )

    def commit_page(
        self, page_id: int, slug: str, rows: Sequence[RequestRow], items: dict[str, BatchItem], missing: str
    ) -> None:
        plan = self.page_plan(page_id, slug)
        if plan is not None:
            try:
                self.run.committer.finish(
                    self.run.committer.commit_page(plan, one_at_a_time(self.results(plan, rows, items)))
                )
            except CheckpointConflictError as exc:  # another run moved the page on: these are discarded
                # The page by id and the error by class: its text names the slug, and logs name none.
                logger.info(
                    "backfill %s: page %s %s; its results are discarded",
                    self.backfill.id,
                    page_id,
                    type(exc).__name__,
                )
            finally:
                self.segments.marking = None
                self.segments.forget_held()
        left = self.store.still_pending([row.id for row in rows])
        no_result = []
        for row in rows:
            if row.id not in left:
                continue
            item = items.get(row.custom_id)
            if item is None:
                no_result.append(row.id)
                continue
            result = batch_segment_result(
                item, self.deps.client, self.run.max_facts, self.deps.max_output_tokens
            )
            self.segments.record_discarded_result(
                row.id, self.deps.job_id, (page_id, self.backfill.source_id, slug), result.attempts
            )
        self.store.mark_requests(no_result, missing)

    def results(
        self, plan: PagePlan, rows: Sequence[RequestRow], items: dict[str, BatchItem]
    ) -> SegmentResults:
        """The page's results from its next segment on, while each is the one its request asked for."""
        for index, segment, row in matching_run(plan, rows):
            item = items.get(row.custom_id)
            if item is None:
                return
            result = batch_segment_result(
                item, self.deps.client, self.run.max_facts, self.deps.max_output_tokens
            )
            self.run.counters.add_calls(result)
            self.segments.marking = (row.id, "done" if result.ok else "failed")
            yield index, segment, result
            self.segments.marking = None

    # --- the pass -----------------------------------------------------------------------------------

    def run_pass(self) -> PassResult:
        backfill = self.backfill
        if backfill.status in ("done", "cancelled"):
            return PassResult(True, 0, backfill.status)
        if backfill.status == "planning":
            if backfill.cancel_requested:
                self.store.finish(backfill.id, "cancelled")
                return PassResult(True, 0, "cancelled")
            self.plan()
        stopped, failed_batch = self.send_planned()
        for batch in self.store.batches(backfill.id, ("submitted",)):
            if self.cancelling():
                self.cancel(batch)
            self.poll(batch)
        open_batches = len(self.store.batches(backfill.id))
        flying = [
            b for b in self.store.batches(backfill.id, ("submitting", "submitted")) if b.id != failed_batch
        ]
        if stopped is not None and not flying:
            # Nothing in flight (else it waits on them): a budget's pause, an outage, or the send retried.
            if isinstance(stopped, BudgetExhaustedError) or provider_cannot_serve(stopped):
                raise stopped
            raise BatchSendFailedError(str(stopped))
        if open_batches:
            return PassResult(False, open_batches, "running", troubled=self.troubled)
        status = "cancelled" if self.cancelling() else "done"
        self.store.finish(backfill.id, status)
        return PassResult(True, 0, status)

    def send_planned(self) -> tuple[LLMError | None, int | None]:
        """Send the stored batches in order until one waits (so do the ones after it) or fails: (the
        error that stopped the sending, the batch whose send failed). The pass polls the batches sent
        before, then decides what the error means (it once stopped the pass before the polling)."""
        for batch in self.store.batches(self.backfill.id, ("planned", "submitting")):
            if self.cancelling():  # read again before each: a cancel during the pass sends no more
                self.cancel(batch)
                continue
            try:
                if limits.waits_for_room(self) or not self.send(batch):  # (the batches after it wait too)
                    return None, None
            except BudgetExhaustedError as exc:
                return exc, None
            except LLMError as exc:
                logger.warning(
                    "backfill %s: sending batch %s failed (%s); the batches in flight are polled",
                    self.backfill.id, batch.key, type(exc).__name__,
                )  # fmt: skip
                self.troubled = True
                return exc, batch.id
        return None, None

    def not_found(self, batch: BatchRow) -> None:
        """The provider answers 404 for a sent batch. With none of its requests pending (Anthropic deletes
        a batch itself on discard: a pass that died between the delete and marking it collected met a 404
        on every pass after), sent longer ago than the provider keeps a batch, or the backfill cancelled,
        it is collected, what it owed missing. Otherwise it is left: a key of another project or workspace
        of the same provider cannot see it (collected as gone, the backfill ended "done" while the batch
        ran on, billed, its results never read)."""
        sent, kept = batch.submit_started_at, PROVIDER_KEEPS.get(batch.provider)
        kept_no_more = sent is not None and kept is not None and datetime.now(UTC) - sent > kept
        if kept_no_more or not self.store.has_pending(batch.id) or self.cancelling():
            self.collect(batch, GONE, fetch=False)
        else:
            said = "configure the key that sent it (cancelled, the backfill counts what it owes missing"
            self.stuck(batch, f"not found at {batch.provider}: {said}; the batch runs on under that key)")

    def held_elsewhere(self, batch: BatchRow) -> bool:
        """Whether ``batch`` went (or began to go) to another provider than the one configured now. It
        is left as it is: asked of this provider, it was "gone" (404), its paid results were counted
        expired, and the other provider kept the pages' text; one whose send began was sent again."""
        if batch.status == "planned" or batch.provider == self.deps.client.provider:
            return False
        self.stuck(batch, f"held at {batch.provider}: configure that provider again to collect it")
        return True

    def stuck(self, batch: BatchRow, why: str) -> None:
        """``batch`` is left as it is for ``why`` (``backfill show`` says it); the job waits, troubled."""
        logger.warning("backfill %s: batch %s is %s", self.backfill.id, batch.key, why)
        if batch.since_failed_send is None:  # a failed send's marker times its resend: kept
            self.store.set_batch(batch.id, provider_status=why)
        self.troubled = True

    def cancelling(self) -> bool:
        """Whether the backfill is to stop: read again each time until it is (the backfill was loaded
        when the pass began, and a cancel during the pass went unseen: every unsent batch still went)."""
        if not self.backfill.cancel_requested and self.store.cancel_requested(self.backfill.id):
            self.backfill.cancel_requested = True
        return self.backfill.cancel_requested


def run_backfill_pass(deps: BackfillDeps, backfill_id: int) -> PassResult:
    """One pass of the backfill (see the module docstring); raises BackfillNotFoundError for an
    unknown id."""
    backfill = BackfillStore(deps.factory).load(backfill_id)
    if backfill is None:
        raise BackfillNotFoundError(f"no backfill {backfill_id}")
    return BackfillPass(deps, backfill).run_pass()
