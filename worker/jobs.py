"""Jobs: the Postgres outbox (create, enqueue after commit), leases, heartbeats, pause/resume, sweeping."""

from __future__ import annotations

import logging
import socket
import threading
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import and_, func, or_, select, text, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session, sessionmaker

from models import Job
from worker.config_store import CALIBRATION_ENABLED, COMPACTION_ENABLED, EXTRACTION_ENABLED

logger = logging.getLogger(__name__)

EXTRACTION = "extraction"
COMPACTION = "compaction"
CALIBRATION = "calibration"

PENDING = ("queued", "running", "paused")
KILL_SWITCH = "kill_switch"  # pause reasons
BUDGET = "budget"
# Literal SQL so Postgres can match ON CONFLICT to the partial unique index uq_jobs_pending_subject.
PENDING_PREDICATE = text("status IN ('queued', 'running', 'paused')")
FINISHED = ("succeeded", "failed")

# kind → (Celery task name, queue, kill switch). The one table every sender reads.
JOB_KINDS: dict[str, tuple[str, str, str]] = {
    EXTRACTION: ("tasks.extraction.extract_page", "extraction", EXTRACTION_ENABLED),
    COMPACTION: ("tasks.compaction.compact_transcript", "compaction", COMPACTION_ENABLED),
    CALIBRATION: ("tasks.calibration.recompute", "calibration", CALIBRATION_ENABLED),
}


class UnknownJobKindError(ValueError):
    pass


def page_subject(source_id: str, slug: str) -> str:
    return f"{source_id}|{slug}"


def split_page_subject(subject: str) -> tuple[str, str]:
    source_id, _, slug = subject.partition("|")
    return source_id, slug


def now() -> datetime:
    return datetime.now(UTC)


# ---------------------------------------------------------------------------
# Creating jobs (inside the caller's transaction) and sending them (after its commit).
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class JobRequest:
    job_id: int
    created: bool  # False: a pending job for the subject already existed (it was marked for a rerun)


def request_job(
    session: Session,
    kind: str,
    subject: str,
    *,
    options: dict[str, Any] | None = None,
    idempotency_key: str | None = None,
) -> JobRequest:
    """Insert a queued job, or reuse the pending one for the same subject (one pending job per subject).

    A job that is already running may have read the old content, so it is marked to run again
    when it finishes; a queued or paused one will read the new content anyway.
    """
    if kind not in JOB_KINDS:
        raise UnknownJobKindError(f"unknown job kind {kind!r}; expected one of {sorted(JOB_KINDS)}")
    stmt = (
        insert(Job)
        .values(
            kind=kind,
            subject=subject,
            options=options or {},
            status="queued",
            idempotency_key=idempotency_key,
        )
        .on_conflict_do_nothing(index_elements=[Job.kind, Job.subject], index_where=PENDING_PREDICATE)
        .returning(Job.id)
    )
    job_id = session.execute(stmt).scalar_one_or_none()
    if job_id is not None:
        return JobRequest(job_id, created=True)
    existing = session.execute(
        select(Job.id, Job.status)
        .where(Job.kind == kind, Job.subject == subject, Job.status.in_(PENDING))
        .with_for_update()
    ).one()
    if existing.status == "running":
        session.execute(update(Job).where(Job.id == existing.id).values(rerun_requested=True))
    return JobRequest(existing.id, created=False)


Sender = Callable[[str, int, str], None]  # (task name, job id, queue)


def celery_sender(task_name: str, job_id: int, queue: str) -> None:
    from worker.celery_app import app

    app.send_task(task_name, args=[job_id], queue=queue)


def enqueue(
    factory: sessionmaker[Session], jobs: Iterable[tuple[int, str]], sender: Sender | None = None
) -> int:
    """Hand (job id, kind) pairs to the broker after their transaction committed; returns how many went.

    A broker that is down loses nothing: the job stays queued in Postgres and the sweeper sends it.
    """
    send = sender or celery_sender
    sent: list[int] = []
    pending = list(jobs)
    for index, (job_id, kind) in enumerate(pending):
        task_name, queue, _ = JOB_KINDS[kind]
        try:
            send(task_name, job_id, queue)
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
    if sent:
        with factory.begin() as session:
            session.execute(update(Job).where(Job.id.in_(sent)).values(enqueued_at=func.now()))
    return len(sent)


