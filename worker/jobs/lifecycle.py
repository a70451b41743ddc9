"""The one job lifecycle: claim the lease, honour the kill switch, beat the heartbeat, run the kind's
work, sort its exceptions through one table, and record how the run ended."""

from __future__ import annotations

import contextlib
import logging
import os
import random
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from sqlalchemy.exc import OperationalError, SQLAlchemyError

from models import Job
from worker.core.errors import LLMConfigurationError, error_summary, unsorted_error_note
from worker.core.jsonvalues import made_storable
from worker.db import database_unavailable
from worker.jobs.budgets import JobBudgets, worker_lost_reason
from worker.jobs.leases import (
    Finished,
    Heartbeat,
    LeaseLostError,
    NotDue,
    claim,
    finish,
    new_lease_token,
)
from worker.jobs.outages import read_outage_clock, spent_note, waiting_note
from worker.jobs.outbox import BUDGET, KILL_SWITCH
from worker.jobs.registry import (
    Backoff,
    ErrorRule,
    JobKind,
    KillSwitchOffError,
    UnknownJobKindError,
    get_kind,
)
from worker.jobs.sending import enqueue, traceparents
from worker.jobs.shutdown import WorkerStoppingError, check_stopping, stopping
from worker.llm.errors import BudgetExhaustedError, LLMError, provider_cannot_serve
from worker.runtime import Runtime, tracing
from worker.runtime.logs import log_context

logger = logging.getLogger(__name__)

Status = Literal["succeeded", "failed", "retry", "requeue", "outage", "paused", "lost", "released"]
RELEASED_NOTE = "released by a stopping worker; re-sent to the next one"
INTERRUPTED_NOTE = "its run was interrupted; released and re-sent to a worker"


def paused_reason(switch: str) -> str:
    return f"paused: {switch} is off; it resumes when the switch is turned on"


# A message whose job could not be claimed, the database unavailable, is sent again this many seconds
# later (drawn between the two, so a restart's backlog does not come back at once).
DATABASE_AWAY_RETRY_SECONDS = (5.0, 15.0)

# The longest note a failed job keeps (its last_error): a rule's error message, cut there.
MAX_NOTE_CHARS = 2000

# The common rows of the exception table; a kind's own rows (JobKind.errors) are read first.
COMMON_ERRORS: tuple[ErrorRule, ...] = (
    ErrorRule(LeaseLostError, "lost"),
    ErrorRule(WorkerStoppingError, "release"),
    ErrorRule(KillSwitchOffError, "pause", KILL_SWITCH),
    ErrorRule(BudgetExhaustedError, "pause", BUDGET),
    # The database went away under the run, or every pooled connection stayed busy past the pool's
    # timeout: a worker loss, not the job's fault (as the API's 503 says); try again later. Retried as
    # the job's own failure, five pool timeouts on a busy worker failed a page for good.
    ErrorRule(SQLAlchemyError, "requeue", when=database_unavailable),
    ErrorRule(OperationalError, "retry"),
    # The LLM provider unavailable past the retry layer's patience (429, 5xx), or refusing for the
    # account's money (every job fails alike until someone pays): the job waits it out on its outage
    # clock (worker.jobs.outages). As the job's own failure, an outage of minutes (or a spent quota,
    # within a minute) failed every job in flight; as a worker loss, one of three quarters of an hour.
    ErrorRule(LLMError, "outage", when=provider_cannot_serve),
    # Any other provider error (a 401, a model that does not exist): retried, noted in the provider's
    # words (what to fix is there; sorted with the unknown errors, the note named its class only).
    ErrorRule(LLMError, "retry"),
    # A provider missing its key or URL (services refuse to start so; a worker's settings changed under
    # a running job): every try would fail alike, so the job fails at once, saying what to set.
    ErrorRule(LLMConfigurationError, "fail"),
)


@dataclass(frozen=True)
class JobOutcome:
    status: str  # succeeded | failed | paused | retry | skipped | lost | released | unclaimed | not_due
    retry_in: float | None = None
    detail: str = ""
    # The job's span, for the retry message the task sends after it ended (else sent from the Celery
    # run span: a root of its own for a message that came without a trace, and the retry lost the
    # request's trace, which a message with one then kept from the stored one).
    traceparent: str | None = None


