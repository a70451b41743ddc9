"""The Postgres outbox: request a job inside the caller's transaction (worker.jobs.sending sends it
after the commit), and sweep what the broker lost. Operators' retry and resume live here too."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import (
    BigInteger,
    ColumnElement,
    Text,
    any_,
    bindparam,
    case,
    func,
    literal,
    or_,
    select,
    text,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from models import Job
from models.job import PENDING as PENDING_SQL
from models.job import PENDING_STATUSES
from models.tables import JOBS
from worker.config_store import KILL_SWITCHES, is_enabled
from worker.jobs.budgets import JobBudgets
from worker.jobs.leases import fail_if_spent
from worker.jobs.losses import (
    Overdue,
    QueueDepth,
    kinds_by_queue,
    known_kind,
    missing_messages,
    only_missing,
    overdue_jobs,
)
from worker.jobs.registry import (
    BUDGET,
    KILL_SWITCH,
    KIND_MODULES,
    UnknownJobKindError,
    get_kind,
    kind_names,
)
from worker.jobs.revocations import announce_revoked
from worker.jobs.sending import Sender, enqueue
from worker.jobs.sweep_report import SweepReport
from worker.runtime import tracing

logger = logging.getLogger(__name__)

EXTRACTION = "extraction"
COMPACTION = "compaction"
CALIBRATION = "calibration"
CONSOLIDATION = "consolidation"

PENDING = PENDING_STATUSES
# The extraction job option that re-extracts a page's skipped (poison) segments (`jobs retry --skipped`).
RETRY_SKIPPED = "retry_skipped"
# Literal SQL so Postgres can match ON CONFLICT to the partial unique index uq_jobs_pending_subject.
PENDING_PREDICATE = text(PENDING_SQL)
# The config keys whose change resumes jobs waiting for budget (worker.accounting owns their meaning).
BUDGET_KEYS = ("llm.budget_daily_usd", "llm.budget_job_usd")


def page_subject(source_id: str, slug: str) -> str:
    return f"{source_id}|{slug}"


def page_subject_sql(source_id: ColumnElement[str], key: ColumnElement[str]) -> ColumnElement[str]:
    """page_subject in SQL."""
    return source_id + literal("|") + key


def split_page_subject(subject: str) -> tuple[str, str]:
    source_id, _, slug = subject.partition("|")
    return source_id, slug


# ---------------------------------------------------------------------------
# Creating jobs (inside the caller's transaction) and sending them (after its commit).
# ---------------------------------------------------------------------------


REQUEST_JOB_ROUNDS = 5


class JobRequestContendedError(RuntimeError):
    """A subject's pending job appeared and vanished on every round of request_job (never in practice)."""


@dataclass(frozen=True)
class JobRequest:
    job_id: int
    created: bool  # False: a pending job for the subject already existed (it was marked for a rerun)


# Built once, for any number of subjects: the subjects go in as one array (unnest), so the statement
# never changes with their number (models.bulk says why that matters), in the order given.
_INSERT_JOBS = text(
    "INSERT INTO jobs (kind, subject, options, status, idempotency_key, traceparent) "
    "SELECT CAST(:kind AS TEXT), subject, CAST(:options AS JSONB), 'queued', "
    "CAST(:idempotency_key AS TEXT), CAST(:traceparent AS TEXT) "
    "FROM unnest(CAST(:subjects AS TEXT[])) WITH ORDINALITY AS given(subject, n) ORDER BY n "
    f"ON CONFLICT (kind, subject) WHERE {PENDING_PREDICATE.text} DO NOTHING RETURNING id, subject"
).bindparams(bindparam("options", type_=JSONB))


_MARK_RERUN = update(JOBS).where(JOBS.c.id == any_(bindparam("ids", type_=ARRAY(BigInteger))))
# The rerun joins the trace of the request that asked for it (when tracing), not the first run's.
_MARK_RERUN = _MARK_RERUN.values(
    rerun_requested=True,
    traceparent=func.coalesce(bindparam("traceparent", type_=Text), JOBS.c.traceparent),
)
_PENDING_OF = (
    select(JOBS.c.id, JOBS.c.subject, JOBS.c.status, JOBS.c.pause_reason)
    .where(
        JOBS.c.kind == bindparam("kind"),
        # Arrays (here and below): an IN list past 65,535 subjects or jobs was refused (a backfill pass).
        JOBS.c.subject == any_(bindparam("subjects", type_=ARRAY(Text))),
        JOBS.c.status.in_(PENDING),
    )
    # The "C" collation's order is the order the subjects were inserted in (Python's sort, code point by
    # code point); the database's own (en_US on the official images) put "Bob" after "alice", and two
    # requests for overlapping subjects, one inserting and one locking, could each wait on the other.
    .order_by(JOBS.c.subject.collate("C"))
    .with_for_update()
)


