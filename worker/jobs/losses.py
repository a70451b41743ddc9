"""Which overdue queued jobs lost their message: the sweeper's loss check (worker.jobs.outbox.sweep)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from worker.jobs.registry import get_kind

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
