"""The batch_extraction job kind: one pass of a backfill per run; it waits (paused) while batches run."""

from __future__ import annotations

import logging
from dataclasses import replace

from models.backfill import BATCH_STATUSES
from worker.config_store import EXTRACTION_ENABLED
from worker.consolidation import consolidate_pages_entities
from worker.core.errors import error_summary
from worker.extraction.backfill import BackfillDeps, BackfillPass, run_backfill_pass
from worker.extraction.backfill_admin import backfill_report
from worker.extraction.backfill_request import (
    BATCH_EXTRACTION,
    BATCH_FAULT,
    WAITING_FOR_BATCHES,
    BackfillNotFoundError,
    BatchSendFailedError,
)
from worker.extraction.backfill_store import BackfillStore
from worker.extraction.committer import FactsCommitted
from worker.extraction.job import embed_in_background
from worker.extraction.options import CheckpointConflictError
from worker.jobs.lifecycle import JobContext, WorkResult, paused_reason
from worker.jobs.registry import KILL_SWITCH, ErrorRule, JobKind, KillSwitchOffError, register
from worker.llm.batches import BatchLLMClient, batch_unavailable, open_batch_client
from worker.llm.errors import BudgetExhaustedError, LLMError
from worker.llm.gateway import LLMConfigurationError, embeds_new_facts
from worker.runtime import Runtime

logger = logging.getLogger(__name__)


def follow_ups(rt: Runtime) -> tuple[FactsCommitted | None, list[tuple[str, str]]]:
    """What follows a page's commit, as after an online run: its facts embedded (and then its entities
    consolidated), or, without embedding, its entities consolidated once the pass ends (the pages to
    request are gathered in the list). A backfill's whole-page swap deletes the page's old facts: the
    facts of other pages they had closed are current again only once consolidation repairs them."""
    if embeds_new_facts(rt.settings):
        return embed_in_background(rt), []
    pages: list[tuple[str, str]] = []
    if not rt.settings.consolidate_after_extraction:
        return None, pages
    return lambda source_id, slug, inserted: pages.append((source_id, slug)), pages


def pass_deps(ctx: JobContext, client: BatchLLMClient, committed: FactsCommitted | None) -> BackfillDeps:
    rt, settings = ctx.rt, ctx.rt.settings
    return BackfillDeps(
        rt.factory,
        rt.ledger,
        rt.config,
        rt.budget,
        client,
        ctx.job.id,
        max_requests=settings.backfill_batch_max_requests,
        max_bytes=settings.backfill_batch_max_bytes,
        max_output_tokens=settings.llm_max_output_tokens,
        default_max_facts=settings.extraction_max_facts,
        guard=ctx.guard,
        on_facts_committed=committed,
    )


def backfill_pass(ctx: JobContext) -> WorkResult:
    """One pass of the backfill. While the provider holds batches of it, an error that would end the
    job (a worker's settings that leave it no batch API, a key the provider refuses, an outage past its
    patience, a download that times out) makes it wait on them instead, its note saying why: failed,
    nothing polled it again, and the batches' paid results were never collected, their copies (page
    text) never deleted nor owed, and their estimate counted in flight for good. The beat's poll asks
    again until the fault is mended."""
    try:
        return _one_pass(ctx)
    except (LLMConfigurationError, LLMError) as exc:
        if isinstance(exc, BudgetExhaustedError):  # a pause of its own, woken when the budget has room
            raise

        backfill_id = int(ctx.option("backfill"))
        sent = BackfillStore(ctx.rt.factory).batches(backfill_id, ("submitting", "submitted"))
        # (Not a batch whose send failed and no provider took: it is sent again by the pass.)
        held = [b for b in sent if b.provider_batch_id is not None or b.since_failed_send is None]
        if not held:
            raise
        logger.warning(
            "backfill %s: %s with %d batch(es) at the provider; waiting on them", backfill_id,
            type(exc).__name__, len(held),
        )  # fmt: skip
        return WorkResult(
            "paused",
            note=(
                f"{len(held)} batch(es) of backfill {backfill_id} are at the provider, and asking about "
                f"or collecting them failed: {error_summary(exc)}; tried again every "
                f"{ctx.rt.settings.backfill_poll_seconds:g}s until that is mended"
            ),
            pause_reason=BATCH_FAULT,
            detail="waiting for provider batches it cannot ask about",
            progressed=None,  # (not an outage's wait: the outage clock is not kept through it)
        )


