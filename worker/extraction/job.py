"""The extraction job kind: what one extraction job does between claim and finish."""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from typing import cast

from worker.config_store import EXTRACTION_ENABLED
from worker.consolidation import consolidate_page_entities, consolidate_pages_entities
from worker.extraction.committer import FactsCommitted
from worker.extraction.options import CheckpointConflictError, ExtractionCounters, ExtractOptions
from worker.extraction.service import extract_conversation_facts
from worker.extraction.store import ExtractionStore
from worker.jobs.lifecycle import JobContext, WorkResult
from worker.jobs.maintenance import sweep_step
from worker.jobs.outbox import BUDGET, EXTRACTION, RETRY_SKIPPED, split_page_subject
from worker.jobs.registry import ErrorRule, JobKind, register
from worker.llm.gateway import embeds_new_facts
from worker.runtime import Runtime
from worker.search import embed_pages_facts, pages_with_late_facts

logger = logging.getLogger(__name__)

EMBED_FOLLOW_UP = "embed-new-facts"


def embed_in_background(rt: Runtime) -> FactsCommitted:
    """Once a page's facts commit, embed them on the process's follow-up threads (several pages per
    embedding call), so vector search finds them a moment later while the job goes on: it never
    waits on the embedding model. Never fails the job (``vectors_caught_up`` embeds what this misses)."""
    embed = _embedding(rt)

    def committed(source_id: str, slug: str, inserted: int) -> None:
        rt.follow_ups.submit(EMBED_FOLLOW_UP, (source_id, slug), embed)

    return committed


def _embedding(rt: Runtime) -> Callable[[list[Hashable]], None]:
    """The follow-up's work on a run of pages: their facts without a vector embedded, then (once the
    vectors exist: the candidates use them) one consolidation request for all of them."""
    batch_size, concurrency = rt.settings.search_embed_batch_size, rt.settings.search_embed_concurrency

    def embed(pages: list[Hashable]) -> None:
        embed_pages_facts(
            rt.factory,
            rt.llm,
            pages,  # type: ignore[arg-type]
            batch_size,
            ledger=rt.ledger,
            concurrency=concurrency,
        )
        if rt.settings.consolidate_after_extraction:
            consolidate_pages_entities(rt.factory, cast(list[tuple[str, str]], pages))

    return embed


# Facts stored this long ago still without a vector (their follow-up embeds them within seconds) go to
# the follow-up again from the sweep: the day's budget was spent, the embedding model was down, the
# worker died. Older than a day they wait for `factmill embed`; a sweep reads at most
# VECTORS_CATCH_UP_SCAN of them.
VECTORS_CATCH_UP_GRACE_SECONDS = 120.0
VECTORS_CATCH_UP_WINDOW_SECONDS = 86_400.0
VECTORS_CATCH_UP_SCAN = 1_000


@sweep_step("vectors_caught_up")
def vectors_caught_up(rt: Runtime) -> int:
    """Each sweep: the pages whose facts an embedding follow-up left without a vector go to this
    process's follow-up (only `factmill embed` filled them in, and until then vector search never found
    those facts); how many pages. Nothing while the budget is spent. The follow-up's threads make the
    calls: the sweep never waits on the embedding model (a model down held the maintenance worker for
    the gateway's whole retry), and a page it already has is not queued twice."""
    if not embeds_new_facts(rt.settings) or not rt.budget.has_room():
        return 0  # (a deployment with no embeddings model read a day of facts each sweep, to fail)
    pages = pages_with_late_facts(
        rt.factory,
        grace_seconds=VECTORS_CATCH_UP_GRACE_SECONDS,
        window_seconds=VECTORS_CATCH_UP_WINDOW_SECONDS,
        scan=VECTORS_CATCH_UP_SCAN,
    )
    embed = _embedding(rt)
    for page in pages:
        rt.follow_ups.submit(EMBED_FOLLOW_UP, page, embed)
    if pages:
        logger.info(
            "%s page(s) had facts an embedding follow-up left without a vector: embedding them", len(pages)
        )
    return len(pages)


