"""Running one extraction job: lease, kill switch, extraction, retry policy, final status."""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy.exc import OperationalError

from models import Job
from worker.config_store import EXTRACTION_ENABLED
from worker.extraction import (
    CheckpointConflictError,
    ExtractionDisabledError,
    ExtractOptions,
    run_extract_conversation_facts,
)
from worker.jobs import (
    BUDGET,
    EXTRACTION,
    JOB_KINDS,
    KILL_SWITCH,
    Heartbeat,
    LeaseLostError,
    claim,
    enqueue,
    finish,
    new_lease_token,
    now,
    split_page_subject,
)
from worker.runtime import Runtime

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with full jitter, bounded; a small value object so it can be tested alone."""

    base_seconds: float = 5.0
    max_seconds: float = 300.0

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        ceiling = min(self.max_seconds, self.base_seconds * 2 ** max(0, attempt - 1))
        return (rng or random).uniform(ceiling / 2, ceiling)


@dataclass(frozen=True)
class JobOutcome:
    status: str  # succeeded | failed | paused | retry | skipped | lost
    retry_in: float | None = None
    detail: str = ""


def paused_reason(switch: str) -> str:
    return f"paused: {switch} is off; it resumes when the switch is turned on"


PAUSED_REASON = paused_reason(EXTRACTION_ENABLED)


@dataclass(frozen=True)
class Lease:
    job: Job
    token: str


def begin_job(rt: Runtime, job_id: int, kind: str) -> Lease | JobOutcome:
    """What every job runner does first: take the lease, check the kind, honour the kill switch.

    Returns the lease to work under, or the outcome when there is nothing to run.
    """
    token = new_lease_token()
    job = claim(rt.factory, job_id, token, rt.settings.job_stale_after_seconds)
    if job is None:
        return JobOutcome("skipped", detail="already finished, or held by another worker")
    if job.kind != kind:
        finish(rt.factory, job_id, token, "failed", last_error=f"job kind {job.kind!r} is not {kind!r}")
        return JobOutcome("failed")
    switch = JOB_KINDS[kind][2]
    if not rt.config.enabled(switch):
        reason = paused_reason(switch)
        finish(rt.factory, job_id, token, "paused", last_error=reason, pause_reason=KILL_SWITCH)
        return JobOutcome("paused")
    return Lease(job, token)


def retry_or_fail(
    rt: Runtime, lease: Lease, reason: str, policy: RetryPolicy, counters: dict[str, Any] | None = None
) -> JobOutcome:
    """The one job retry decision: queue the job again after a backoff, or fail it once its attempts
    are spent. ``enqueued_at`` in the future keeps the sweeper from re-sending it before it is due."""
    job_id, token = lease.job.id, lease.token
    if lease.job.attempts >= rt.settings.job_max_attempts:
        finish(rt.factory, job_id, token, "failed", counters=counters, last_error=reason)
        return JobOutcome("failed", detail=reason)
    delay = policy.delay(lease.job.attempts)
    requeue_at = now() + timedelta(seconds=delay)
    finish(rt.factory, job_id, token, "queued", counters=counters, last_error=reason, requeue_at=requeue_at)
    return JobOutcome("retry", retry_in=delay, detail=reason)


def run_extraction_job(rt: Runtime, job_id: int, policy: RetryPolicy | None = None) -> JobOutcome:
    policy = policy or RetryPolicy()
    settings = rt.settings
    lease = begin_job(rt, job_id, EXTRACTION)
    if isinstance(lease, JobOutcome):
        return lease
    job, token = lease.job, lease.token
    source_id, slug = split_page_subject(job.subject)
    options = ExtractOptions(
        source_id=source_id,
        slug=slug,
        force=bool(job.options.get("force", False)),
        job_id=job.id,
        segment_concurrency=settings.segment_concurrency,
        max_output_tokens=settings.llm_max_output_tokens,
    )

    with Heartbeat(rt.factory, job_id, token, settings.job_heartbeat_seconds) as beat:
        try:
            counters = run_extract_conversation_facts(
                rt.factory, rt.llm, options, config=rt.config, guard=beat.check
            )
        except ExtractionDisabledError:
            finish(rt.factory, job_id, token, "paused", last_error=PAUSED_REASON, pause_reason=KILL_SWITCH)
            return JobOutcome("paused")
        except LeaseLostError as exc:
            return JobOutcome("lost", detail=str(exc))
        except (CheckpointConflictError, OperationalError) as exc:
            return retry_or_fail(rt, lease, f"{type(exc).__name__}: {exc}", policy)
    counters_dict = counters.as_dict()
    waiting = [p for p in counters.pages if p.outcome == "budget_exhausted"]
    if waiting:
        # Not a failure: the job waits (paused) and resumes when the budget has room again.
        finish(
            rt.factory,
            job_id,
            token,
            "paused",
            counters=counters_dict,
            last_error=waiting[0].reason,
            pause_reason=BUDGET,
        )
        return JobOutcome("paused", detail="waiting for LLM budget")
    if counters.pages_failed:
        reason = "; ".join(p.reason for p in counters.pages if p.status == "failed")
        return retry_or_fail(rt, lease, reason, policy, counters=counters_dict)
    if counters.facts_inserted and settings.embed_after_extraction:
        # Make the new facts findable by vector search too; never fails the job (`factmill embed`
        # fills in whatever this misses).
        from worker.search import embed_new_facts

        embed_new_facts(rt.factory, rt.llm, source_id, slug, settings.search_embed_batch_size)
    note = None
    if counters.pages_considered == 0:
        note = "nothing to extract: the page is gone or is not a conversation type"
    rerun = finish(rt.factory, job_id, token, "succeeded", counters=counters_dict, last_error=note)
    if rerun is not None:
        enqueue(rt.factory, [rerun])
    return JobOutcome("succeeded")