# ---------------------------------------------------------------------------
# Leases: one worker per job, kept alive by heartbeats.
# ---------------------------------------------------------------------------


class LeaseLostError(RuntimeError):
    """Another worker took this job over (our heartbeat went stale); stop without writing more."""


def new_lease_token() -> str:
    return f"{socket.gethostname()}:{uuid.uuid4().hex[:12]}"


def claim(factory: sessionmaker[Session], job_id: int, token: str, stale_after: float) -> Job | None:
    """Take the job if it is queued (or paused, or running with a stale heartbeat); None otherwise.

    A redelivered message for a job another worker holds, or one that already finished, gets None.
    """
    stale = func.now() - timedelta(seconds=stale_after)
    with factory.begin() as session:
        return session.execute(
            update(Job)
            .where(
                Job.id == job_id,
                or_(
                    Job.status.in_(("queued", "paused")),
                    and_(Job.status == "running", or_(Job.heartbeat_at.is_(None), Job.heartbeat_at < stale)),
                ),
            )
            .values(
                status="running",
                worker=token,
                attempts=Job.attempts + 1,
                heartbeat_at=func.now(),
                started_at=func.coalesce(Job.started_at, func.now()),
                last_error=None,
            )
            .returning(Job)
        ).scalar_one_or_none()


def heartbeat(factory: sessionmaker[Session], job_id: int, token: str) -> bool:
    """Refresh the lease; False when it is no longer ours."""
    with factory.begin() as session:
        row = session.execute(
            update(Job)
            .where(Job.id == job_id, Job.worker == token, Job.status == "running")
            .values(heartbeat_at=func.now())
            .returning(Job.id)
        ).scalar_one_or_none()
    return row is not None


class Heartbeat:
    """Refreshes a job's lease on a background thread; ``check()`` raises once the lease is lost."""

    def __init__(self, factory: sessionmaker[Session], job_id: int, token: str, interval: float) -> None:
        self.factory, self.job_id, self.token, self.interval = factory, job_id, token, interval
        self._stop = threading.Event()
        self._lost = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{job_id}", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                if not heartbeat(self.factory, self.job_id, self.token):
                    self._lost.set()
                    return
            except Exception as exc:  # a database blip must not kill the job; the next beat retries
                logger.warning("heartbeat for job %s failed: %s", self.job_id, exc)

    def check(self) -> None:
        if self._lost.is_set():
            raise LeaseLostError(f"job {self.job_id} was taken over by another worker")

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=self.interval + 5)


def finish(
    factory: sessionmaker[Session],
    job_id: int,
    token: str,
    status: str,
    *,
    counters: dict[str, Any] | None = None,
    last_error: str | None = None,
    requeue_at: datetime | None = None,
    pause_reason: str | None = None,
) -> tuple[int, str] | None:
    """Record the end of a run (succeeded, failed, paused, or queued again for a retry).

    Returns (job id, kind) when the job must be sent again: a rerun was requested while it ran.
    Writes nothing if the lease is no longer ours.
    """
    values: dict[str, Any] = {
        "status": status,
        "heartbeat_at": None,
        "worker": None,
        "pause_reason": pause_reason if status == "paused" else None,
    }
    if counters is not None:
        values["counters"] = counters
    values["last_error"] = last_error
    if status in FINISHED:
        values["finished_at"] = func.now()
    if requeue_at is not None:
        values["enqueued_at"] = requeue_at
    with factory.begin() as session:
        job = session.execute(
            update(Job).where(Job.id == job_id, Job.worker == token).values(**values).returning(Job)
        ).scalar_one_or_none()
        if job is None:
            return None
        if status == "succeeded" and job.rerun_requested:
            session.execute(
                update(Job)
                .where(Job.id == job_id)
                .values(status="queued", rerun_requested=False, finished_at=None)
            )
            return job_id, job.kind
    return None


def release_for_retry(factory: sessionmaker[Session], job_id: int, token: str, last_error: str) -> None:
    """Give a claimed job back to the queue without running it (e.g. the page is busy)."""
    finish(factory, job_id, token, "queued", last_error=last_error)


# ---------------------------------------------------------------------------
# Operators: retry, resume after a kill switch, sweep lost work.
# ---------------------------------------------------------------------------