def request_job(
    session: Session,
    kind: str,
    subject: str,
    *,
    options: dict[str, Any] | None = None,
    idempotency_key: str | None = None,
    renew_spent_budget_after: float | None = None,
) -> JobRequest:
    """Insert a queued job, or reuse the pending one for the same subject (one pending job per subject).

    A job that is already running may have read the old content, so it is marked to run again
    when it finishes; a queued or paused one will read the new content anyway. One paused for its own
    budget starts it over (an extraction's at once; another's once it has run
    ``renew_spent_budget_after`` seconds, when given)."""
    [request] = _request(session, kind, [subject], options, idempotency_key, renew_spent_budget_after)
    return request


def request_jobs(
    session: Session,
    kind: str,
    subjects: Sequence[str],
    *,
    options: dict[str, Any] | None = None,
    renew_spent_budget_after: float | None = None,
) -> list[JobRequest]:
    """``request_job`` for many subjects of one kind, in one INSERT (and at most one SELECT) a round
    instead of two statements each; one request per subject, in the order given."""
    if not subjects:
        return []
    distinct = sorted(set(subjects))
    requests = _request(session, kind, distinct, options, None, renew_spent_budget_after)
    found = dict(zip(distinct, requests, strict=True))
    return [found[subject] for subject in subjects]


def _request(
    session: Session,
    kind: str,
    subjects: Sequence[str],
    options: dict[str, Any] | None,
    idempotency_key: str | None,
    renew_spent_budget_after: float | None = None,
) -> list[JobRequest]:
    """The requests for ``subjects`` (distinct, sorted: rows are inserted and locked in that order, so
    two callers with overlapping subjects cannot deadlock)."""
    if kind not in KIND_MODULES:
        raise UnknownJobKindError(f"unknown job kind {kind!r}; expected one of {sorted(KIND_MODULES)}")
    values = {
        "kind": kind,
        "options": options or {},
        "idempotency_key": idempotency_key,
        "traceparent": tracing.current_traceparent(),  # the job joins the caller's trace (if tracing)
    }
    found: dict[str, JobRequest] = {}
    left = list(subjects)
    # Insert-or-find, again until one of them sees a row: the pending job that made the insert a
    # no-op may finish (committed by its worker) before the SELECT runs, and then there is nothing
    # to find but room to insert. Each round a competing job must have come and gone, so it ends.
    for _ in range(REQUEST_JOB_ROUNDS):
        inserted = session.execute(_INSERT_JOBS, {**values, "subjects": left}).all()
        found.update((row.subject, JobRequest(row.id, created=True)) for row in inserted)
        left = [subject for subject in left if subject not in found]
        if not left:
            break
        existing = session.execute(_PENDING_OF, {"kind": kind, "subjects": left}).all()
        running = [row.id for row in existing if row.status == "running"]
        if running:
            session.execute(_MARK_RERUN, {"ids": running, "traceparent": values["traceparent"]})
        # New content for a job paused for its own budget starts that budget over (else its subject's
        # one pending slot stayed asleep); but for a page's at once, after the caller's wait: a budget
        # started over on every request (an append, an entity's facts) would cap nothing but the day's.
        spent = [row.id for row in existing if row.status == "paused" and row.pause_reason == BUDGET]
        renew_after = 0.0 if kind == EXTRACTION else renew_spent_budget_after
        if spent and renew_after is not None:
            ran_long_enough = JOBS.c.budget_since <= func.now() - func.make_interval(
                0, 0, 0, 0, 0, 0, bindparam("renew_after", renew_after)
            )
            session.execute(
                update(JOBS)
                .where(
                    JOBS.c.id == any_(bindparam(None, spent, type_=ARRAY(BigInteger))),
                    or_(JOBS.c.budget_since.is_(None), ran_long_enough),
                )
                .values(budget_since=func.now())
            )
        found.update((row.subject, JobRequest(row.id, created=False)) for row in existing)
        left = [subject for subject in left if subject not in found]
        if not left:
            break
        logger.info(
            "the pending %s job(s) for %d subject(s) finished meanwhile; requesting again", kind, len(left)
        )
    if left:
        raise JobRequestContendedError(
            f"could not request a {kind} job for {left[0]!r}: its pending job kept changing "
            f"({REQUEST_JOB_ROUNDS} rounds); try again"
        )
    return [found[subject] for subject in subjects]


