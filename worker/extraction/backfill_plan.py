"""A backfill's planning: the selected pages' pending segments stored as batches of requests, once."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from worker.core import progress
from worker.core.checkpoint import segment_hash
from worker.core.conversation import segment_bytes
from worker.extraction.backfill_request import BackfillSelection
from worker.extraction.backfill_rows import PlannedBatch, PlannedRequest
from worker.extraction.backfill_store import BackfillStore
from worker.extraction.batch import request_overhead_bytes
from worker.extraction.planner import PagePlan
from worker.extraction.service import ExtractionRun
from worker.llm.batch_api import BatchLLMClient

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchBounds:
    """What one provider batch may hold, and each request's output cap (a request's bytes depend on it)."""

    max_requests: int
    max_bytes: int
    max_output_tokens: int


class BackfillPlanner:
    """Plans a backfill's pages one at a time and stores its batches (pages never split across two)."""

    def __init__(
        self,
        run: ExtractionRun,
        selection: BackfillSelection,
        store: BackfillStore,
        client: BatchLLMClient,
        bounds: BatchBounds,
    ) -> None:
        self.run = run
        self.selection = selection
        self.store = store
        self.client = client
        self.bounds = bounds
        self.left_to_others = 0  # pages ``plans`` left to another backfill (its last run's)

    def plans(
        self, enough: Callable[[], bool] = lambda: False, backfill_id: int | None = None
    ) -> Iterator[PagePlan]:
        """The selected pages' plans, in slug order, one at a time (a plan holds its page's messages:
        the list of them all held a whole corpus's text at once, and a worker out of memory planned
        again from scratch on every retry). Not a page another backfill still has requests out for:
        two overlapping backfills (a source and a prefix of it, a repeated request) paid for its
        segments twice, and the second to collect discarded its results."""
        taken = self.store.pages_in_flight(but=backfill_id or 0)
        skipped = self.left_to_others = 0
        for ref in self.run.list_pages():
            if enough():  # asked before each page is read: the rest of the corpus is not loaded
                break
            if self.selection.slug is not None and ref.slug != self.selection.slug:
                continue
            if self.selection.slug_prefix and not ref.slug.startswith(self.selection.slug_prefix):
                continue
            if ref.page_id in taken:
                skipped += 1
                continue
            progress.mark()  # planning a large selection reaches no job check for a while: no stall
            plan = self.run.plan(ref)
            if plan is not None:
                yield plan
        self.left_to_others = skipped
        if skipped:
            logger.info(
                "backfill %s: %d page(s) left to the other backfill extracting them", backfill_id, skipped
            )

    def plan(self, backfill_id: int) -> None:
        """Store every batch and request of the backfill; pages are never split across two batches
        (a page longer than a batch, or past ``max_segments``, sends its first segments only)."""
        client = self.client
        limit = self.selection.max_segments
        overhead = request_overhead_bytes(self.run.max_facts, self.bounds.max_output_tokens)
        tag = uuid.uuid4().hex[:8]
        batches: list[tuple[str, list[PlannedRequest]]] = []  # (key, requests)
        sizes: list[int] = []  # each batch's bytes, bounded above
        total = 0
        # Counted by what is planned: a page left for another run takes none of it. The check reads
        # ``total`` as it stands when the next page is about to be read (late binding is the point).
        for plan in self.plans(lambda: limit is not None and total >= limit, backfill_id):  # noqa: B023
            room = self.bounds.max_requests if limit is None else min(self.bounds.max_requests, limit - total)
            requests, size = self.page_requests(plan, room, overhead, backfill_id)
            if not requests:
                continue
            full = bool(batches) and len(batches[-1][1]) + len(requests) > self.bounds.max_requests
            if not batches or full or sizes[-1] + size > self.bounds.max_bytes:
                batches.append((f"fm{tag}b{backfill_id}n{len(batches)}", []))
                sizes.append(0)
            # Named once, as they join their batch: the plan is held in memory once (held unnamed, then
            # named, a million requests were twice the memory until the plan was stored).
            key, held = batches[-1]
            held += (replace(r, custom_id=f"{key}-p{r.page_id}-m{r.end_message}") for r in requests)
            sizes[-1] += size
            total += len(requests)
        planned = [PlannedBatch(key, client.provider, client.model, held) for key, held in batches]
        self.store.store_plan(backfill_id, planned, left_to_others=self.left_to_others)
        logger.info("backfill %s planned %d request(s) in %d batch(es)", backfill_id, total, len(planned))

    def page_requests(
        self, plan: PagePlan, room: int, overhead: int, backfill_id: int
    ) -> tuple[list[PlannedRequest], int]:
        """The page's first ``room`` requests, as many as one batch's bytes hold (a page longer than a
        batch sends its first segments only), and their bytes (bounded above)."""
        requests: list[PlannedRequest] = []
        size = 0
        for i, segment in enumerate(plan.segments[:room]):
            cost = overhead + segment_bytes(segment, plan.label)
            if requests and size + cost > self.bounds.max_bytes:
                break
            requests.append(PlannedRequest("", plan.page_id, plan.slug, plan.ends[i], segment_hash(segment)))
            size += cost
        if plan.replace and len(requests) < len(plan.segments):
            # A page whose facts are replaced whole (edited, or forced) is swapped only once every
            # segment has its result: cut short, its results were paid for, its requests marked done,
            # and nothing was stored. It waits for a run with room for all of it.
            logger.info(
                "backfill %s: page %s is re-extracted whole (%d segments) and does not fit what is "
                "left of this backfill; it waits for another run",
                backfill_id,
                plan.page_id,
                len(plan.segments),
            )
            return [], 0
        return requests, size