def retry_job(session: Session, job_id: int) -> Job:
    """Queue a failed (or paused) job again; a running or queued one is left as it is."""
    job = session.get(Job, job_id, with_for_update=True)
    if job is None:
        raise LookupError(f"no job {job_id}")
    if job.status in ("failed", "paused", "succeeded"):
        job.status = "queued"
        job.finished_at = None
        job.last_error = None
        job.attempts = 0
    return job


def resume_paused(session: Session, kinds: Sequence[str], reason: str = KILL_SWITCH) -> list[tuple[int, str]]:
    """Turn jobs of these kinds paused for ``reason`` back into queued ones; returns them for enqueueing."""
    matches = Job.pause_reason == reason
    if reason == KILL_SWITCH:
        matches = or_(matches, Job.pause_reason.is_(None))  # paused before reasons were recorded
    rows = session.execute(
        update(Job)
        .where(Job.status == "paused", Job.kind.in_(kinds), matches)
        .values(status="queued", last_error=None, pause_reason=None)
        .returning(Job.id, Job.kind)
    ).all()
    return [(row.id, row.kind) for row in rows]


def kinds_for_switch(key: str) -> list[str]:
    return [kind for kind, (_, _, switch) in JOB_KINDS.items() if switch == key]


@dataclass
class SweepReport:
    requeued_stale: list[int]
    resent_queued: list[int]
    resumed_paused: list[int]

    @property
    def total(self) -> int:
        return len(self.requeued_stale) + len(self.resent_queued) + len(self.resumed_paused)


def sweep(
    factory: sessionmaker[Session],
    *,
    stale_after: float,
    requeue_after: float,
    enabled: Callable[[str], bool],
    budget_has_room: Callable[[], bool] | None = None,
    sender: Sender | None = None,
) -> SweepReport:
    """Re-send what the broker lost: running jobs whose worker died, queued jobs whose message
    vanished, and paused jobs whose kill switch is on again. Postgres is the source of truth."""
    with factory.begin() as session:
        stale = session.execute(
            update(Job)
            .where(Job.status == "running", Job.heartbeat_at < func.now() - timedelta(seconds=stale_after))
            .values(status="queued", worker=None, last_error="worker lost (stale heartbeat); requeued")
            .returning(Job.id, Job.kind)
        ).all()
        lost = session.execute(
            select(Job.id, Job.kind).where(
                Job.status == "queued",
                or_(
                    Job.enqueued_at.is_(None) & (Job.created_at < func.now() - timedelta(seconds=2)),
                    Job.enqueued_at < func.now() - timedelta(seconds=requeue_after),
                ),
            )
        ).all()
        switched_on = [k for k, (_, _, switch) in JOB_KINDS.items() if enabled(switch)]
        resumed = resume_paused(session, switched_on) if switched_on else []
        if budget_has_room is not None and budget_has_room():
            resumed += resume_paused(session, switched_on, reason=BUDGET)
    stale_pairs = [(r.id, r.kind) for r in stale]
    lost_pairs = [(r.id, r.kind) for r in lost if r.id not in {i for i, _ in stale_pairs}]
    enqueue(factory, [*stale_pairs, *lost_pairs, *resumed], sender)
    report = SweepReport([i for i, _ in stale_pairs], [i for i, _ in lost_pairs], [i for i, _ in resumed])
    if report.total:
        logger.info("sweep re-sent %s job(s): %s", report.total, report)
    return report


def resume_for_config_change(session: Session, key: str, value: str) -> list[tuple[int, str]]:
    """In the transaction that changes ``key``: a kill switch turned on resumes its paused jobs, and a
    budget change resumes the jobs waiting for budget (they pause again if there is still no room).
    Returns the resumed (job id, kind) pairs to enqueue after the commit."""
    from worker.config_store import KILL_SWITCHES, is_enabled
    from worker.llm.budget import BUDGET_KEYS

    if key in KILL_SWITCHES and is_enabled(value):
        return resume_paused(session, kinds_for_switch(key))
    if key in BUDGET_KEYS:
        return resume_paused(session, list(JOB_KINDS), reason=BUDGET)
    return []


def apply_switch_change(
    factory: sessionmaker[Session], key: str, value: str, sender: Sender | None = None
) -> int:
    """After a config change committed elsewhere: resume what it unblocks and enqueue it."""
    with factory.begin() as session:
        resumed = resume_for_config_change(session, key, value)
    enqueue(factory, resumed, sender)
    return len(resumed)
