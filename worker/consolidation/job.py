"""The consolidation job kind: consolidate one entity's new facts (the consolidation queue)."""

from __future__ import annotations

import logging

from worker.config_store import CONSOLIDATION_ENABLED
from worker.consolidation import catch_up_consolidation
from worker.consolidation.service import ConsolidationReplyError, EntityRun, consolidate_entity
from worker.consolidation.store import ConsolidationStore
from worker.jobs.lifecycle import JobContext, WorkResult
from worker.jobs.maintenance import sweep_step
from worker.jobs.outbox import CONSOLIDATION, split_page_subject
from worker.jobs.registry import ErrorRule, JobKind, KillSwitchOffError, register
from worker.runtime import Runtime

logger = logging.getLogger(__name__)


def consolidate_job(ctx: JobContext) -> WorkResult:
    """The job's subject is ``source_id|entity_key``; decisions commit one by one, so a run cut short
    (lease lost, switch off, worker stopping) resumes where it stopped."""
    rt, job = ctx.rt, ctx.job
    source_id, entity_key = split_page_subject(job.subject)

    def guard() -> None:
        ctx.guard()
        if not ctx.enabled():
            raise KillSwitchOffError(f"{CONSOLIDATION_ENABLED} was turned off")

    run = EntityRun(
        source_id,
        entity_key,
        job_id=job.id,
        guard=guard,
        before_call=lambda: rt.budget.check(job.id),
    )
    counters = consolidate_entity(ConsolidationStore(rt.factory, rt.ledger), rt.llm, run)
    note = None if counters.facts_considered else "nothing to consolidate: every fact was decided"
    return WorkResult("succeeded", counters=counters.as_dict(), note=note)


@sweep_step("consolidations_caught_up")
def catch_up(rt: Runtime) -> int:
    """Each sweep: the consolidation requests a dead worker's follow-up never made."""
    if not rt.settings.consolidate_after_extraction:
        return 0
    requested = catch_up_consolidation(rt.factory)
    if requested:
        logger.info("requested %s consolidation job(s) that a worker's death left unrequested", requested)
    return requested


KIND = register(
    JobKind(
        name=CONSOLIDATION,
        task_name="tasks.consolidation.consolidate_entity",
        queue="consolidation",
        switch=CONSOLIDATION_ENABLED,
        work=consolidate_job,
        errors=(ErrorRule(ConsolidationReplyError, "retry"),),
    )
)
