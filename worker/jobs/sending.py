"""Sending jobs to the broker after their transaction committed, and what the broker holds."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

from celery import Celery
from sqlalchemy import BigInteger, any_, bindparam, func, or_, select, update
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from models import Job
from models.reads import one_statement
from models.tables import JOBS
from worker.jobs.celery_app import app
from worker.jobs.registry import get_kind
from worker.runtime import tracing
from worker.settings import get_settings

logger = logging.getLogger(__name__)


Sender = Callable[[str, int, str], None]  # (task name, job id, queue)


def celery_sender(task_name: str, job_id: int, queue: str) -> None:
    # In production without FACTMILL_BROKER_URL, refused before Celery reads its settings: refused while
    # it read them (celery_app.broker_url), Celery dropped them, and a second send of the process went
    # to its own default broker, amqp://guest@localhost.
    get_settings().require_servers("broker_url")
    app.send_task(task_name, args=[job_id], queue=queue)


def broker_queue_depth(queue: str, celery: Celery = app) -> int | None:
    """Messages waiting in ``queue`` on the broker, or None when it cannot say (it is down). Declaring
    the queue (not passively: Redis keeps no record of a queue only sent to) creates nothing a worker
    would not; an empty or flushed queue answers 0. Declared as Celery declares it (its kombu Queue:
    durable): with py-amqp's defaults (not durable, auto-delete) RabbitMQ refused the declaration of a
    queue Celery had made (406), the depth was never known, and every sweep sent every overdue job again."""
    try:
        with celery.connection_for_read() as connection:
            channel = connection.default_channel
            declared = celery.amqp.queues.get(queue)
            if declared is not None:
                return int(declared(channel).queue_declare().message_count)
            return int(channel.queue_declare(queue=queue).message_count)
    except Exception:
        return None


# One array parameter: an IN list of the jobs sent (one parameter each) failed past 65,535 of them,
# after they had all gone to the broker.
# A job whose retry ran while the loop went on (its finish put enqueued_at ahead, the backoff's end) keeps
# that time: marked now, it looked freshly sent, and the sweeper's count of missing messages ran short.
_MARK_ENQUEUED = (
    update(JOBS)
    .where(JOBS.c.id == any_(bindparam("ids", type_=ARRAY(BigInteger))))
    .where(or_(JOBS.c.enqueued_at.is_(None), JOBS.c.enqueued_at <= func.now()))
    .values(enqueued_at=func.now())
)


# Sent jobs are marked in slices: the sweeper sends again a job left unmarked for 2 s, so marking them
# only after a long send loop (a sweep of thousands, a slow broker) sent the first ones twice.
MARK_EVERY_SECONDS = 0.5


def enqueue(
    factory: sessionmaker[Session], jobs: Iterable[tuple[int, str]], sender: Sender | None = None
) -> int:
    """Hand (job id, kind) pairs to the broker after their transaction committed; returns how many went.

    A broker that is down loses nothing: the job stays queued in Postgres and the sweeper sends it. Nor
    does a database that fails now: the jobs committed already, so it never raises for it (an API route
    answered 503 "try again" for a delivery it had stored, and an unkeyed retry stored it twice); a job
    it could not mark is sent once more by the sweeper, and its claim takes it once.
    """
    send = sender or celery_sender
    sent: list[int] = []
    unmarked: list[int] = []
    pending = list(jobs)
    parents: dict[int, str] = {}
    if tracing.enabled():
        with _database_may_fail("read the traceparents of the jobs to send"):
            parents = traceparents(factory, [job_id for job_id, _ in pending])
    marked_at, marking = time.monotonic(), True
    for index, (job_id, kind) in enumerate(pending):
        spec = get_kind(kind)
        try:
            # Sent in the trace of the request that created the job, even from the sweeper.
            with tracing.resumed(parents.get(job_id)):
                send(spec.task_name, job_id, spec.queue)
        except Exception as exc:
            # The broker is down: the rest would fail the same way (slowly). They stay queued in
            # Postgres, and the sweeper sends them once the broker is back.
            logger.warning(
                "could not enqueue %s job(s) from job %s on (the broker said: %s); they stay queued and "
                "the sweeper will send them",
                len(pending) - index,
                job_id,
                exc,
            )
            break
        sent.append(job_id)
        unmarked.append(job_id)
        if marking and time.monotonic() - marked_at >= MARK_EVERY_SECONDS:
            # A database that failed once is not asked again in this loop: each try could wait out
            # a connect timeout (a silent server), slice after slice.
            marking = _mark_enqueued(factory, unmarked)
            unmarked, marked_at = [], time.monotonic()
    if marking:
        _mark_enqueued(factory, unmarked)
    return len(sent)


def _mark_enqueued(factory: sessionmaker[Session], job_ids: list[int]) -> bool:
    """Mark ``job_ids`` sent; False when the database failed (the sweeper sends them again)."""
    if not job_ids:
        return True
    with _database_may_fail("mark the jobs just sent"), one_statement(factory) as session:
        session.connection().execute(_MARK_ENQUEUED, {"ids": job_ids})
        return True
    return False


@contextlib.contextmanager
def _database_may_fail(doing: str) -> Iterator[None]:
    try:
        yield
    except SQLAlchemyError as exc:
        logger.warning(
            "could not %s (the database said: %s); the sweeper sends them again",
            doing,
            type(exc).__name__,
        )


def traceparents(factory: sessionmaker[Session], job_ids: Sequence[int]) -> dict[int, str]:
    """The stored traceparents of these jobs (tracing on only: one query per enqueue)."""
    if not job_ids:
        return {}
    with factory() as session:
        rows = session.execute(
            select(Job.id, Job.traceparent).where(
                Job.id == any_(bindparam("traced_ids", list(job_ids), type_=ARRAY(BigInteger))),
                Job.traceparent.is_not(None),
            )
        ).all()
    return {row.id: row.traceparent for row in rows}