# ---------------------------------------------------------------------------
# Operators: retry, resume after a kill switch, sweep lost work.
# ---------------------------------------------------------------------------


class JobHasNoSegmentsError(ValueError):
    """``--skipped`` asked of a job that is not an extraction job (only those skip segments)."""


# What the jobs-ended trigger counts the jobs an update ends as, in place of their status, until cleared
# ("" counts the status): transaction-local, read by count_job_ending() (migration 0041).
_COUNT_ENDINGS_AS = text("SELECT set_config('factmill.job_ending', :status, true)")


def cancel_jobs(session: Session, kind: str, subject: str, reason: str) -> int:
    """Fail the pending jobs of ``kind`` on ``subject`` with ``reason`` in the caller's transaction (its
    subject erased); returns how many. A running one loses its lease (worker cleared), and its worker
    hears so at the commit (worker.jobs.revocations; its heartbeat, should that notice be missed): it
    stops before its next LLM call, and its finish writes nothing. The jobs-ended counter counts them as
    cancelled (migration 0041), not failed: an erasure is not a failure to alert on."""
    session.execute(_COUNT_ENDINGS_AS, {"status": "cancelled"})
    cancelled = session.execute(
        update(Job)
        .where(Job.kind == kind, Job.subject == subject, Job.status.in_(PENDING))
        .values(
            status="failed",
            last_error=reason,
            worker=None,
            heartbeat_at=None,
            pause_reason=None,
            provider_outage_since=None,
            rerun_requested=False,
            finished_at=func.now(),
        )
        .returning(Job.id)
    )
    job_ids = cancelled.scalars().all()
    session.execute(_COUNT_ENDINGS_AS, {"status": ""})
    announce_revoked(session, job_ids)  # a running one stops before its next LLM call, not its next beat
    return len(job_ids)


def retry_job(session: Session, job_id: int, *, skipped: bool = False) -> Job:
    """Queue a failed (or paused) job again; a running or queued one is left as it is. ``skipped``
    (extraction jobs only) makes the run re-extract the page's skipped segments first."""
    job = session.get(Job, job_id, with_for_update=True)
    if job is None:
        raise LookupError(f"no job {job_id}")
    if skipped and job.kind != EXTRACTION:
        raise JobHasNoSegmentsError(f"job {job_id} is a {job.kind} job; only extraction jobs skip segments")
    if job.status in ("failed", "paused", "succeeded"):
        if job.kind == EXTRACTION:  # a new dict: JSONB columns do not track changes inside one
            job.options = {**job.options, RETRY_SKIPPED: skipped}
        job.status = "queued"
        job.finished_at = None
        job.last_error = None
        job.pause_reason = None  # a paused job's: shown beside "queued" until its run finished
        # An operator's retry is a fresh start: both budgets begin again (the automatic paths never
        # reset them, so none of them can run a job past either cap).
        job.attempts = 0
        job.worker_losses = 0
        job.provider_outage_since = None  # and the outage clock (worker.jobs.outages)
        job.budget_since = func.now()  # and its own LLM budget (a job paused for it would pause again)
        # Due at once: a backoff's end still ahead (the job failed or was cancelled while waiting it out)
        # would hold the operator's retry until then.
        # (never sent, NULL: left so, the sweeper sends it in seconds should this send fail)
        job.enqueued_at = case((Job.enqueued_at > func.now(), func.now()), else_=Job.enqueued_at)
        job.traceparent = tracing.current_traceparent() or job.traceparent  # the retry's trace (if tracing)
    return job


# The most jobs of each sort (stale, overdue of each queue, resumed) one sweep locks; the rest: the next.
SWEEP_BATCH = 5_000