@dataclass(frozen=True)
class WorkResult:
    """What a kind's work function reports; the lifecycle turns it into the job's new state."""

    status: Status = "succeeded"
    counters: dict[str, Any] | None = None
    note: str | None = None  # stored as the job's last_error (a reason, or a note on a success)
    pause_reason: str | None = None
    detail: str = ""
    # A pause after progress (a backfill pass that sent or collected its batches): the next run starts
    # with fresh attempt and worker-loss budgets, so errors days apart do not add up to a failure. For
    # an outage, whether the run went forward (segments committed or skipped: the outage began mid-run)
    # or not (None: the kind cannot say, as for an error raised): see wait_out_outage.
    progressed: bool | None = False


@dataclass
class JobContext:
    """What a work function gets: the process's resources, the claimed job, and the lease guard."""

    rt: Runtime
    job: Job
    kind: JobKind
    guard: Callable[[], None] = field(default=lambda: None)
    # The lease alone, for writing what is already paid for: the guard also raises once the worker
    # begins to stop, which threw away a summary answered and paid for (a rolling deploy).
    lease: Callable[[], None] = field(default=lambda: None)
    switch_overridden: bool = False  # an operator's one-off run despite the kill switch (the CLI's)
    operator_run: bool = False  # run by an operator's command in its own process, not by a worker

    def enabled(self) -> bool:
        return self.switch_overridden or self.rt.config.enabled(self.kind.switch)

    def option(self, name: str, default: Any = None) -> Any:
        return self.job.options.get(name, default)


def classify(kind: JobKind, exc: BaseException) -> ErrorRule | None:
    for rule in (*kind.errors, *COMMON_ERRORS):
        if isinstance(exc, rule.error) and (rule.when is None or rule.when(exc)):
            return rule
    return None


def result_for_error(kind: JobKind, exc: Exception) -> WorkResult:
    rule = classify(kind, exc)
    if rule is None:
        # Not a known class: a bug or an outage nobody sorted yet. Retry with backoff (bounded by the
        # attempts cap) rather than leave the job running until the sweeper notices. The line names the
        # error and where our code met it; its message (it may quote a page) and traceback go to DEBUG.
        where = _where(exc)
        logger.warning("job of kind %s raised %s at %s; retrying", kind.name, type(exc).__name__, where)
        logger.debug("traceback of the %s job's error", kind.name, exc_info=exc)
        return WorkResult("retry", note=unsorted_error_note(exc, where))
    if rule.action == "pause":
        note = paused_reason(kind.switch) if rule.pause_reason == KILL_SWITCH else str(exc)
        return WorkResult("paused", note=note, pause_reason=rule.pause_reason)
    if rule.action in ("retry", "requeue", "outage"):
        logger.warning("job of kind %s raised %s; %s", kind.name, type(exc).__name__, rule.action)
        return WorkResult(rule.action, note=error_summary(exc), progressed=None)
    if rule.action == "lost":
        return WorkResult("lost", detail=str(exc))
    if rule.action == "release":
        return WorkResult("released", note=RELEASED_NOTE, detail=str(exc))
    return WorkResult("failed", note=made_storable(str(exc))[:MAX_NOTE_CHARS], detail=str(exc))


