"""The one job lifecycle: claim the lease, honour the kill switch, beat the heartbeat, run the kind's
work, sort its exceptions through one table, and record how the run ended."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal

from sqlalchemy.exc import OperationalError

from models import Job
from worker.jobs.leases import Heartbeat, LeaseLostError, claim, finish, new_lease_token, now
from worker.jobs.outbox import BUDGET, KILL_SWITCH, enqueue
from worker.jobs.registry import Backoff, ErrorRule, JobKind, KillSwitchOffError, get_kind
from worker.llm.errors import BudgetExhaustedError
from worker.runtime import Runtime

logger = logging.getLogger(__name__)

Status = Literal["succeeded", "failed", "retry", "paused", "lost"]


def paused_reason(switch: str) -> str:
    return f"paused: {switch} is off; it resumes when the switch is turned on"


# The common rows of the exception table; a kind's own rows (JobKind.errors) are read first.
COMMON_ERRORS: tuple[ErrorRule, ...] = (
    ErrorRule(LeaseLostError, "lost"),
    ErrorRule(KillSwitchOffError, "pause", KILL_SWITCH),
    ErrorRule(BudgetExhaustedError, "pause", BUDGET),
    ErrorRule(OperationalError, "retry"),  # the database went away: try again later
)


@dataclass(frozen=True)
class JobOutcome:
    status: str  # succeeded | failed | paused | retry | skipped | lost
    retry_in: float | None = None
    detail: str = ""


@dataclass(frozen=True)
class WorkResult:
    """What a kind's work function reports; the lifecycle turns it into the job's new state."""

    status: Status = "succeeded"
    counters: dict[str, Any] | None = None
    note: str | None = None  # stored as the job's last_error (a reason, or a note on a success)
    pause_reason: str | None = None
    detail: str = ""


@dataclass
class JobContext:
    """What a work function gets: the process's resources, the claimed job, and the lease guard."""

    rt: Runtime
    job: Job
    kind: JobKind
    guard: Callable[[], None] = field(default=lambda: None)

    def enabled(self) -> bool:
        return self.rt.config.enabled(self.kind.switch)

    def option(self, name: str, default: Any = None) -> Any:
        return self.job.options.get(name, default)


def classify(kind: JobKind, exc: BaseException) -> ErrorRule | None:
    for rule in (*kind.errors, *COMMON_ERRORS):
        if isinstance(exc, rule.error):
            return rule
    return None


def result_for_error(kind: JobKind, exc: Exception) -> WorkResult:
    rule = classify(kind, exc)
    if rule is None:
        # Not a known class: a bug or an outage nobody sorted yet. Retry with backoff (bounded by the
        # attempts cap) rather than leave the job running until the sweeper notices.
        logger.warning("job of kind %s raised %s; retrying", kind.name, type(exc).__name__, exc_info=True)
        return WorkResult("retry", note=f"{type(exc).__name__}: {exc}")
    if rule.action == "pause":
        note = paused_reason(kind.switch) if rule.pause_reason == KILL_SWITCH else str(exc)
        return WorkResult("paused", note=note, pause_reason=rule.pause_reason)
    if rule.action == "retry":
        return WorkResult("retry", note=f"{type(exc).__name__}: {exc}")
    if rule.action == "lost":
        return WorkResult("lost", detail=str(exc))
    return WorkResult("failed", note=str(exc), detail=str(exc))


@dataclass(frozen=True)
class Lease:
    job: Job
    token: str


def run_job(rt: Runtime, job_id: int, kind: JobKind | str, backoff: Backoff | None = None) -> JobOutcome:
    """Run one job of ``kind`` under a lease; the only place a job's state moves while it runs."""
    spec = get_kind(kind) if isinstance(kind, str) else kind
    token = new_lease_token()
    job = claim(rt.factory, job_id, token, rt.settings.job_stale_after_seconds)
    if job is None:
        return JobOutcome("skipped", detail="already finished, or held by another worker")
    lease = Lease(job, token)
    if job.kind != spec.name:
        result = WorkResult("failed", note=f"job kind {job.kind!r} is not {spec.name!r}")
    elif not rt.config.enabled(spec.switch):
        result = WorkResult("paused", note=paused_reason(spec.switch), pause_reason=KILL_SWITCH)
    else:
        with Heartbeat(rt.factory, job_id, token, rt.settings.job_heartbeat_seconds) as beat:
            try:
                result = spec.work(JobContext(rt, job, spec, beat.check))
            except Exception as exc:
                result = result_for_error(spec, exc)
    return settle(rt, lease, result, backoff or spec.backoff)


def settle(rt: Runtime, lease: Lease, result: WorkResult, backoff: Backoff) -> JobOutcome:
    """Record how the run ended: the one place that decides succeeded / failed / paused / retry."""
    job_id, token = lease.job.id, lease.token
    if result.status == "lost":
        return JobOutcome("lost", detail=result.detail)
    if result.status == "retry":
        return retry_or_fail(rt, lease, result.note or "retry", backoff, result.counters)
    if result.status in ("failed", "paused"):
        finish(
            rt.factory,
            job_id,
            token,
            result.status,
            counters=result.counters,
            last_error=result.note,
            pause_reason=result.pause_reason,
        )
        return JobOutcome(result.status, detail=result.detail)
    rerun = finish(rt.factory, job_id, token, "succeeded", counters=result.counters, last_error=result.note)
    if rerun is not None:
        enqueue(rt.factory, [rerun])
    return JobOutcome("succeeded", detail=result.detail)


def retry_or_fail(
    rt: Runtime, lease: Lease, reason: str, backoff: Backoff, counters: dict[str, Any] | None = None
) -> JobOutcome:
    """Queue the job again after a backoff, or fail it once its attempts are spent. ``enqueued_at`` in
    the future keeps the sweeper from re-sending it before it is due."""
    job_id, token = lease.job.id, lease.token
    if lease.job.attempts >= rt.settings.job_max_attempts:
        finish(rt.factory, job_id, token, "failed", counters=counters, last_error=reason)
        return JobOutcome("failed", detail=reason)
    delay = backoff.delay(lease.job.attempts)
    requeue_at = now() + timedelta(seconds=delay)
    finish(rt.factory, job_id, token, "queued", counters=counters, last_error=reason, requeue_at=requeue_at)
    return JobOutcome("retry", retry_in=delay, detail=reason)
