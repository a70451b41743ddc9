"""Leases: one worker per job, kept alive by heartbeats, released by ``finish``."""

from __future__ import annotations

import logging
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import (
    ARRAY,
    Boolean,
    Engine,
    Float,
    Interval,
    Text,
    and_,
    bindparam,
    case,
    func,
    or_,
    select,
    update,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Session, sessionmaker

from models import Job
from models.tables import JOBS
from worker.core import progress
from worker.core.errors import error_summary
from worker.jobs import revocations
from worker.jobs.budgets import JobBudgets
from worker.jobs.outages import ClockChange
from worker.runtime.logs import bound_fields, log_context

logger = logging.getLogger(__name__)

FINISHED = ("succeeded", "failed")


class LeaseLostError(RuntimeError):
    """Another worker took this job over (our heartbeat went stale); stop without writing more."""


def new_lease_token() -> str:
    return f"{socket.gethostname()}:{uuid.uuid4().hex[:12]}"


# Options asked of a job's rerun while it runs (a forced compaction requested meanwhile): the run in
# progress read its own at its claim, and its one-run options are dropped when it reruns.
NEXT_RUN = "next_run"


def options_for_its_next_run(**values: Any) -> Any:
    """The options column after a request sets ``values`` on a pending job: at once on a queued or
    paused one; on one running now, for its next run (set at once, its rerun dropped them with the
    run's own one-run options), which takes them at its claim."""
    asked = func.jsonb_build_object(*(part for item in values.items() for part in item))
    held = func.coalesce(JOBS.c.options[NEXT_RUN], func.jsonb_build_object())
    later = JOBS.c.options.op("||", return_type=JSONB)(
        func.jsonb_build_object(NEXT_RUN, held.op("||", return_type=JSONB)(asked))
    )
    return case((JOBS.c.status == "running", later), else_=JOBS.c.options.op("||", return_type=JSONB)(asked))


def spend_one_run_options(session: Session, job_id: int, one_run_options: tuple[str, ...]) -> None:
    """In the caller's transaction, drop the run's one-run options from the job (what was asked of its
    next run stays in next_run): for a run whose result is committed before the job is finished, so a
    run that takes the job over (its worker lost in between) does not do the same work again."""
    session.execute(update(JOBS).where(JOBS.c.id == job_id).values(options=_rerun_options(one_run_options)))


def _rerun_options(one_run_options: tuple[str, ...]) -> Any:
    """A rerun's options: the run's, less its one-run options (what was asked of the rerun meanwhile
    waits in next_run for its claim)."""
    return JOBS.c.options.op("-", return_type=JSONB)(
        bindparam("one_run", list(one_run_options), type_=ARRAY(Text))
    )


# The options a claimed run reads: what was asked of the next run while the last one ran joins them, on
# whatever path that run ended (a rerun, a retry, a pause, a release, a lease taken over).
_CLAIMED_OPTIONS = (
    JOBS.c.options.op("||", return_type=JSONB)(
        func.coalesce(JOBS.c.options[NEXT_RUN], func.jsonb_build_object())
    )
).op("-", return_type=JSONB)(NEXT_RUN)


# A worker's message for a job waiting out a retry's backoff (enqueued_at ahead) runs it only this close
# to its time: Celery's countdown runs by the worker's clock, which may be a little ahead of the database's.
DUE_SLACK_SECONDS = 5.0
# Whether a queued job is due: its backoff over (or nearly), or never put off. An operator's run (due_only
# false) takes it whenever asked.
_DUE = or_(
    ~bindparam("due_only", type_=Boolean),
    JOBS.c.enqueued_at.is_(None),
    JOBS.c.enqueued_at <= func.now() + timedelta(seconds=DUE_SLACK_SECONDS),
)

# Seconds until a queued job is due, when it is not (what a claim that found it so answers).
_NOT_DUE_IN = select(func.extract("epoch", JOBS.c.enqueued_at - func.now())).where(
    JOBS.c.id == bindparam("job_id"),
    JOBS.c.status == "queued",
    JOBS.c.enqueued_at > func.now() + timedelta(seconds=DUE_SLACK_SECONDS),
)

# The claim, one statement built once (a job's claim runs for every page): the row is taken if it is
# claimable, its lock held by the UPDATE itself, so a second claimer waits and then finds it running.
# The SET clause reads the row as it was: taking over a running job (a stale lease) counts a loss.
_CLAIM = (
    update(JOBS)
    .where(
        JOBS.c.id == bindparam("job_id"),
        or_(
            and_(JOBS.c.status == "queued", _DUE),
            JOBS.c.status == "paused",
            and_(
                JOBS.c.status == "running",
                or_(
                    JOBS.c.heartbeat_at.is_(None),
                    JOBS.c.heartbeat_at < func.now() - bindparam("stale_after", type_=Interval()),
                ),
            ),
        ),
    )
    .values(
        status="running",
        worker=bindparam("token"),
        worker_losses=JOBS.c.worker_losses + case((JOBS.c.status == "running", 1), else_=0),
        heartbeat_at=func.now(),
        started_at=func.coalesce(JOBS.c.started_at, func.now()),
        last_error=None,
        pause_reason=None,  # a paused job's (budget, kill_switch): shown beside "running" with no note
        options=_CLAIMED_OPTIONS,
    )
    .returning(*JOBS.c)
)


@dataclass(frozen=True)
class NotDue:
    """A claim's answer for a queued job still waiting out a retry's backoff: due in ``seconds``."""

    seconds: float


def claim(
    factory: sessionmaker[Session],
    job_id: int,
    token: str,
    stale_after: float,
    budgets: JobBudgets,
    *,
    due_only: bool = True,
) -> Job | NotDue | None:
    """Take the job if it is queued (or paused, or running with a stale heartbeat); None otherwise.

    A redelivered message for a job another worker holds, or one that already finished, gets None. One
    for a job still waiting out a retry's backoff gets NotDue (``due_only``, a worker's message: a
    second message, the sweeper's or a stopping worker's, ran it at once, the backoff skipped), read in
    the claim's own transaction, so the two answers agree on the time.
    Taking over a stale lease counts a worker loss (its worker died without a word). A job with a
    spent budget is failed here instead of run, and returned with status "failed". The claim itself
    costs no attempt: ``finish`` counts one when the run reaches a verdict of its own.
    """
    params = {
        "job_id": job_id,
        "token": token,
        "stale_after": timedelta(seconds=stale_after),
        "due_only": due_only,
    }
    with factory.begin() as session:
        claimed = session.execute(_CLAIM, params).one_or_none()
        if claimed is None:
            left = session.scalar(_NOT_DUE_IN, {"job_id": job_id}) if due_only else None
            return None if left is None else NotDue(float(left))
        spent = fail_if_spent(session, job_id, claimed.attempts, claimed.worker_losses, budgets)
        if spent is not None:
            return spent
        if claimed.rerun_requested:
            # This run reads the content as it is now, newer than the delivery that asked for a rerun
            # (committed before it asked): the rerun is this run. Left set, it survived runs ending in a
            # retry or a pause, and a later finish restarted the job with fresh budgets for content it
            # had already failed on (a page with steady deliveries never failed for good).
            # (fail_if_spent, above, may already have restarted it with fresh budgets and cleared it.)
            claimed = session.execute(
                update(JOBS).where(JOBS.c.id == job_id).values(rerun_requested=False).returning(*JOBS.c)
            ).one()
    # A detached Job with the claimed row's values (what the ORM's own UPDATE ... RETURNING gave, at a
    # fraction of its cost: see ``finish``).
    return Job(**claimed._mapping)


def fail_if_spent(
    session: Session, job_id: int, attempts: int, worker_losses: int, budgets: JobBudgets
) -> Job | None:
    """Fail the job (in the caller's transaction, its row locked) when either budget is spent at these
    counters; None when it may run. The claim and the sweeper both ask, so no path passes a cap."""
    reason = budgets.spent_reason(attempts, worker_losses)
    if reason is None:
        return None
    # New content arrived while the job ran (a rerun was requested): it is for that content, which
    # starts with fresh budgets, as ``finish`` starts a rerun (failed here, the rerun was lost: the new
    # content stayed unextracted though its delivery was answered with this job). Not when workers
    # were lost: a page that kills the workers it runs on would crash-loop for as long as deliveries
    # come (an operator's retry runs the new content then).
    if worker_losses >= budgets.max_worker_losses:
        restarted = None
    else:
        restarted = session.execute(
            update(JOBS)
            .where(JOBS.c.id == job_id, JOBS.c.rerun_requested)
            .values(
                rerun_requested=False,
                attempts=0,
                worker_losses=0,
                provider_outage_since=None,
                budget_since=func.now(),
            )
            .returning(JOBS.c.id)
        ).scalar_one_or_none()
    if restarted is not None:
        logger.info("job %s spent its budgets on the content it had; it runs again for the new", job_id)
        return None
    logger.warning("job %s failed: %s", job_id, reason)
    return session.execute(
        update(Job)
        .where(Job.id == job_id)
        .values(
            status="failed",
            worker_losses=worker_losses,
            worker=None,
            heartbeat_at=None,
            pause_reason=None,
            provider_outage_since=None,
            finished_at=func.now(),
            last_error=reason,
        )
        .returning(Job)
    ).scalar_one()


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

    def __init__(
        self,
        factory: sessionmaker[Session],
        job_id: int,
        token: str,
        interval: float,
        stall_after: float | None = None,
        stale_after: float | None = None,
        listen: bool = True,  # for a revocation (worker.jobs.revocations) besides the beats
        claimed_at: float | None = None,  # time.monotonic() before the claim, its beat
    ) -> None:
        self.factory, self.job_id, self.token, self.interval = factory, job_id, token, interval
        self.stall_after, self.stale_after = stall_after, stale_after
        # The claim beat first: its lease counts from it. Counted from here instead, a wait between the
        # two (a pooled connection for the switch's read, up to 30 s) let the run go on past the time
        # the sweeper or another worker may take the job over, and both ran it.
        began = time.monotonic()
        self._progress = began
        self._beaten = began if claimed_at is None else min(claimed_at, began)
        self._stop = threading.Event()
        self._lost = threading.Event()
        self._revoked = threading.Event()  # set by worker.jobs.revocations the moment a transaction says so
        # The job's log fields (job_id, job_kind, task_id), bound on the thread that runs it: a new thread
        # starts with none, and the lines saying why a job stalled or its beat failed carried no ids.
        # Not the whole context (copy_context): that would put every beat's SQL into the job's trace.
        fields = bound_fields()
        self._thread = threading.Thread(
            target=self._beating, args=(fields,), name=f"heartbeat-{job_id}", daemon=True
        )
        bind = factory.kw.get("bind")
        self._engine = bind if isinstance(bind, Engine) and listen else None
        self._unwatch: Callable[[], None] = lambda: None

    def _stalled(self) -> bool:
        """The run has shown no progress (a check, or a wait's mark) for ``stall_after`` seconds.
        Celery's threads pool enforces no time limit, so a job blocked for good (a connection a
        failover left hanging, a row lock held by a session idle in a transaction) kept a fresh
        lease, and its subject's pending slot, until the process restarted. Its lease now lapses:
        the sweeper hands the job to another worker, and the stalled run stops at its next check if
        it ever wakes."""
        if self.stall_after is None or time.monotonic() - self._progress <= self.stall_after:
            return False
        logger.error(
            "job %s showed no progress for %.0f s (FACTMILL_TASK_TIME_LIMIT_SECONDS); its lease is left to "
            "lapse, and the sweeper gives it to another worker",
            self.job_id,
            self.stall_after,
        )
        self._lost.set()
        return True

    def _beating(self, fields: dict[str, str | int]) -> None:
        with log_context(**fields):
            self._run()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            if self._stalled():
                return
            try:
                began = time.monotonic()  # heartbeat_at is the database's now() at the beat's start
                if not heartbeat(self.factory, self.job_id, self.token):
                    self._lost.set()
                    return
                self._beaten = began
            except Exception as exc:  # a database blip must not kill the job; the next beat retries
                logger.warning("heartbeat for job %s failed: %s", self.job_id, error_summary(exc))

    def touch(self) -> None:
        """The run shows progress (a check, or a wait that is no stall: worker.core.progress.mark)."""
        self._progress = time.monotonic()

    def check(self) -> None:
        self.touch()
        if self._revoked.is_set():
            raise LeaseLostError(f"job {self.job_id}'s lease was revoked (its subject was erased)")
        if self._lost.is_set():
            raise LeaseLostError(f"job {self.job_id} was taken over by another worker")
        if self.stale_after is not None:
            # No beat got through (pool timeouts, a hung connection): the sweeper may hand the job to
            # another worker at stale_after, so stop half a beat before. A failed beat was only logged,
            # and this run went on making LLM calls beside the new holder's. (A full beat before was
            # one beat at the smallest stale_after allowed, two beats: a healthy run tripped between.)
            silent = time.monotonic() - self._beaten
            if silent > self.stale_after - self.interval / 2:
                raise LeaseLostError(
                    f"job {self.job_id}: no heartbeat got through for {silent:.0f} s; another worker may "
                    "hold it now"
                )

    def __enter__(self) -> Heartbeat:
        progress.listen(self.touch)  # entered on the job's own thread
        self._thread.start()  # first: the watch may wait for its listener, the beats may not
        if self._engine is not None:
            try:
                self._unwatch = revocations.watch(self._engine, self.job_id, self._revoked)
            except BaseException:  # (no thread to spare): no __exit__ comes, so the beats stop here
                self.__exit__()
                raise
        return self

    def __exit__(self, *exc: object) -> None:
        progress.listen(None)
        self._unwatch()
        self._stop.set()
        self._thread.join(timeout=self.interval + 5)


# One statement for every way a run ends, built once: what differs between them is parameters.
_FINISH = (
    update(JOBS)
    .where(JOBS.c.id == bindparam("job_id"), JOBS.c.worker == bindparam("token"))
    .values(
        status=bindparam("new_status"),
        heartbeat_at=None,
        worker=None,
        pause_reason=bindparam("new_pause_reason"),
        last_error=bindparam("new_last_error"),
        counters=func.coalesce(bindparam("new_counters", type_=JSONB(none_as_null=True)), JOBS.c.counters),
        attempts=case(
            (bindparam("budgets_renewed", type_=Boolean), 0),
            else_=JOBS.c.attempts + bindparam("attempt_spent"),
        ),
        worker_losses=case(
            (bindparam("budgets_renewed", type_=Boolean), 0),
            else_=JOBS.c.worker_losses + bindparam("loss_spent"),
        ),
        finished_at=case((bindparam("finished", type_=Boolean), func.now()), else_=JOBS.c.finished_at),
        # The outage clock (worker.jobs.outages): kept (started if need be) by a run the provider could
        # not serve, left by one that reached no verdict, emptied by any other end (served, paused).
        provider_outage_since=case(
            (
                bindparam("outage", type_=Text) == "keep",
                func.coalesce(JOBS.c.provider_outage_since, func.now()),
            ),
            (bindparam("outage", type_=Text) == "restart", func.now()),
            (bindparam("outage", type_=Text) == "leave", JOBS.c.provider_outage_since),
            else_=None,
        ),
        # The database's clock, as the sweeper compares it with its own now(): a worker's clock behind
        # by more than the backoff made the retry look overdue at once (sent again, its backoff skipped).
        # Without a requeue time, a time still ahead (an operator's run took the job during its
        # backoff) comes back to now: kept, a retry or a rerun of the job waited out the old backoff.
        enqueued_at=func.coalesce(
            func.now() + func.make_interval(0, 0, 0, 0, 0, 0, bindparam("requeue_in", type_=Float)),
            func.least(JOBS.c.enqueued_at, func.now()),
        ),
    )
    .returning(JOBS.c.rerun_requested, JOBS.c.kind)
)


@dataclass(frozen=True)
class Finished:
    """A run's end, written: ``rerun`` is (job id, kind) when the job must be sent again."""

    rerun: tuple[int, str] | None = None


def finish(
    factory: sessionmaker[Session],
    job_id: int,
    token: str,
    status: str,
    *,
    counters: dict[str, Any] | None = None,
    last_error: str | None = None,
    requeue_in: float | None = None,
    pause_reason: str | None = None,
    attempt: bool = False,
    worker_lost: bool = False,
    budgets_renewed: bool = False,
    one_run_options: tuple[str, ...] = (),
    outage: ClockChange | None = None,
) -> Finished | None:
    """Record the end of a run (succeeded, failed, paused, or queued again for a retry).

    ``attempt``: the run reached a verdict of its own (it counts against max_attempts);
    ``worker_lost``: infrastructure cut it short (it counts against max_worker_losses); a pause is
    neither, and neither is an outage (``outage``: the provider could not serve the run; how its clock
    moves). ``budgets_renewed``: a run that paused after making progress starts both counters over
    (a job that lives through many runs, as a backfill's does, spent its five attempts over days).

    ``requeue_in``: seconds from the database's now() before the sweeper may send it again.

    ``Finished.rerun`` names the job when it must be sent again: a rerun was requested while it ran
    (new content arrived) and it succeeded or failed; the rerun reads the new content, so it starts with
    fresh budgets (a failure of the old content does not stand for the new), and without
    ``one_run_options`` (what an operator asked of one run: a forced run, `jobs retry --skipped`; kept,
    every rerun for new content paid for them again). Returns None, writing nothing, if the lease is no
    longer ours.
    """
    params = {
        "job_id": job_id,
        "token": token,
        "new_status": status,
        "new_pause_reason": pause_reason if status == "paused" else None,
        "new_last_error": last_error,
        "new_counters": counters,
        "attempt_spent": 1 if attempt else 0,
        "loss_spent": 1 if worker_lost else 0,
        "finished": status in FINISHED,
        "budgets_renewed": budgets_renewed,
        "requeue_in": requeue_in,
        "outage": outage,
    }
    with factory.begin() as session:
        job = session.execute(_FINISH, params).one_or_none()
        if job is None:
            return None
        rerun: tuple[int, str] | None = None
        # Not after a run that spent the last worker loss: a page that kills its workers would crash-loop
        # for as long as deliveries came (an operator's retry runs the new content then).
        crash_loop = status == "failed" and worker_lost
        if status == "paused" and job.rerun_requested:
            # New content came while it ran, and it paused (for budget, say): the next claim reads the
            # new content, for which its own budget starts over (else a job paused for its budget
            # with new content waiting was never woken).
            session.execute(update(JOBS).where(JOBS.c.id == job_id).values(budget_since=func.now()))
        if status in ("succeeded", "failed") and job.rerun_requested and not crash_loop:
            session.execute(
                update(JOBS)
                .where(JOBS.c.id == job_id)
                .values(
                    status="queued",
                    rerun_requested=False,
                    finished_at=None,
                    attempts=0,
                    worker_losses=0,
                    provider_outage_since=None,
                    budget_since=func.now(),
                    options=_rerun_options(one_run_options),
                )
            )
            rerun = (job_id, job.kind)
    return Finished(rerun)
