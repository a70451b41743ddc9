"""Which overdue queued jobs lost their message: the sweeper's loss check (worker.jobs.outbox.sweep)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from models import Job
from worker.jobs.registry import all_kinds, get_kind

# How many messages wait in a queue on the broker (None: the broker cannot say).
QueueDepth = Callable[[str], int | None]


@dataclass(frozen=True)
class Overdue:
    """A queued job no worker has taken for longer than requeue_after."""

    job_id: int
    kind: str
    sent_at: datetime | None  # its last send (enqueued_at); None: never sent


# How far out of send order a queue's consumers may take messages (each worker reserves its own).
FIFO_SLACK = timedelta(seconds=30)
NewestConsumed = Callable[[Sequence[str], datetime], datetime | None]


def newest_consumed(session: Session, kinds: Sequence[str], since: datetime) -> datetime | None:
    """The latest send, after ``since``, of a job of these kinds that a worker has claimed since that
    send: the newest message known consumed from their queue (ix_jobs_claimed_at)."""
    return session.scalar(
        select(func.max(Job.enqueued_at)).where(
            Job.kind.in_(kinds),
            Job.claimed_at > since,
            Job.enqueued_at > since,
            Job.claimed_at >= Job.enqueued_at,
        )
    )


def only_missing(
    overdue: list[Overdue], queue_depth: QueueDepth | None, consumed: NewestConsumed | None = None
) -> list[tuple[int, str]]:
    """Of the queued jobs overdue for a worker (oldest send first), those whose message the broker is
    missing: every one never sent; per queue, as many of the sent ones (oldest first) as the queue holds
    fewer messages than there are of them; and any sent before a message of their queue that a worker
    has consumed since (FIFO: theirs went first, so it is gone). A queue at least as long as the
    overdue list is otherwise a backlog, not a loss; re-sending all of it on every sweep grew the queue
    by the whole backlog each time (bench/chaos.py saw 52,000 messages for 400 jobs). But the depth alone
    hid a lost message for as long as newer work kept its queue busy. Without a depth (unknown, or the
    broker cannot say) every overdue job is re-sent: a duplicate costs a skipped claim, a loss the job."""
    pairs = [(job.job_id, job.kind) for job in overdue if job.sent_at is None]
    by_queue: dict[str, list[Overdue]] = {}
    for job in overdue:
        if job.sent_at is not None:
            by_queue.setdefault(get_kind(job.kind).queue, []).append(job)
    for queue, waiting_jobs in by_queue.items():
        depth = None if queue_depth is None else queue_depth(queue)
        missing = len(waiting_jobs) if depth is None else max(0, len(waiting_jobs) - depth)
        held = waiting_jobs[missing:]
        if held and consumed is not None:
            kinds = [kind.name for kind in all_kinds() if kind.queue == queue]
            oldest = min(job.sent_at for job in held if job.sent_at is not None)
            newest = consumed(kinds, oldest)
            if newest is not None:
                missing += sum(1 for job in held if job.sent_at and job.sent_at + FIFO_SLACK < newest)
        pairs += [(job.job_id, job.kind) for job in waiting_jobs[:missing]]
    return pairs