def _one_pass(ctx: JobContext) -> WorkResult:
    rt, settings = ctx.rt, ctx.rt.settings
    backfill_id = int(ctx.option("backfill"))
    unavailable = batch_unavailable(settings)
    if unavailable is not None:  # this worker's settings, which may differ from the API's that took it
        raise LLMConfigurationError(unavailable)
    committed, to_consolidate = follow_ups(rt)
    before = _batch_marks(rt, backfill_id)
    with open_batch_client(settings) as client:
        deps = pass_deps(ctx, client, committed)
        try:
            result = run_backfill_pass(deps, backfill_id)
        finally:
            if to_consolidate:  # what committed, even when the pass then stopped on an error
                consolidate_pages_entities(rt.factory, list(dict.fromkeys(to_consolidate)))
    report = backfill_report(rt.factory, backfill_id)
    left = report["pages_left_to_others"]
    counters = {
        "backfill": backfill_id,
        "requests": report["requests"],
        "cost_usd": report["cost_usd"],
        "pages_left_to_others": left,
    }
    if result.finished:
        others = f"; {left} page(s) left to an overlapping backfill" if left else ""
        return WorkResult(
            "succeeded", counters=counters, note=f"backfill {backfill_id} {result.status}{others}"
        )
    # The pass ran through: errors of earlier passes are behind it (not when a send failed or waits to be
    # tried again: a send that keeps failing ends the job once nothing is in flight). Troubled, whether
    # a batch moved on (sent, collected: None) or nothing did (False: the outage clock runs on).
    progressed: bool | None = True
    if result.troubled:
        progressed = None if _batch_marks(rt, backfill_id) != before else False
    return WorkResult(
        "paused",
        counters=counters,
        note=(
            f"waiting for {result.open_batches} provider batch(es) of backfill {backfill_id}; "
            f"polled every {settings.backfill_poll_seconds:g}s"
        ),
        pause_reason=WAITING_FOR_BATCHES,
        detail="waiting for provider batches",
        progressed=progressed,
    )


def _batch_marks(rt: Runtime, backfill_id: int) -> list[tuple[int, str | None, bool]]:
    """Where each of the backfill's batches stands: sent (the provider's id) and ended. A pass that moved
    none went nowhere (a send that failed moves none: it leaves the batch "submitting")."""
    rows = BackfillStore(rt.factory).batches(backfill_id, BATCH_STATUSES)
    return [(row.id, row.provider_batch_id, row.status in ("collected", "cancelled")) for row in rows]


def cancel_open_batches(deps: BackfillDeps, backfill_id: int) -> tuple[int, int, int]:
    """A cancelled backfill's batches cancelled (unsent ones never go), nothing collected: (how many,
    how many the provider did not cancel now: asked again by the next pass, how many it holds no
    more: collected by the next pass, the switch being off)."""
    backfill = BackfillStore(deps.factory).load(backfill_id)
    if backfill is None or not backfill.cancel_requested or backfill.status in ("done", "cancelled"):
        return 0, 0, 0
    run = BackfillPass(deps, backfill)
    batches = run.store.batches(backfill_id, ("planned", "submitting", "submitted"))
    asked_again: list[int] = []
    gone = 0
    for batch in batches:  # one's failure leaves the others' cancels to go on
        try:
            if not run.cancel(batch):
                asked_again.append(batch.id)
        except LLMError as exc:
            asked_again.append(batch.id)
            logger.warning("backfill %s: cancelling batch %s failed (%s)", backfill_id, batch.key, exc)
        except KillSwitchOffError:  # gone at the provider: its collection reads the switch and waits
            gone += 1
    if asked_again:  # one gone with nothing pending was collected at once: gone, not refused
        still_open = {
            batch.id for batch in run.store.batches(backfill_id, ("planned", "submitting", "submitted"))
        }
        gone += sum(1 for batch_id in asked_again if batch_id not in still_open)
        asked_again = [batch_id for batch_id in asked_again if batch_id in still_open]
    return len(batches), len(asked_again), gone


def cancel_while_switched_off(ctx: JobContext) -> WorkResult:
    """A backfill cancelled while extraction is switched off: its batches are cancelled at the provider
    now (the switch held the cancel back, and they ran on, paid for, for up to a day); what they
    finished is collected once the switch is on again. Otherwise it pauses for the switch as any job.
    A batch the provider refuses to cancel is asked again by the pass once the switch is on (the job
    waits for the switch: it spends no attempt); a database error goes to the common rules."""
    paused = WorkResult("paused", note=paused_reason(EXTRACTION_ENABLED), pause_reason=KILL_SWITCH)
    backfill_id = int(ctx.option("backfill"))
    if batch_unavailable(ctx.rt.settings) is not None:
        return paused
    with open_batch_client(ctx.rt.settings) as client:
        batches, refused, gone = cancel_open_batches(pass_deps(ctx, client, None), backfill_id)
    if not batches:
        return paused
    cancelled = batches - refused - gone
    done = f"{cancelled} batch(es) of backfill {backfill_id} cancelled, collected once it is on"
    if refused:
        done += f"; the provider did not cancel {refused} now (asked again then)"
    if gone:
        done += f"; {gone} gone at the provider (collected then)"
    return replace(paused, note=f"{paused.note}; {done}")


KIND = register(
    JobKind(
        name=BATCH_EXTRACTION,
        task_name="tasks.backfill.run_backfill",
        queue="extraction",
        switch=EXTRACTION_ENABLED,
        work=backfill_pass,
        errors=(
            ErrorRule(CheckpointConflictError, "retry"),
            ErrorRule(BackfillNotFoundError, "fail"),
            ErrorRule(BatchSendFailedError, "retry"),  # the job's own: its attempts, not losses
        ),
        pause_reasons=(WAITING_FOR_BATCHES, BATCH_FAULT),
        while_switched_off=cancel_while_switched_off,
    )
)
