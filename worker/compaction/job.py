"""The compaction job kind: compact the job's transcript under the active threshold (the compaction queue)."""

from __future__ import annotations

import threading

from sqlalchemy.orm import Session, sessionmaker

from models.reads import read_only
from worker.calibration import ThresholdCache
from worker.compaction.queries import (
    CONTINUATION,
    ONE_RUN_OPTIONS,
    TranscriptNotFoundError,
    transcript_settings,
)
from worker.compaction.service import compact
from worker.compaction.store import TranscriptStore
from worker.compaction.waits import compaction_wait
from worker.config_store import COMPACTION_ENABLED, COMPACTION_QUALITY_GATE
from worker.jobs.lifecycle import JobContext, WorkResult
from worker.jobs.outbox import COMPACTION
from worker.jobs.registry import ErrorRule, JobKind, register

_threshold_caches: dict[int, tuple[sessionmaker[Session], ThresholdCache]] = {}
_threshold_lock = threading.Lock()


def threshold_cache(factory: sessionmaker[Session], ttl: float) -> ThresholdCache:
    """One ThresholdCache per session factory (per worker process), so gates share one τ read."""
    with _threshold_lock:
        entry = _threshold_caches.get(id(factory))
        if entry is None or entry[0] is not factory:
            entry = (factory, ThresholdCache(factory, ttl))
            _threshold_caches[id(factory)] = entry
        return entry[1]


def compact_job(ctx: JobContext) -> WorkResult:
    """The compaction job kind's work: compact the job's transcript under the active threshold."""
    rt, job = ctx.rt, ctx.job
    settings = rt.settings
    force = bool(ctx.option("force", False))
    if not force and not ctx.option(CONTINUATION, False):
        # An append over the threshold while this job ran asked for a rerun, sent as soon as the run
        # ended: the wait the request path keeps (after a rejected or failed summary, or an accepted one
        # that left the context over its threshold) was skipped, and an active agent paid for another
        # call on nearly the same head every time.
        with read_only(rt.factory) as session:
            current = transcript_settings(session, job.subject)
            waiting, _ = compaction_wait(session, job.subject, current, settings.compaction_retrigger_seconds)
        if waiting is not None:
            return WorkResult("succeeded", counters={"status": "waiting"}, note=waiting, detail=waiting)
    gate = threshold_cache(rt.factory, settings.threshold_cache_seconds)

    def guard() -> None:  # before each summarizer call: the lease, the worker stopping, both budgets
        ctx.guard()
        rt.budget.check(job.id)  # the gateway's own check knows no job: llm.budget_job_usd went unread

    outcome = compact(
        TranscriptStore(rt.factory, rt.ledger),
        rt.llm,
        job.subject,
        threshold=gate.get,
        force=force,
        job_id=job.id,
        guard=guard,
        lease=ctx.lease,
        enabled=ctx.enabled,
        max_output_tokens=settings.compaction_max_output_tokens,
        intent_messages=settings.compaction_intent_messages,
        max_input_tokens=settings.compaction_max_input_tokens,
        # Only part of the head fitting the summarizer, the rest goes next, without waiting for an
        # append (a rerun of this job, sent when it finishes; it stops once under the threshold, or,
        # forced, once the head is summarized: a forced run's continuation is forced too).
        continue_capped=True,
        quality_gate=rt.config.enabled(COMPACTION_QUALITY_GATE),
    )
    counters = outcome.job_counters()
    if outcome.superseded:
        # Another compaction was applied over the timeline this one summarized: nothing failed, and a
        # failed job fired the failing-jobs alert for an operator's `compact --now` beside a worker's run.
        superseded = f"compaction {outcome.compaction_id} {outcome.detail}"
        counters["status"] = "superseded"
        return WorkResult("succeeded", counters=counters, note=superseded, detail=superseded)
    if outcome.status == "failed":
        # The job's note names the compaction, not its error (a provider's message may quote the
        # transcript): the compaction row keeps it, erased with the transcript.
        failed = f"compaction {outcome.compaction_id} failed; its error is on the compaction row"
        return WorkResult("failed", counters=counters, note=failed, detail=failed)
    note = outcome.detail if outcome.status in ("not_needed", "nothing_to_compact") else None
    return WorkResult("succeeded", counters=counters, note=note, detail=outcome.detail)


KIND = register(
    JobKind(
        name=COMPACTION,
        task_name="tasks.compaction.compact_transcript",
        queue="compaction",
        switch=COMPACTION_ENABLED,
        work=compact_job,
        errors=(ErrorRule(TranscriptNotFoundError, "fail"),),
        one_run_options=ONE_RUN_OPTIONS,
    )
)