def resume_paused(
    session: Session,
    kinds: Sequence[str],
    reason: str = KILL_SWITCH,
    job_ids: Sequence[int] | None = None,
    *,
    limit: int = SWEEP_BATCH,
    wait: bool = False,
) -> list[tuple[int, str]]:
    """Turn at most ``limit`` jobs of these kinds (only ``job_ids``, when given) paused for ``reason``
    back into queued ones, oldest first; returns them for enqueueing. The sweeper resumes the rest, a
    batch a sweep: a switch turned on over a day's paused ingest updated and sent every job in one
    transaction (a config change's request, minutes long)."""
    matches = Job.pause_reason == reason
    if reason == KILL_SWITCH:
        matches = or_(matches, Job.pause_reason.is_(None))  # paused before reasons were recorded
    if job_ids is not None:  # one array parameter: an IN list past 65,535 ids is refused
        matches = matches & (Job.id == any_(bindparam("resumed_ids", list(job_ids), type_=ARRAY(BigInteger))))
    batch = (
        select(Job.id)
        .where(Job.status == "paused", Job.kind.in_(kinds), matches)
        .order_by(Job.id)
        .limit(limit)
        # One a claim or a cancel holds is the next sweep's (the sweep holds the rows it locked: it must
        # not wait); ``wait``: a caller that resumes named jobs once (a backfill's cancel) waits for them.
        .with_for_update(skip_locked=not wait)
        .scalar_subquery()
    )
    rows = session.execute(
        update(Job)
        .where(Job.id.in_(batch), Job.status == "paused")
        .values(status="queued", last_error=None, pause_reason=None)
        .returning(Job.id, Job.kind)
    ).all()
    return [(row.id, row.kind) for row in rows]


def resume_budget_waiters(
    session: Session, kinds: Sequence[str], room_for: Callable[[Sequence[int]], list[int]]
) -> list[tuple[int, str]]:
    """Queue the jobs of these kinds paused for budget that the budgets now have room for: asked per
    job, so one whose own budget is spent is not woken on every sweep only to pause again."""
    ready: list[int] = []
    after = 0
    # Read and asked a batch at a time, until a batch's worth has room: a spent day pauses hundreds of
    # thousands, and every id was read on each sweep before the first was asked about.
    while len(ready) < SWEEP_BATCH:
        waiting = session.scalars(
            select(Job.id)
            .where(Job.status == "paused", Job.kind.in_(kinds), Job.pause_reason == BUDGET, Job.id > after)
            .order_by(Job.id)
            .limit(SWEEP_BATCH)
        ).all()
        if not waiting:
            break
        ready += room_for(waiting)
        after = waiting[-1]
    return resume_paused(session, kinds, reason=BUDGET, job_ids=ready[:SWEEP_BATCH]) if ready else []


def kinds_for_switch(key: str) -> list[str]:
    return [name for name in kind_names() if get_kind(name).switch == key]


def _requeue_stale(
    session: Session, stale_after: float, job_budgets: JobBudgets, failed: list[int]
) -> list[tuple[int, str]]:
    """The running jobs whose heartbeat stopped, queued again (a worker loss each), or failed (their
    ids added to ``failed``) when their budgets are spent."""
    stale = session.execute(
        select(Job.id, Job.kind, Job.attempts, Job.worker_losses)
        .where(
            Job.status == "running",
            Job.heartbeat_at < func.now() - timedelta(seconds=stale_after),
            known_kind(),
        )
        .order_by(Job.heartbeat_at)
        .limit(SWEEP_BATCH)
        .with_for_update(skip_locked=True)
    ).all()
    stale_pairs = []
    for row in stale:
        if fail_if_spent(session, row.id, row.attempts, row.worker_losses + 1, job_budgets) is not None:
            failed.append(row.id)
            continue
        session.execute(
            update(Job)
            .where(Job.id == row.id)
            .values(
                status="queued",
                worker=None,
                worker_losses=Job.worker_losses + 1,
                last_error="worker lost (stale heartbeat); requeued",
                # Due now (an operator's run may have taken it during a backoff, whose end stayed ahead).
                enqueued_at=func.least(Job.enqueued_at, func.now()),
            )
        )
        stale_pairs.append((row.id, row.kind))
    return stale_pairs


