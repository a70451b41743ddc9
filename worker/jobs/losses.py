"""Which overdue queued jobs lost their message: the sweeper's loss check (worker.jobs.outbox.sweep)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import ColumnElement, Select, func, or_, select
from sqlalchemy.orm import Session, sessionmaker

from models import Job
from worker.jobs.registry import get_kind, kind_names

# How many messages wait in a queue on the broker (None: the broker cannot say).
QueueDepth = Callable[[str], int | None]
# How many of a queue's overdue jobs have no message on the broker (None: the broker cannot say).
MissingMessages = Callable[[str], int | None]


@dataclass(frozen=True)
class Overdue:
    """A queued job no worker has taken for longer than requeue_after."""

    job_id: int
    kind: str
    sent_at: datetime | None  # its last send (enqueued_at); None: never sent


def only_missing(overdue: list[Overdue], missing_in: MissingMessages | None) -> list[tuple[int, str]]:
    """Of the queued jobs overdue for a worker (never sent first, then the oldest sends), those whose
    message the broker is missing: every one never sent and, per queue, as many of the sent ones
    (oldest first) as it is missing. A queue that holds as many as are overdue is a backlog, not a
    loss; re-sending all of it on every sweep grew the queue by the whole backlog each time
    (bench/chaos.py saw 52,000 messages for 400 jobs). Where the broker cannot say, every overdue job
    is re-sent: a duplicate costs a skipped claim, a loss would cost the job.

    Which messages are missing the broker does not say. The oldest are the common loss (a dead
    worker's prefetched messages, off the queue until their visibility timeout), and a job sent again
    goes to the back of the line. When the newest were lost instead (a failover to a replica behind),
    the oldest re-sent are duplicates that count as fresh at the next sweep, and the loss waits for
    the backlog to drain."""
    pairs = [(job.job_id, job.kind) for job in overdue if job.sent_at is None]
    by_queue: dict[str, list[Overdue]] = {}
    for job in overdue:
        if job.sent_at is not None:
            by_queue.setdefault(get_kind(job.kind).queue, []).append(job)
    for queue, waiting_jobs in by_queue.items():
        missing = None if missing_in is None else missing_in(queue)
        count = len(waiting_jobs) if missing is None else missing
        pairs += [(job.job_id, job.kind) for job in waiting_jobs[:count]]
    return pairs


def known_kind() -> ColumnElement[bool]:
    """A job of a kind this version runs. A pending row of another (left by a newer version during a
    rolling deploy, or by an older one after a downgrade) is left as it is for a version that knows it:
    asked for its queue, it failed every sweep, and no lost job was sent again nor paused one resumed."""
    return Job.kind.in_(kind_names())


def missing_messages(
    factory: sessionmaker[Session], requeue_after: float, queue_depth: QueueDepth
) -> dict[str, int | None]:
    """Of each queue that has jobs sent and overdue (none asked when none has): how many of those jobs'
    messages the broker is missing (None: it cannot say). Its depth counts the messages of jobs sent
    lately (within ``requeue_after``) too: counted as overdue ones', a steady backlog of them hid every
    lost message behind it, and the jobs that lost theirs were never sent again while the backlog lasted.
    All the overdue jobs are counted, not the sweep's batch of them: measured against a batch, a backlog
    longer than one hid the losses behind it."""
    cutoff = func.now() - timedelta(seconds=requeue_after)
    with factory() as session:
        overdue_by_kind = session.execute(
            select(Job.kind, func.count())
            .where(Job.status == "queued", Job.enqueued_at < cutoff, known_kind())
            .group_by(Job.kind)
        ).all()
        if not overdue_by_kind:
            return {}
        # Not a job waiting out a retry's backoff (enqueued_at ahead): its delayed message is held by a
        # worker until due, not queued, so it is in no depth.
        fresh_by_kind = session.execute(
            select(Job.kind, func.count())
            .where(
                Job.status == "queued",
                Job.enqueued_at >= cutoff,
                Job.enqueued_at <= func.now(),
                known_kind(),
            )
            .group_by(Job.kind)
        ).all()
    fresh: dict[str, int] = {}
    for kind, count in fresh_by_kind:
        queue = get_kind(kind).queue
        fresh[queue] = fresh.get(queue, 0) + int(count)
    overdue: dict[str, int] = {}
    for kind, count in overdue_by_kind:
        queue = get_kind(kind).queue
        overdue[queue] = overdue.get(queue, 0) + int(count)
    missing: dict[str, int | None] = {}
    for queue, count in overdue.items():
        depth = queue_depth(queue)
        missing[queue] = None if depth is None else max(0, count - max(0, depth - fresh.get(queue, 0)))
    return missing


def kinds_by_queue() -> dict[str, list[str]]:
    """The kinds this version runs, by the queue they are sent to (a backfill's jobs are on extraction's)."""
    queues: dict[str, list[str]] = {}
    for kind in kind_names():
        queues.setdefault(get_kind(kind).queue, []).append(kind)
    return queues


def overdue_jobs(
    kinds: list[str], requeue_after: float, batch: int
) -> Select[int, str, int, int, datetime | None]:
    """One queue's queued jobs (of ``kinds``) overdue for a worker: never sent (2 s after their request's
    commit), or sent longer ago than the requeue wait. Never sent first, then the oldest sends: a dead
    worker's prefetched messages (its oldest) are off the queue until their visibility timeout, and a
    job sent again goes to the back. At most ``batch`` (a bulk ingest's backlog: the rest next sweep)."""
    return (
        select(Job.id, Job.kind, Job.attempts, Job.worker_losses, Job.enqueued_at)
        .where(
            Job.status == "queued",
            Job.kind.in_(kinds),
            or_(
                Job.enqueued_at.is_(None) & (Job.created_at < func.now() - timedelta(seconds=2)),
                Job.enqueued_at < func.now() - timedelta(seconds=requeue_after),
            ),
        )
        .order_by(Job.enqueued_at.asc().nulls_first(), Job.id)
        .limit(batch)
        .with_for_update(skip_locked=True)
    )