def embedding_follows(rt: Runtime, counters: ExtractionCounters) -> bool:
    """This run's new facts go to the embedding follow-up, which requests their consolidation."""
    return bool(counters.facts_inserted) and embeds_new_facts(rt.settings)


def extract_page(ctx: JobContext) -> WorkResult:
    rt, job = ctx.rt, ctx.job
    settings = rt.settings
    source_id, slug = split_page_subject(job.subject)
    options = ExtractOptions(
        source_id=source_id,
        slug=slug,
        force=bool(ctx.option("force", False)),
        retry_skipped=bool(ctx.option(RETRY_SKIPPED, False)),
        job_id=job.id,
        max_output_tokens=settings.llm_max_output_tokens,
        default_max_facts=settings.extraction_max_facts,
    )
    store = ExtractionStore(rt.factory, rt.ledger)
    counters = extract_conversation_facts(
        store,
        rt.llm,
        options,
        rt.config,
        rt.budget,
        guard=ctx.guard,
        lease=ctx.lease,
        pipe=rt.llm_pipe,
        on_facts_committed=embed_in_background(rt) if embeds_new_facts(rt.settings) else None,
        memory=rt.page_memory,
    )
    counters_dict = counters.as_dict()
    waiting = [p for p in counters.pages if p.outcome == "budget_exhausted"]
    if waiting:
        # Not a failure: the job waits (paused) and resumes when the budget has room again.
        return WorkResult(
            "paused",
            counters=counters_dict,
            note=waiting[0].reason,
            pause_reason=BUDGET,
            detail="waiting for LLM budget",
        )
    if counters.pages_failed:
        failed = [p for p in counters.pages if p.status == "failed"]
        reason = "; ".join(p.reason for p in failed)
        # A provider outage or a spent account (llm.errors.provider_cannot_serve) is nobody's fault (as
        # worker.jobs.lifecycle's rule for an LLMError raised): the job waits it out on its outage clock
        # (worker.jobs.outages), where its five attempts failed every job in flight within minutes.
        away = all(p.provider_away for p in failed)
        return WorkResult(
            "outage" if away else "retry",
            counters=counters_dict,
            note=reason,
            # (An outage that began mid-run, not the page's. A page re-extracted whole commits at its end:
            # segments held for the swap were answered but are not kept, so the run cannot say: the clock
            # runs on, neither restarted (every run paid for them again) nor an attempt spent (it was).)
            progressed=True
            if counters.segments_processed + counters.segments_skipped > 0
            else (None if any(p.held for p in failed) else False),
        )
    if settings.consolidate_after_extraction and not embedding_follows(rt, counters):
        # Lifecycle: one consolidation job per entity of the page's unconsolidated facts and of its
        # source's orphaned links. On every successful run, not only when facts went in: a run that
        # dies after its commits leaves them pending, and its retry requests them; a page that stopped
        # being extracted (its type changed) took facts that others pointed to. When this run's facts
        # are being embedded, the follow-up requests it once their vectors exist (its candidates use them).
        consolidate_page_entities(rt.factory, source_id, slug)
    note = None
    if counters.pages_considered == 0:
        note = "nothing to extract: the page is gone or is not a conversation type"
    elif counters.segments_skipped:
        note = (
            f"{counters.segments_skipped} segment(s) skipped after failing permanently (their audit rows "
            f"say why); `factmill jobs retry {job.id} --skipped` re-extracts them"
        )
    return WorkResult("succeeded", counters=counters_dict, note=note)


KIND = register(
    JobKind(
        name=EXTRACTION,
        task_name="tasks.extraction.extract_page",
        queue="extraction",
        switch=EXTRACTION_ENABLED,
        work=extract_page,
        errors=(ErrorRule(CheckpointConflictError, "retry"),),
        one_run_options=("force", RETRY_SKIPPED),
    )
)