def sweep(
    factory: sessionmaker[Session],
    *,
    stale_after: float,
    requeue_after: float,
    enabled: Callable[[str], bool],
    job_budgets: JobBudgets,
    budget_room_for: Callable[[Sequence[int]], list[int]] | None = None,
    budget_has_room: Callable[[], bool] | None = None,
    sender: Sender | None = None,
    queue_depth: QueueDepth | None = None,
) -> SweepReport:
    """Re-send what the broker lost: running jobs whose worker died (a worker loss each), queued jobs
    whose message vanished, and paused jobs whose kill switch is on again. A job whose budgets are
    spent is failed instead of re-sent. Jobs paused for budget go again when ``budget_room_for`` (which
    of these job ids both budgets would let call) includes them. Postgres is the source of truth."""
    failed: list[int] = []
    # Asked before the transaction: a broker that hangs must not hold the rows it locks (claims, webhook
    # deliveries and erasures of those jobs waited on it).
    missing = missing_messages(factory, requeue_after, queue_depth) if queue_depth is not None else None
    with factory.begin() as session:
        stale_pairs = _requeue_stale(session, stale_after, job_budgets, failed)
        just_requeued = {i for i, _ in stale_pairs}
        overdue = []
        # A batch a queue: one batch over every queue, one queue's backlog (a bulk ingest, every message
        # still on its queue) filled it, and another queue's lost messages waited until it was worked off.
        # (Not a batch a kind: a queue's missing count is over all its kinds, and sliced from two kinds'
        # batches it re-sent the younger kind's jobs while the cut-off kind's older ones waited.)
        for kinds in kinds_by_queue().values():
            for waiting in session.execute(overdue_jobs(kinds, requeue_after, SWEEP_BATCH)):
                spent = fail_if_spent(
                    session, waiting.id, waiting.attempts, waiting.worker_losses, job_budgets
                )
                if spent is not None:
                    failed.append(waiting.id)
                elif waiting.id not in just_requeued:
                    overdue.append(Overdue(waiting.id, waiting.kind, waiting.enqueued_at))
        lost_pairs = only_missing(overdue, None if missing is None else missing.get)
        switched_on = [name for name in kind_names() if enabled(get_kind(name).switch)]
        resumed = resume_paused(session, switched_on) if switched_on else []
    enqueue(factory, [*stale_pairs, *lost_pairs, *resumed], sender)
    unread: SQLAlchemyError | None = None
    if budget_room_for is not None and switched_on:
        # After the re-sends, in a transaction of its own: the budgets' read (a sum over llm_calls for
        # every waiter) held the rows the sweep had locked, and its failure rolled the re-sends back.
        try:  # (the day's budget asked first: spent, no waiter is read, hundreds of thousands)
            if budget_has_room is None or budget_has_room():
                with factory.begin() as session:
                    woken = resume_budget_waiters(session, switched_on, budget_room_for)
                enqueue(factory, woken, sender)
                resumed += woken
        except SQLAlchemyError as exc:
            unread = exc
    report = SweepReport(
        [i for i, _ in stale_pairs], [i for i, _ in lost_pairs], [i for i, _ in resumed], failed
    )
    report.log()
    if unread is not None:  # the step fails (Flower shows it), its re-sends done and reported
        raise unread
    return report


def resume_for_config_change(session: Session, key: str, value: str | None) -> list[tuple[int, str]]:
    """In the transaction that changes ``key`` (to ``value``; None: unset): a kill switch turned on
    resumes its paused jobs, and a budget change resumes the jobs waiting for budget (they pause again
    if there is still no room).
    Returns the resumed (job id, kind) pairs to enqueue after the commit."""
    if key in KILL_SWITCHES and is_enabled(value):
        return resume_paused(session, kinds_for_switch(key))
    if key in BUDGET_KEYS:
        return resume_paused(session, list(kind_names()), reason=BUDGET)
    return []


def apply_switch_change(
    factory: sessionmaker[Session], key: str, value: str, sender: Sender | None = None
) -> int:
    """After a config change committed elsewhere: resume what it unblocks and enqueue it."""
    with factory.begin() as session:
        resumed = resume_for_config_change(session, key, value)
    enqueue(factory, resumed, sender)
    return len(resumed)