def _where(exc: BaseException) -> str:
    """The innermost frame of Factmill's own code the error passed through, as ``file:line (function)``."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [frame for frame in frames if f"{os.sep}worker{os.sep}" in frame.filename] or frames
    if not ours:
        return "an unknown place"
    frame = ours[-1]
    return f"{os.path.basename(frame.filename)}:{frame.lineno} ({frame.name})"


@dataclass(frozen=True)
class Lease:
    job: Job
    token: str
    claimed_at: float | None = None  # time.monotonic() just before the claim (the lease's first beat)


@dataclass(frozen=True)
class OperatorRun:
    """A run an operator started in this process (a CLI command), not a worker's: an interrupt (Ctrl-C,
    a signal turned SystemExit) hands the lease back at once (left held, the next command took the job
    for a worker's for a minute, and the sweeper counted a worker lost); ``override_switch`` runs it
    despite the kind's kill switch. A worker's interrupt stays a lost worker (counted, bounded)."""

    override_switch: bool = False


def run_job(
    rt: Runtime,
    job_id: int,
    kind: JobKind | str,
    backoff: Backoff | None = None,
    *,
    operator: OperatorRun | None = None,
) -> JobOutcome:
    """Run one job of ``kind`` under a lease; the only place a job's state moves while it runs."""
    spec = get_kind(kind) if isinstance(kind, str) else kind
    attributes: dict[str, str | int] = {"factmill.job.id": job_id, "factmill.job.kind": spec.name}
    with (
        log_context(job_id=job_id, job_kind=spec.name),
        tracing.span(f"job {spec.name}", attributes, parent=_stored_traceparent(rt, job_id)),
    ):
        outcome = _run_job(rt, job_id, spec, backoff, operator)
        tracing.annotate("factmill.job.outcome", outcome.status)
        if outcome.retry_in is not None:
            outcome = replace(outcome, traceparent=tracing.current_traceparent())
            if operator is not None and outcome.status == "retry":
                # No task sends an operator's retry: the job is handed to the workers now, and the one
                # that takes the message holds it until its backoff ends (a claim that is not due). Left
                # to the sweeper, it waited minutes past its backoff, behind any backlog.
                enqueue(rt.factory, [(job_id, spec.name)])
    return outcome


def _stored_traceparent(rt: Runtime, job_id: int) -> str | None:
    """The job's trace, for a message that came without one (its sender was not tracing)."""
    if not tracing.enabled() or tracing.continues():
        return None
    try:
        return traceparents(rt.factory, [job_id]).get(job_id)
    except SQLAlchemyError as exc:  # the claim, next, says what the database's absence means
        if not database_unavailable(exc):
            raise
        return None


def _database_away(after: float) -> JobOutcome:
    wait = after + random.uniform(*DATABASE_AWAY_RETRY_SECONDS)
    return JobOutcome("unclaimed", retry_in=wait, detail=f"the database is unavailable; sent in {wait:.0f} s")


def _run_job(
    rt: Runtime, job_id: int, spec: JobKind, backoff: Backoff | None, operator: OperatorRun | None
) -> JobOutcome:
    if stopping():  # a message this worker took before it began to stop: pass it on untouched
        enqueue(rt.factory, [(job_id, spec.name)])
        return JobOutcome("released", detail="the worker is stopping; message re-sent")
    token = new_lease_token()
    claimed_at = time.monotonic()
    try:
        job = claim(
            rt.factory,
            job_id,
            token,
            rt.settings.job_stale_after_seconds,
            JobBudgets.from_settings(rt.settings),
            due_only=operator is None,
        )
    except SQLAlchemyError as exc:
        if operator is not None or not database_unavailable(exc):
            raise
        # Raised on, the message was acked (acks_on_failure): in a restart of Postgres every thread took
        # message after message and dropped each, the jobs left to the sweeper minutes later.
        return _database_away(0.0)
    if isinstance(job, NotDue):  # a second message for a job waiting out its backoff: held till it ends
        return JobOutcome(
            "not_due",
            retry_in=job.seconds,
            detail=f"waiting out a retry's backoff; due in {job.seconds:.0f} s",
        )
    if job is None:
        return JobOutcome("skipped", detail="already finished, or held by another worker")
    if job.status == "failed":  # a budget was spent: the claim failed it instead of running it
        return JobOutcome("failed", detail=job.last_error or "")
    lease = Lease(job, token, claimed_at)
    if operator is None:
        try:
            return settle(rt, lease, _work(rt, lease, spec, None), backoff or spec.backoff)
        except SQLAlchemyError as exc:
            if not database_unavailable(exc):
                raise
            # Its end unwritten: sent again once its lease is stale (raised, the message was acked).
            return _database_away(rt.settings.job_stale_after_seconds)
    try:
        return settle(rt, lease, _work(rt, lease, spec, operator), backoff or spec.backoff)
    except (KeyboardInterrupt, SystemExit):  # from the claim to the settle: the lease goes back
        with contextlib.suppress(Exception):
            release(rt, lease, WorkResult("released", note=INTERRUPTED_NOTE))
        raise


def _work(rt: Runtime, lease: Lease, spec: JobKind, operator: OperatorRun | None) -> WorkResult:
    """The claimed job's run: its kind's work under a heartbeat (or what it does while its switch is
    off), its exception sorted into a result."""
    job = lease.job
    if job.kind != spec.name:
        return WorkResult("failed", note=f"job kind {job.kind!r} is not {spec.name!r}")
    override_switch = operator is not None and operator.override_switch
    try:
        switched_off = not override_switch and not rt.config.enabled(spec.switch)
    except Exception as exc:  # (a pool timeout, a blip): sorted as the work's errors are; raised, the
        return result_for_error(spec, exc)  # message was acked and the lease left to go stale
    if switched_off and spec.while_switched_off is None:
        return WorkResult("paused", note=paused_reason(spec.switch), pause_reason=KILL_SWITCH)
    work = spec.while_switched_off if switched_off and spec.while_switched_off else spec.work
    settings = rt.settings
    with Heartbeat(
        rt.factory,
        job.id,
        lease.token,
        settings.job_heartbeat_seconds,
        settings.task_time_limit_seconds,
        settings.job_stale_after_seconds,
        listen=settings.job_revocation_listen,
        claimed_at=lease.claimed_at,
    ) as beat:

        def guard() -> None:  # called between segments: lost the lease? is the worker stopping?
            beat.check()
            check_stopping()

        try:
            return work(JobContext(rt, job, spec, guard, beat.check, override_switch, operator is not None))
        except Exception as exc:
            return result_for_error(spec, exc)


def settle(rt: Runtime, lease: Lease, result: WorkResult, backoff: Backoff) -> JobOutcome:
    """Record how the run ended: the one place that decides succeeded / failed / paused / retry, and
    which budget the run spent (a verdict of its own spends an attempt, a pause spends nothing)."""
    job_id, token = lease.job.id, lease.token
    if result.status == "lost":  # the worker that took the lease over counted the loss
        return JobOutcome("lost", detail=result.detail)
    if result.status == "released":
        return release(rt, lease, result)
    if result.status == "outage":
        note = result.note or "the provider cannot serve"
        return wait_out_outage(rt, lease, note, backoff, result.counters, progressed=result.progressed)
    if result.status in ("retry", "requeue"):
        return retry_or_fail(
            rt,
            lease,
            result.note or "retry",
            backoff,
            result.counters,
            worker_lost=result.status == "requeue",
        )
    status = result.status if result.status in ("failed", "paused") else "succeeded"
    done = finish(
        rt.factory,
        job_id,
        token,
        status,
        counters=result.counters,
        last_error=result.note,
        pause_reason=result.pause_reason if status == "paused" else None,
        attempt=status != "paused",
        budgets_renewed=status == "paused" and bool(result.progressed),
        one_run_options=_one_run_options(lease),
        outage="leave" if _waits_without_progress(result) else None,
    )
    if done is None:
        # The lease was taken over between the run's last check and this write: nothing was written,
        # and the new holder's run decides (reported as this run's verdict, Flower showed a job
        # "succeeded" that was queued again, and a failure's note was dropped without a word).
        logger.warning("job %s: its lease was taken over before its %s run was recorded", job_id, status)
        return JobOutcome("lost", detail=f"the lease was taken over; this run's {status} was not recorded")
    _send_rerun(rt, done)
    return JobOutcome(status, detail=result.detail)


def _waits_without_progress(result: WorkResult) -> bool:
    """A pause of the kind's own (a backfill waiting out a failed send's resend) after a run that went
    nowhere: it leaves the outage clock as it was. Emptied, a backfill whose sends an outage kept
    failing started its clock anew at every resend, and never failed however long the outage."""
    own = result.pause_reason not in (KILL_SWITCH, BUDGET)
    return result.status == "paused" and own and result.progressed is False


def _one_run_options(lease: Lease) -> tuple[str, ...]:
    try:
        return get_kind(lease.job.kind).one_run_options
    except UnknownJobKindError:  # a row of a kind this release does not know: failed as such
        return ()


def _send_rerun(rt: Runtime, done: Finished | None) -> None:
    if done is not None and done.rerun is not None:  # new content arrived meanwhile: a run of its own
        enqueue(rt.factory, [done.rerun])


def retry_or_fail(
    rt: Runtime,
    lease: Lease,
    reason: str,
    backoff: Backoff,
    counters: dict[str, Any] | None = None,
    *,
    worker_lost: bool = False,
) -> JobOutcome:
    """Queue the job again after a backoff, or fail it once the budget this run spent is gone: an
    attempt for the job's own failure, a worker loss when infrastructure cut it short. ``enqueued_at``
    in the future keeps the sweeper from re-sending it before it is due."""
    budgets = JobBudgets.from_settings(rt.settings)
    attempts = lease.job.attempts + (0 if worker_lost else 1)
    losses = lease.job.worker_losses + (1 if worker_lost else 0)
    spent = budgets.losses_spent(losses) if worker_lost else budgets.attempts_spent(attempts)
    delay = None if spent else backoff.delay(losses if worker_lost else attempts)
    if spent:
        reason = f"{worker_lost_reason(losses)}; last: {reason}" if worker_lost else reason
    return _queue_again_or_fail(
        rt,
        lease,
        delay,
        reason,
        counters,
        attempt=not worker_lost,
        worker_lost=worker_lost,
        outage="leave" if worker_lost and not spent else None,  # (a database outage: not the provider's)
    )


def _queue_again_or_fail(
    rt: Runtime,
    lease: Lease,
    delay: float | None,
    note: str,
    counters: dict[str, Any] | None,
    **spent: Any,
) -> JobOutcome:
    """Queued again ``delay`` seconds from now, or (None) failed, noting ``note``; ``spent``: what the run
    spent and did to the outage clock (``finish``'s attempt, worker_lost, outage)."""
    done = finish(
        rt.factory,
        lease.job.id,
        lease.token,
        "failed" if delay is None else "queued",
        counters=counters,
        last_error=made_storable(note)[:MAX_NOTE_CHARS],
        requeue_in=delay,
        one_run_options=_one_run_options(lease),
        **spent,
    )
    if done is None:
        # Another worker holds the job now: a retry message of ours would claim it before the backoff
        # that worker's run set (or run a job cancelled meanwhile).
        return JobOutcome("lost", detail="the lease was taken over; the retry is the new holder's")
    _send_rerun(rt, done)
    if delay is None:
        return JobOutcome("failed", detail=note)
    return JobOutcome("retry", retry_in=delay, detail=note)


def wait_out_outage(
    rt: Runtime,
    lease: Lease,
    reason: str,
    backoff: Backoff,
    counters: dict[str, Any] | None = None,
    *,
    progressed: bool | None = None,
) -> JobOutcome:
    """The provider could not serve the run: queue the job again after a wait as long as the outage so
    far (up to the backoff's ceiling), spending neither budget, or fail it once the provider has served
    it nothing for the patience (worker.jobs.outages). Before the clock, a provider outage spent worker
    losses: one of three quarters of an hour failed every job in flight, and its requeues counted as
    crash loops. A run that says nothing went forward (``progressed`` False: no segment committed or
    skipped) though the provider answered other calls of it is no outage: the job's own failure (a
    segment the provider fails every time), on its attempts; taken for one, such a page waited out the
    whole patience, paying on every run for its later segments' calls, whose answers were thrown away.
    (None: the kind cannot say, as for an error raised: a consolidation's committed rounds, a backfill
    pass's collected batches; the outage's, then.)"""
    job_id = lease.job.id
    patience = rt.settings.job_provider_outage_patience_seconds
    clock = read_outage_clock(rt.factory, job_id, lease.job.heartbeat_at)  # (set by the claim)
    if clock.answered and progressed is False:
        why = f"the provider answered this run's other calls but not this one: {reason}"
        return retry_or_fail(rt, lease, why, backoff, counters)
    if progressed:  # served until it went away mid-run: the outage begins now
        clock = replace(clock, running=False, elapsed=0.0)
    spent = clock.spent(patience)
    delay = None if spent else clock.backoff(backoff.base_seconds, backoff.max_seconds)
    if spent:
        logger.warning("job %s: the provider served it nothing for %.0f s; failing it", job_id, clock.elapsed)
    note = spent_note(clock, reason) if spent else waiting_note(clock, patience, reason)
    change = None if spent else "restart" if progressed else "keep"
    return _queue_again_or_fail(rt, lease, delay, note, counters, outage=change)


def release(rt: Runtime, lease: Lease, result: WorkResult) -> JobOutcome:
    """The worker is stopping: hand the lease back (queued, no worker, no heartbeat) and re-send the
    message after that commit, so another worker claims it at once. Neither budget is spent: the run
    reached no verdict, and a lease given back is not a lost worker (the next claim sees "queued")."""
    job_id, token = lease.job.id, lease.token
    released = finish(
        rt.factory, job_id, token, "queued", counters=result.counters, last_error=result.note, outage="leave"
    )
    if released is None:
        return JobOutcome("lost", detail="the lease was no longer this run's; nothing re-sent")
    enqueue(rt.factory, [(job_id, lease.job.kind)])
    logger.info("job %s released by its stopping worker and re-sent", job_id)
    return JobOutcome("released", detail=result.detail)
