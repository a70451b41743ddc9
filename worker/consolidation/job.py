"""The consolidation job kind: consolidate one entity's new facts (the consolidation queue)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import func, select, update

from models import Job
from worker.config_store import CONSOLIDATION_ENABLED
from worker.consolidation import CATCH_UP_GRACE_SECONDS, catch_up_consolidation
from worker.consolidation.service import ConsolidationReplyError, EntityRun, consolidate_entity
from worker.consolidation.store import ConsolidationStore
from worker.jobs.lifecycle import JobContext, OperatorRun, WorkResult, run_job
from worker.jobs.maintenance import sweep_step
from worker.jobs.outbox import (
    CONSOLIDATION,
    PENDING,
    page_subject,
    request_job,
    split_page_subject,
)
from worker.jobs.registry import BUDGET, ErrorRule, JobKind, KillSwitchOffError, register
from worker.llm.gateway import embeds_new_facts
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
        lease=ctx.lease,
    )
    # A worker's run leaves the facts whose vectors their page's follow-up is still making for that
    # follow-up's request (the catch-up's, should it be lost); an operator's decides what is there now.
    waits = embeds_new_facts(rt.settings) and not ctx.operator_run
    defer = CATCH_UP_GRACE_SECONDS if waits else None
    store = ConsolidationStore(rt.factory, rt.ledger, defer_unembedded_seconds=defer)
    counters = consolidate_entity(store, rt.llm, run)
    note = None if counters.facts_considered else "nothing to consolidate: every fact was decided"
    if store.deferred:  # ("every fact was decided" said of facts still pending)
        note = (
            f"{store.deferred} fact(s) stored in the last {CATCH_UP_GRACE_SECONDS / 60:.0f} minutes wait for "
            "their vectors; their page's follow-up (or the sweep) asks for them again"
        )
    return WorkResult("succeeded", counters=counters.as_dict(), note=note)


@dataclass(frozen=True)
class RunHere:
    """How an entity's consolidation run here and now ended (``consolidate_here``)."""

    status: str  # a JobOutcome's status, or "held": a worker is consolidating the entity now
    job_id: int
    counters: dict[str, Any]
    note: str | None


def consolidate_here(rt: Runtime, source_id: str, key: str, *, override_switch: bool = False) -> RunHere:
    """One entity consolidated in this process, as its consolidation job (its lease, budget and
    history): run beside a worker's job for the same entity, `factmill facts consolidate` paid for
    the same pairs twice. An entity a worker is consolidating now is left to it ("held"); a job paused
    for its own budget gets a new one."""
    subject = page_subject(source_id, key)
    fresh = func.now() - timedelta(seconds=rt.settings.job_stale_after_seconds)
    with rt.factory.begin() as session:
        pending = session.execute(
            select(Job.id, Job.status, Job.pause_reason, Job.heartbeat_at > fresh)
            .where(Job.kind == CONSOLIDATION, Job.subject == subject, Job.status.in_(PENDING))
            .with_for_update()
        ).first()
        if pending is None:
            job_id = request_job(session, CONSOLIDATION, subject).job_id
        elif pending.status == "running" and pending[3]:  # a worker's, alive (a stale one is taken over)
            return RunHere("held", pending.id, {}, f"job {pending.id} is consolidating it now")
        else:
            job_id = pending.id
            if pending.status == "paused" and pending.pause_reason == BUDGET:
                # Its own budget starts over, as an append's does for an extraction (claims take a
                # paused job): spent, it paused again at once and stopped the command at this entity.
                session.execute(update(Job).where(Job.id == job_id).values(budget_since=func.now()))
    outcome = run_job(rt, job_id, CONSOLIDATION, operator=OperatorRun(override_switch))
    if outcome.status in ("skipped", "lost"):  # a worker took it first, or an erasure took its facts
        return RunHere("held" if outcome.status == "skipped" else "lost", job_id, {}, outcome.detail or None)
    with rt.factory() as session:
        job = session.get(Job, job_id)
        counters, note = (dict(job.counters or {}), job.last_error) if job is not None else ({}, None)
    return RunHere(outcome.status, job_id, counters, note or outcome.detail or None)


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
