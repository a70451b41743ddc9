"""The outbox and leases directly against Postgres: dedupe, reruns, broker outages, claims, the sweeper."""

from __future__ import annotations

import json
import random
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import event, select, text, update
from sqlalchemy.dialects import postgresql
from sqlalchemy.orm import Session

from models import Job
from tests.clock import now
from worker.jobs import outbox, sending
from worker.jobs.budgets import JobBudgets
from worker.jobs.leases import Finished, NotDue, claim, finish, heartbeat
from worker.jobs.outbox import EXTRACTION, page_subject, request_job, request_jobs, retry_job, sweep
from worker.jobs.queries import job_list_query, list_jobs
from worker.jobs.registry import Backoff
from worker.jobs.sending import enqueue

pytestmark = pytest.mark.integration

BUDGETS = JobBudgets(max_attempts=5, max_worker_losses=20)


def swept(factory: Any, queue_depth: Any = None) -> tuple[Any, list[int]]:
    """One sweep at requeue_after 30 s and stale_after 60 s: its report, and the job ids it sent."""
    recorder = Recorder()
    report = sweep(
        factory,
        stale_after=60,
        requeue_after=30,
        enabled=lambda key: True,
        job_budgets=BUDGETS,
        sender=recorder,
        queue_depth=queue_depth,
    )
    return report, [job_id for _, job_id, _ in recorder.sent]


def sent_in_order(factory: Any, sends: list[tuple[int, str]]) -> None:
    """Send these jobs, dated 100 s ago and one second apart in the order given (all overdue)."""
    enqueue(factory, sends, Recorder())
    with factory.begin() as session:
        for rank, (job_id, _) in enumerate(sends):
            session.execute(
                update(Job).where(Job.id == job_id).values(enqueued_at=now() - timedelta(seconds=100 - rank))
            )


class Recorder:
    def __init__(self, fail: bool = False) -> None:
        self.sent: list[tuple[str, int, str]] = []
        self.fail = fail
        self.tries = 0

    def __call__(self, task: str, job_id: int, queue: str) -> None:
        self.tries += 1
        if self.fail:
            raise ConnectionError("broker down")
        self.sent.append((task, job_id, queue))


def new_job(factory, subject: str = "default|p") -> int:
    with factory.begin() as session:
        return request_job(session, EXTRACTION, subject).job_id


def job(factory, job_id: int) -> Job:
    with factory() as session:
        return session.get(Job, job_id)


def test_one_pending_job_per_subject_and_a_rerun_when_it_is_running(tx_factory):
    first = new_job(tx_factory)
    with tx_factory.begin() as session:
        again = request_job(session, EXTRACTION, "default|p")
    assert (again.job_id, again.created) == (first, False)
    assert claim(tx_factory, first, "w1", stale_after=60, budgets=BUDGETS) is not None
    with tx_factory.begin() as session:
        during = request_job(session, EXTRACTION, "default|p")
    assert during.job_id == first and job(tx_factory, first).rerun_requested
    rerun = finish(tx_factory, first, "w1", "succeeded", counters={"facts_inserted": 1}, attempt=True)
    assert rerun == Finished((first, EXTRACTION))
    assert job(tx_factory, first).status == "queued" and not job(tx_factory, first).rerun_requested
    assert job(tx_factory, first).attempts == 0, "a rerun reads new content: its budgets start over"
    # A finished job no longer blocks a new one for the same page.
    claim(tx_factory, first, "w2", stale_after=60, budgets=BUDGETS)
    finish(tx_factory, first, "w2", "succeeded")
    assert new_job(tx_factory) != first


def test_a_send_does_not_mark_a_job_whose_retry_is_ahead_as_freshly_sent(tx_factory):
    """A long send loop marks what it sent in slices: a job that ran and ended in a retry meanwhile (its
    enqueued_at put at its backoff's end) was marked sent now, and looked like a fresh message to the
    sweeper's count of missing ones."""
    job_id = new_job(tx_factory)
    claim(tx_factory, job_id, "w1", stale_after=60, budgets=BUDGETS)
    finish(tx_factory, job_id, "w1", "queued", last_error="retry", requeue_in=120, attempt=True)
    due = job(tx_factory, job_id).enqueued_at
    sent: list[int] = []
    assert (
        enqueue(tx_factory, [(job_id, EXTRACTION)], sender=lambda task, sent_id, queue: sent.append(sent_id))
        == 1
    )
    assert sent == [job_id] and job(tx_factory, job_id).enqueued_at == due


def test_finish_writes_what_each_ending_says_and_keeps_the_rest(tx_factory):
    """One statement records every ending: what a call leaves out (counters, a requeue time) stays
    as it was, a pause counts neither budget, a verdict counts an attempt, a lost worker a loss."""
    job_id = new_job(tx_factory)
    claim(tx_factory, job_id, "w1", stale_after=60, budgets=BUDGETS)
    finish(
        tx_factory, job_id, "w1", "paused", counters={"pages": 1}, pause_reason="budget", last_error="wait"
    )
    paused = job(tx_factory, job_id)
    assert (paused.status, paused.pause_reason, paused.last_error) == ("paused", "budget", "wait")
    assert (paused.attempts, paused.worker_losses, paused.finished_at, paused.worker) == (0, 0, None, None)
    assert paused.counters == {"pages": 1}

    claim(tx_factory, job_id, "w2", stale_after=60, budgets=BUDGETS)
    before = now()
    finish(tx_factory, job_id, "w2", "queued", last_error="lost", requeue_in=300, worker_lost=True)
    requeued = job(tx_factory, job_id)
    assert (requeued.status, requeued.pause_reason, requeued.attempts, requeued.worker_losses) == (
        "queued",
        None,
        0,
        1,
    )
    assert requeued.counters == {"pages": 1}, "no counters given: the last ones stay"
    later = requeued.enqueued_at
    assert later is not None and later - before > timedelta(seconds=299) and requeued.finished_at is None

    # A worker's message before the requeue time does not run it (a second message skipped the wait);
    # an operator's run does.
    early = claim(tx_factory, job_id, "w3", stale_after=60, budgets=BUDGETS)
    assert isinstance(early, NotDue) and 290 < early.seconds <= 300
    claim(tx_factory, job_id, "w3", stale_after=60, budgets=BUDGETS, due_only=False)
    assert finish(tx_factory, job_id, "w-other", "failed") is None, "not our lease: nothing written"
    finish(tx_factory, job_id, "w3", "failed", counters={"pages": 2}, last_error="bad", attempt=True)
    failed = job(tx_factory, job_id)
    assert (failed.status, failed.attempts, failed.worker_losses, failed.last_error) == (
        "failed",
        1,
        1,
        "bad",
    )
    assert failed.counters == {"pages": 2} and failed.finished_at is not None
    # The backoff's end, ahead when the operator's run took the job, does not outlive that run: kept, an
    # operator's retry of the job waited it out.
    assert failed.enqueued_at is not None and failed.enqueued_at < later - timedelta(seconds=200)
    with tx_factory.begin() as session:
        retry_job(session, job_id)
    assert isinstance(claim(tx_factory, job_id, "w4", stale_after=60, budgets=BUDGETS), Job)


def test_an_operators_retry_of_a_job_cancelled_during_its_backoff_is_due_at_once(tx_factory):
    job_id = new_job(tx_factory)
    claim(tx_factory, job_id, "w1", stale_after=60, budgets=BUDGETS)
    finish(tx_factory, job_id, "w1", "queued", last_error="retry", requeue_in=250, attempt=True)
    with tx_factory.begin() as session:  # its page erased while it waited out the backoff
        outbox.cancel_jobs(session, EXTRACTION, "default|p", "page erased")
        retry_job(session, job_id)
    assert isinstance(claim(tx_factory, job_id, "w2", stale_after=60, budgets=BUDGETS), Job)
    # One never sent stays so: should the retry's send fail, the sweeper sends it in seconds, not minutes.
    never_sent = new_job(tx_factory, "default|q")
    with tx_factory.begin() as session:
        outbox.cancel_jobs(session, EXTRACTION, "default|q", "page erased")
        retry_job(session, never_sent)
    assert job(tx_factory, never_sent).enqueued_at is None


def test_a_stale_lease_requeued_by_the_sweeper_is_due_at_once(factory):
    """An operator's run took the job during a retry's backoff and died: requeued with that backoff's end
    still ahead, the sweeper's message was held until it came."""
    job_id = new_job(factory)
    claim(factory, job_id, "w1", stale_after=60, budgets=BUDGETS)
    finish(factory, job_id, "w1", "queued", last_error="retry", requeue_in=250, attempt=True)
    claim(factory, job_id, "operator", stale_after=60, budgets=BUDGETS, due_only=False)
    with factory.begin() as session:  # the operator's process died: its heartbeat went stale
        session.execute(
            update(Job).where(Job.id == job_id).values(heartbeat_at=text("now() - interval '5 minutes'"))
        )
    _, sent = swept(factory)
    assert sent == [job_id]
    assert isinstance(claim(factory, job_id, "w2", stale_after=60, budgets=BUDGETS), Job)


def test_a_long_send_marks_the_jobs_it_sent_as_it_goes(factory, monkeypatch):
    """The sweeper sends again a job left unmarked for 2 s: a send loop that marked its jobs only at
    its end (a sweep of thousands, a slow broker) had its first jobs sent twice."""
    monkeypatch.setattr(sending, "MARK_EVERY_SECONDS", 0.0)  # a slice per send
    ids = [new_job(factory, f"default|p{i}") for i in range(4)]
    seen_marked: list[bool] = []

    def slow_broker(task: str, job_id: int, queue: str) -> None:
        if job_id != ids[0]:  # a separate connection: what the sweeper would read meanwhile
            seen_marked.append(job(factory, ids[ids.index(job_id) - 1]).enqueued_at is not None)

    assert enqueue(factory, [(i, EXTRACTION) for i in ids], slow_broker) == 4
    assert seen_marked == [True, True, True]
    assert all(job(factory, i).enqueued_at is not None for i in ids)


def test_a_database_that_fails_after_the_commit_does_not_fail_the_send(database_url, caplog, monkeypatch):
    """The jobs committed before the send: a route answered 503 ("try again") for a delivery it had
    stored when the mark failed, and an unkeyed retry stored it twice. The sweeper sends them again.
    The database is asked once: each slice's mark could wait out a connect timeout."""
    from sqlalchemy import create_engine
    from sqlalchemy.engine import make_url
    from sqlalchemy.orm import sessionmaker

    monkeypatch.setattr(sending, "MARK_EVERY_SECONDS", 0.0)  # a slice per send
    gone = make_url(database_url).set(host="127.0.0.1", port=1)  # nothing listens there
    engine = create_engine(gone, connect_args={"connect_timeout": 2})
    attempts: list[int] = []
    event.listen(engine, "do_connect", lambda *_: attempts.append(1))
    broker = Recorder()
    assert enqueue(sessionmaker(engine), [(i, EXTRACTION) for i in (1, 2, 3, 4)], broker) == 4
    assert [job_id for _, job_id, _ in broker.sent] == [1, 2, 3, 4]
    assert "could not mark the jobs just sent" in caplog.text
    assert len(attempts) == 1


def test_a_broker_outage_loses_nothing_and_tries_only_once(tx_factory):
    ids = [new_job(tx_factory, f"default|p{i}") for i in range(5)]
    down = Recorder(fail=True)
    assert enqueue(tx_factory, [(i, EXTRACTION) for i in ids], down) == 0
    assert down.tries == 1, "after the first refusal the rest wait for the sweeper"
    assert all(job(tx_factory, i).status == "queued" and job(tx_factory, i).enqueued_at is None for i in ids)
    with tx_factory.begin() as session:  # old enough for the sweeper to call the message lost
        session.execute(update(Job).values(created_at=now() - timedelta(seconds=10)))
    up = Recorder()
    report = sweep(
        tx_factory,
        stale_after=60,
        requeue_after=300,
        enabled=lambda key: True,
        job_budgets=BUDGETS,
        sender=up,
    )
    assert sorted(report.resent_queued) == sorted(ids)
    assert sorted(job_id for _, job_id, _ in up.sent) == sorted(ids)
    assert {queue for _, _, queue in up.sent} == {"extraction"}
    assert all(job(tx_factory, i).enqueued_at is not None for i in ids)
    # Sent just now: the next sweep leaves them alone.
    assert (
        sweep(
            tx_factory,
            stale_after=60,
            requeue_after=300,
            enabled=lambda key: True,
            job_budgets=BUDGETS,
            sender=up,
        ).total
        == 0
    )


def test_claims_are_exclusive_until_the_heartbeat_goes_stale(tx_factory):
    job_id = new_job(tx_factory)
    assert claim(tx_factory, job_id, "w1", stale_after=60, budgets=BUDGETS) is not None
    assert claim(tx_factory, job_id, "w2", stale_after=60, budgets=BUDGETS) is None, (
        "a live lease is never shared"
    )
    assert heartbeat(tx_factory, job_id, "w1") and not heartbeat(tx_factory, job_id, "w2")
    with tx_factory.begin() as session:
        session.execute(
            update(Job).where(Job.id == job_id).values(heartbeat_at=now() - timedelta(seconds=120))
        )
    taken = claim(tx_factory, job_id, "w2", stale_after=60, budgets=BUDGETS)
    # The takeover counts the dead holder as a worker loss; no run reached a verdict, so no attempt.
    assert taken is not None and (taken.attempts, taken.worker_losses, taken.worker) == (0, 1, "w2")
    assert not heartbeat(tx_factory, job_id, "w1"), "the old holder learns it lost the lease"
    assert finish(tx_factory, job_id, "w1", "failed") is None and job(tx_factory, job_id).status == "running"


def test_a_claimed_paused_job_shows_no_pause_reason(tx_factory):
    """A paused job's reason (budget, kill_switch) stayed beside "running" once a message claimed it."""
    job_id = new_job(tx_factory)
    claim(tx_factory, job_id, "w1", stale_after=60, budgets=BUDGETS)
    finish(tx_factory, job_id, "w1", "paused", last_error="the day's budget is spent", pause_reason="budget")
    assert job(tx_factory, job_id).pause_reason == "budget"
    taken = claim(tx_factory, job_id, "w2", stale_after=60, budgets=BUDGETS)
    assert taken is not None and (taken.status, taken.pause_reason) == ("running", None)


def test_the_sweeper_requeues_dead_workers_jobs_and_resumes_switched_on_pauses(tx_factory):
    dead = new_job(tx_factory, "default|dead")
    claim(tx_factory, dead, "w1", stale_after=60, budgets=BUDGETS)
    with tx_factory.begin() as session:
        session.execute(update(Job).where(Job.id == dead).values(heartbeat_at=now() - timedelta(seconds=300)))
    paused = new_job(tx_factory, "default|paused")
    claim(tx_factory, paused, "w1", stale_after=60, budgets=BUDGETS)
    finish(tx_factory, paused, "w1", "paused", pause_reason="kill_switch")
    off = sweep(
        tx_factory,
        stale_after=60,
        requeue_after=300,
        enabled=lambda key: False,
        job_budgets=BUDGETS,
        sender=Recorder(),
    )
    assert off.requeued_stale == [dead] and off.resumed_paused == []
    assert job(tx_factory, dead).status == "queued" and "stale heartbeat" in job(tx_factory, dead).last_error
    assert (job(tx_factory, dead).attempts, job(tx_factory, dead).worker_losses) == (0, 1)
    assert job(tx_factory, paused).attempts == 0, "a pause costs no attempt"
    on = sweep(
        tx_factory,
        stale_after=60,
        requeue_after=300,
        enabled=lambda key: True,
        job_budgets=BUDGETS,
        sender=Recorder(),
    )
    assert on.resumed_paused == [paused] and job(tx_factory, paused).status == "queued"


def test_retry_job_requeues_finished_work_only(tx_factory):
    job_id = new_job(tx_factory)
    with tx_factory.begin() as session:
        assert retry_job(session, job_id).status == "queued"  # queued stays queued
    claim(tx_factory, job_id, "w1", stale_after=60, budgets=BUDGETS)
    finish(tx_factory, job_id, "w1", "failed", last_error="boom")
    with tx_factory.begin() as session:
        retried = retry_job(session, job_id)
        assert (retried.status, retried.attempts, retried.last_error) == ("queued", 0, None)
    with pytest.raises(LookupError), tx_factory.begin() as session:
        retry_job(session, 10_000)


def test_retry_policy_backs_off_exponentially_with_jitter_and_a_cap():
    policy = Backoff(base_seconds=5, max_seconds=60)
    rng = random.Random(7)
    delays = [policy.delay(attempt, rng) for attempt in range(1, 8)]
    for attempt, delay in enumerate(delays, start=1):
        ceiling = min(60, 5 * 2 ** (attempt - 1))
        assert ceiling / 2 <= delay <= ceiling
    assert max(delays) <= 60


def test_jobs_table_refuses_unknown_statuses(tx_factory):
    from sqlalchemy.exc import IntegrityError

    job_id = new_job(tx_factory)
    with pytest.raises(IntegrityError), tx_factory.begin() as session:
        session.execute(update(Job).where(Job.id == job_id).values(status="exploded"))
    with tx_factory() as session:
        assert session.scalar(select(Job.status).where(Job.id == job_id)) == "queued"


# Truncation: run_job extraction runs segment_concurrency=8 (threads share the factory).
@pytest.mark.parametrize("by_operator", [False, True])
def test_a_failing_page_is_retried_with_backoff_then_failed(factory, database_url, simulator, by_operator):
    """retry_or_fail: requeued with enqueued_at in the future while attempts remain, then failed. The
    page's own failure (a request the provider rejects): an outage spends worker losses instead
    (test_job_budgets). A worker's retry message is the task's to send (countdown); an operator's run
    (`factmill facts consolidate`) has no task: its retry was left to the sweeper, minutes late."""
    from tests.integration.test_extraction import put_page
    from worker.config_store import ConfigReader
    from worker.jobs.celery_app import app
    from worker.jobs.lifecycle import OperatorRun, run_job
    from worker.jobs.outbox import page_subject
    from worker.jobs.sending import broker_queue_depth
    from worker.runtime import Runtime
    from worker.settings import Settings

    settings = Settings(
        database_url=database_url,
        simulator_url=simulator.base_url,
        llm="simulator",
        llm_max_attempts=1,
        job_max_attempts=2,
    )
    rt = Runtime(settings=settings, factory=factory, config=ConfigReader(factory, ttl=0))
    put_page(factory)
    job_id = new_job(factory, page_subject("default", "conversations/imessage/alice-example"))
    simulator.configure(raw_replies={"chat.completions": {"error": {"message": "rejected"}}}, raw_status=400)
    try:
        depth = broker_queue_depth("extraction")
        operator = OperatorRun() if by_operator else None
        first = run_job(rt, job_id, EXTRACTION, Backoff(base_seconds=30, max_seconds=60), operator=operator)
        assert broker_queue_depth("extraction") == (depth or 0) + by_operator
        with app.connection_for_write() as connection:  # no stray message for a later test's worker
            connection.default_channel.queue_purge("extraction")
        queued = job(factory, job_id)
        assert first.status == "retry" and 15 <= first.retry_in <= 30
        assert queued.status == "queued" and queued.enqueued_at > now() + timedelta(seconds=10)
        assert "provider_error" in queued.last_error and queued.counters["pages_failed"] == 1
        early = run_job(rt, job_id, EXTRACTION)  # a second message, before the backoff ends: held
        assert early.status == "not_due" and 10 < (early.retry_in or 0) <= 30
        assert job(factory, job_id).status == "queued" and job(factory, job_id).attempts == 1
        with factory.begin() as session:  # the backoff over
            session.execute(update(Job).where(Job.id == job_id).values(enqueued_at=text("now()")))
        second = run_job(rt, job_id, EXTRACTION)
        assert second.status == "failed" and job(factory, job_id).status == "failed"
        assert (job(factory, job_id).attempts, job(factory, job_id).worker_losses) == (2, 0)
    finally:
        simulator.configure(raw_replies={}, raw_status=200)  # the simulator is shared by the whole session
        rt.close()


def test_request_job_survives_the_pending_job_finishing_between_insert_and_select(factory):
    """The race of issue 11: the pending job finishes (another connection commits) after the
    ON CONFLICT DO NOTHING found it but before the SELECT looks for it. It used to raise
    NoResultFound (a 500 that rolled the page update back); now a new job is requested."""
    first = new_job(factory)
    claim(factory, first, "w1", stale_after=60, budgets=BUDGETS)
    interleaved: list[str] = []

    def finish_in_between(conn, cursor, statement, parameters, context, executemany):
        if "ON CONFLICT" in statement and not interleaved:
            interleaved.append(statement)
            # A second connection: the worker finishing the job and committing.
            finish(factory, first, "w1", "succeeded")

    with factory.begin() as session:
        connection = session.connection()
        event.listen(connection, "after_cursor_execute", finish_in_between)
        try:
            again = request_job(session, EXTRACTION, "default|p")
        finally:
            event.remove(connection, "after_cursor_execute", finish_in_between)
    assert interleaved, "the interleaving did not happen"
    assert again.created and again.job_id != first
    assert job(factory, first).status == "succeeded"
    assert job(factory, again.job_id).status == "queued"


def test_request_jobs_asks_for_many_subjects_in_one_insert_with_request_jobs_rules(tx_factory):
    """One INSERT for every subject (a page's extraction requests a consolidation job per entity): a
    new subject gets a new job, a pending one is reused, a running one is marked to run again, and a
    subject named twice gets the same job."""
    queued = new_job(tx_factory, "default|queued")
    running = new_job(tx_factory, "default|running")
    claim(tx_factory, running, "w1", stale_after=60, budgets=BUDGETS)
    inserts: list[str] = []

    def count(conn, cursor, statement, parameters, context, executemany):
        if statement.lstrip().upper().startswith("INSERT INTO JOBS"):
            inserts.append(statement)

    subjects = ["default|new", "default|queued", "default|running", "default|new", "default|other"]
    with tx_factory.begin() as session:
        connection = session.connection()
        event.listen(connection, "after_cursor_execute", count)
        try:
            got = request_jobs(session, EXTRACTION, subjects)
            assert request_jobs(session, EXTRACTION, []) == []
        finally:
            event.remove(connection, "after_cursor_execute", count)
    assert len(inserts) == 1
    assert [r.created for r in got] == [True, False, False, True, True]
    assert got[0] == got[3] and got[0].job_id != got[4].job_id
    assert (got[1].job_id, got[2].job_id) == (queued, running)
    assert job(tx_factory, running).rerun_requested and not job(tx_factory, queued).rerun_requested
    assert {job(tx_factory, r.job_id).subject for r in got} == set(subjects)


def test_the_sweeper_resends_only_as_many_as_the_broker_queue_is_missing(tx_factory):
    """A backlog longer than requeue_after is not a loss: re-sending all of it on every sweep made the
    queue grow by the whole backlog each time (bench/chaos.py: 52,000 messages for 400 jobs)."""
    sent = [new_job(tx_factory, f"default|b{i}") for i in range(4)]
    enqueue(tx_factory, [(i, EXTRACTION) for i in sent], Recorder())
    never = new_job(tx_factory, "default|never-sent")  # its message never reached the broker

    def age_all() -> None:  # every job overdue, the first sent the oldest, the never-sent one newest
        with tx_factory.begin() as session:
            session.execute(update(Job).values(created_at=now() - timedelta(seconds=200)))
            session.execute(
                update(Job)
                .where(Job.id == never, Job.enqueued_at.is_not(None))
                .values(enqueued_at=now() - timedelta(seconds=50))
            )
            for rank, job_id in enumerate(sent):
                session.execute(
                    update(Job)
                    .where(Job.id == job_id)
                    .values(enqueued_at=now() - timedelta(seconds=100 - rank))
                )

    def resent(depth: int | None) -> list[int]:
        age_all()
        recorder = Recorder()
        sweep(
            tx_factory,
            stale_after=60,
            requeue_after=30,
            enabled=lambda key: True,
            job_budgets=BUDGETS,
            sender=recorder,
            queue_depth=lambda queue: depth,
        )
        return [job_id for _, job_id, _ in recorder.sent]

    # The queue still holds the four sent messages: only the job never sent goes.
    assert resent(4) == [never]
    # Now five were sent and four wait: one is missing, and the oldest goes.
    assert resent(4) == [sent[0]]
    assert resent(2) == sent[:3]
    # An empty queue (a flush), or a broker that cannot say: every overdue job goes again.
    assert sorted(resent(0)) == sorted([*sent, never])
    assert sorted(resent(None)) == sorted([*sent, never])


def test_the_missing_messages_are_counted_over_every_overdue_job_not_the_sweeps_batch(
    tx_factory, monkeypatch
):
    """Measured against the sweep's batch (its 5,000 oldest), a backlog longer than one hid its losses:
    a queue of 99,000 for 100,000 overdue jobs counted none missing of the batch."""
    monkeypatch.setattr(outbox, "SWEEP_BATCH", 2)
    sent = [new_job(tx_factory, f"default|c{i}") for i in range(4)]
    sent_in_order(tx_factory, [(i, EXTRACTION) for i in sent])
    _, resent = swept(tx_factory, queue_depth=lambda queue: 2)  # two of the four overdue have no message
    assert resent == [sent[0], sent[1]]  # the batch: its oldest two


def test_a_backlog_on_one_queue_does_not_hide_another_queues_lost_message(tx_factory, monkeypatch):
    """The overdue jobs were one batch over every kind, oldest first: a bulk ingest's extraction backlog
    (every message still on its queue) filled it, and a compaction job whose message was lost (a killed
    worker's, a Redis restart) was not sent again until the backlog had been worked through."""
    monkeypatch.setattr(outbox, "SWEEP_BATCH", 2)
    backlog = [new_job(tx_factory, f"default|b{i}") for i in range(3)]
    with tx_factory.begin() as session:
        compacting = request_job(session, "compaction", "agent-1").job_id
    sent_in_order(tx_factory, [*((i, EXTRACTION) for i in backlog), (compacting, "compaction")])  # it last
    _, resent = swept(tx_factory, queue_depth=lambda queue: 3 if queue == "extraction" else 0)  # all there
    assert resent == [compacting]


def test_a_queue_two_kinds_share_sends_its_oldest_missing_first(tx_factory, monkeypatch):
    """Read a batch a kind, the extraction queue's missing count (over both its kinds) was sliced from
    the cut-off extraction batch and then the backfill's: the younger backfill job was sent again while
    an older extraction job waited for the next sweep."""
    monkeypatch.setattr(outbox, "SWEEP_BATCH", 2)
    older = [new_job(tx_factory, f"default|o{i}") for i in range(3)]
    with tx_factory.begin() as session:
        backfill = request_job(session, "batch_extraction", "backfill-1").job_id
    sent_in_order(tx_factory, [*((i, EXTRACTION) for i in older), (backfill, "batch_extraction")])  # it last
    _, resent = swept(tx_factory, queue_depth=lambda queue: 1)  # three of the queue's four are missing
    assert resent == older[:2]  # the oldest two: the batch


def test_a_pending_job_of_a_kind_this_version_does_not_run_is_left_to_one_that_does(tx_factory):
    """A row of another kind (a newer version's, mid-deploy; an older one's after a downgrade) was asked
    for its queue and failed every sweep: no lost job was sent again, no dead worker's job taken over."""
    lost = new_job(tx_factory, "default|lost")
    with tx_factory.begin() as session:
        stranger = Job(kind="retired_kind", subject="x", status="queued")
        running = Job(
            kind="retired_kind", subject="y", status="running", heartbeat_at=now() - timedelta(hours=1)
        )
        session.add_all([stranger, running])
        session.flush()
        strangers = [stranger.id, running.id]
        session.execute(update(Job).values(created_at=now() - timedelta(seconds=200)))
    report, sent = swept(tx_factory, queue_depth=lambda queue: 0)
    assert sent == [lost] and report.failed_spent == []
    with tx_factory() as session:
        left = (
            session.execute(select(Job.status).where(Job.id.in_(strangers)).order_by(Job.id)).scalars().all()
        )
    assert left == ["queued", "running"]  # as they were


def test_a_lost_message_behind_a_steady_backlog_of_fresh_ones_is_sent_again(tx_factory):
    """The broker's depth counted the messages of jobs sent lately too: while a bulk ingest kept more
    than requeue_after's worth of them queued, a job whose message was lost (a flush) was never sent
    again. Those fresh messages are no overdue job's: they no longer hide the loss."""
    lost = new_job(tx_factory, "default|lost")
    fresh = [new_job(tx_factory, f"default|fresh{i}") for i in range(3)]
    enqueue(tx_factory, [(i, EXTRACTION) for i in (lost, *fresh)], Recorder())
    with tx_factory.begin() as session:
        session.execute(update(Job).values(created_at=now() - timedelta(seconds=200)))
        session.execute(update(Job).where(Job.id == lost).values(enqueued_at=now() - timedelta(seconds=100)))
    # The queue holds the three fresh messages; the lost job's message is gone.
    _, sent = swept(tx_factory, queue_depth=lambda queue: 3)
    assert sent == [lost]
    # A job waiting out a retry's backoff (due later) has its delayed message at a worker, in no depth:
    # counted as fresh, it hid a message still queued, and that job was sent twice.
    with tx_factory.begin() as session:
        session.execute(update(Job).where(Job.id == lost).values(enqueued_at=now() - timedelta(seconds=100)))
        session.execute(
            update(Job).where(Job.id == fresh[0]).values(enqueued_at=now() + timedelta(seconds=60))
        )
    assert swept(tx_factory, queue_depth=lambda queue: 3)[1] == []  # two fresh ones and the lost job's
    with tx_factory.begin() as session:
        session.execute(update(Job).where(Job.id == fresh[0]).values(enqueued_at=now()))
    # Its message still there (four queued): nothing is missing.
    enqueue(tx_factory, [(lost, EXTRACTION)], Recorder())
    with tx_factory.begin() as session:
        session.execute(update(Job).where(Job.id == lost).values(enqueued_at=now() - timedelta(seconds=100)))
    assert swept(tx_factory, queue_depth=lambda queue: 4)[1] == []


def test_the_run_that_reads_new_content_is_the_rerun_it_asked_for(tx_factory):
    """A delivery during a run that then ended in a retry left its rerun flag set: the next runs read
    the new content, and when the last of them finished, the flag restarted the job with fresh budgets
    for content it had already failed on (a page with steady deliveries never failed for good)."""
    subject = page_subject("default", "rerun")
    job_id = new_job(tx_factory, subject)
    assert claim(tx_factory, job_id, "w1", stale_after=60, budgets=BUDGETS) is not None
    with tx_factory.begin() as session:
        assert not request_job(session, EXTRACTION, subject).created  # new content: a rerun is asked
    finish(tx_factory, job_id, "w1", "queued", attempt=True)  # the run ends in a retry
    assert job(tx_factory, job_id).rerun_requested
    claimed = claim(tx_factory, job_id, "w2", stale_after=60, budgets=BUDGETS)
    assert claimed is not None and not claimed.rerun_requested and not job(tx_factory, job_id).rerun_requested
    assert finish(tx_factory, job_id, "w2", "failed", attempt=True) == Finished(
        None
    )  # no restart for the same content
    assert (job(tx_factory, job_id).status, job(tx_factory, job_id).attempts) == ("failed", 2)


def test_a_job_spent_while_new_content_waited_runs_again_for_it(tx_factory):
    """A delivery asked for a rerun while the job was running; its last attempt then failed it at the
    next claim, and the rerun was lost: the new content was never extracted, though the delivery was
    answered with this job. As finish does, the rerun starts with fresh attempts. Not after its last
    worker loss: a page that kills its workers would crash-loop for as long as deliveries came."""
    spent, crashing = new_job(tx_factory, "default|spent"), new_job(tx_factory, "default|crashing")
    for job_id in (spent, crashing):
        assert claim(tx_factory, job_id, "w1", stale_after=60, budgets=BUDGETS) is not None
    with tx_factory.begin() as session:
        request_job(session, EXTRACTION, "default|spent")  # new content: a rerun
        request_job(session, EXTRACTION, "default|crashing")
        session.execute(  # its last attempt failed: queued for a retry it may not have
            update(Job)
            .where(Job.id == spent)
            .values(status="queued", worker=None, attempts=BUDGETS.max_attempts)
        )
        session.execute(
            update(Job)
            .where(Job.id == crashing)
            .values(worker_losses=BUDGETS.max_worker_losses - 1, heartbeat_at=now() - timedelta(hours=1))
        )
    taken = claim(tx_factory, spent, "w2", stale_after=60, budgets=BUDGETS)
    assert taken is not None and taken.status == "running"
    assert (taken.attempts, taken.rerun_requested) == (0, False)
    report, sent = swept(tx_factory)
    assert report.failed_spent == [crashing] and sent == []
    assert job(tx_factory, crashing).status == "failed"


def test_a_run_that_reaches_no_check_lets_its_lease_lapse(factory):
    """The threads pool enforces no time limit and the heartbeat beat on its own thread whatever the
    job's thread did: a run blocked for good kept a fresh lease (and its subject's slot) until the
    process restarted."""
    import time as clock

    from worker.core import progress
    from worker.jobs.leases import Heartbeat, LeaseLostError

    job_id = new_job(factory, "default|stuck")
    assert claim(factory, job_id, "w1", stale_after=60, budgets=BUDGETS) is not None
    with Heartbeat(factory, job_id, "w1", interval=0.05, stall_after=1.0) as beat:
        for _ in range(8):  # a run that checks in keeps its lease, however long it runs
            clock.sleep(0.1)
            beat.check()
        for _ in range(15):  # and one that waits its turn (a page's calls wait for slots) says so
            clock.sleep(0.1)
            progress.mark()
        assert not beat._lost.is_set()
        beaten = job(factory, job_id).heartbeat_at
        clock.sleep(2.0)  # then it blocks
        lapsed = job(factory, job_id).heartbeat_at
        clock.sleep(0.5)
        assert job(factory, job_id).heartbeat_at == lapsed and lapsed is not None and beaten is not None
        assert lapsed > beaten  # it beat on for a while, then stopped
        with pytest.raises(LeaseLostError):
            beat.check()  # woken at last: it stops here


def test_a_run_whose_heartbeats_fail_stops_before_its_lease_can_go_stale(factory, database_url):
    """A failed beat (pool timeouts, a hung connection) was only logged, and check() tripped only on a
    beat that got through and found the lease gone: the sweeper handed the job to another worker at
    stale_after, and this run went on making LLM calls beside it."""
    import time as clock

    from sqlalchemy import create_engine
    from sqlalchemy.orm import sessionmaker

    from worker.jobs.leases import Heartbeat, LeaseLostError

    job_id = new_job(factory, "default|silent")
    assert claim(factory, job_id, "w1", stale_after=60, budgets=BUDGETS) is not None
    nowhere = create_engine("postgresql+psycopg://127.0.0.1:9/none", connect_args={"connect_timeout": 1})
    with Heartbeat(sessionmaker(nowhere), job_id, "w1", interval=0.05, stale_after=0.6) as beat:
        beat.check()  # just claimed: the claim was a beat
        deadline = clock.monotonic() + 10
        with pytest.raises(LeaseLostError, match="no heartbeat got through"):
            while clock.monotonic() < deadline:
                beat.check()
                clock.sleep(0.05)
    nowhere.dispose()


def test_a_lease_counts_from_its_claim_not_from_the_heartbeats_start(factory):
    """The claim is the lease's first beat, but its silence was counted from the Heartbeat's start: a
    wait between the two (the switch's read waiting for a pooled connection) let a run whose beats failed
    go on past the time another worker may take the job."""
    import time as clock

    from sqlalchemy import create_engine
    from sqlalchemy.orm import sessionmaker

    from worker.jobs.leases import Heartbeat, LeaseLostError

    job_id = new_job(factory, "default|late-beat")
    assert claim(factory, job_id, "w1", stale_after=60, budgets=BUDGETS) is not None
    nowhere = create_engine("postgresql+psycopg://127.0.0.1:9/none", connect_args={"connect_timeout": 1})
    away = sessionmaker(nowhere)
    try:
        # Started at the claim, a silence of 2 s is past stale_after less half a beat (1.5 s).
        with Heartbeat(away, job_id, "w1", interval=1, stale_after=2) as beat:
            beat.check()  # just claimed: fine
        claimed_at = clock.monotonic() - 2  # claimed 2 s before the heartbeat started
        with (
            Heartbeat(away, job_id, "w1", interval=1, stale_after=2, claimed_at=claimed_at) as beat,
            pytest.raises(LeaseLostError, match="no heartbeat got through"),
        ):
            beat.check()
    finally:
        nowhere.dispose()


def test_a_message_whose_job_cannot_be_claimed_for_the_database_is_sent_again_later(
    database_url, monkeypatch
):
    """A Postgres restart: the claim's error went out of the task, the message was acked and dropped,
    and every thread took the next; the jobs waited for the sweeper. Now the task retries the message
    in 5-15 s (an operator's run still raises, for the command to say)."""
    from sqlalchemy import create_engine
    from sqlalchemy.exc import OperationalError
    from sqlalchemy.orm import sessionmaker

    from worker.config_store import ConfigReader
    from worker.jobs.lifecycle import OperatorRun, run_job
    from worker.runtime import Runtime
    from worker.settings import Settings

    nowhere = create_engine("postgresql+psycopg://127.0.0.1:9/none", connect_args={"connect_timeout": 1})
    away = sessionmaker(nowhere)
    rt = Runtime(settings=Settings(database_url=database_url), factory=away, config=ConfigReader(away, ttl=0))
    try:
        outcome = run_job(rt, 1, EXTRACTION)
        assert outcome.status == "unclaimed" and outcome.retry_in is not None and 5 <= outcome.retry_in <= 15
        assert "the database is unavailable" in outcome.detail
        with pytest.raises(OperationalError):
            run_job(rt, 1, EXTRACTION, operator=OperatorRun(False))
        # Traced, a message sent untraced has its job's trace read first: that read is no claim.
        from worker.runtime import tracing

        monkeypatch.setattr(tracing, "enabled", lambda: True)
        monkeypatch.setattr(tracing, "current_traceparent", lambda: None)
        assert run_job(rt, 1, EXTRACTION).status == "unclaimed"
    finally:
        nowhere.dispose()


def test_a_claimed_job_whose_switch_cannot_be_read_is_requeued_not_left_running(factory, database_url):
    """The kill switch is read after the claim commits: a database gone then (the switch's cached value
    expired) raised out of the run, the message was acked and the job left running under a lease no one
    beat, until the sweeper counted it a worker loss."""
    from sqlalchemy import create_engine
    from sqlalchemy.orm import sessionmaker

    from worker.config_store import ConfigReader
    from worker.jobs.lifecycle import run_job
    from worker.runtime import Runtime
    from worker.settings import Settings

    job_id = new_job(factory)
    nowhere = create_engine("postgresql+psycopg://127.0.0.1:9/none", connect_args={"connect_timeout": 1})
    away = ConfigReader(sessionmaker(nowhere), ttl=0)  # the switch's read meets the outage
    rt = Runtime(settings=Settings(database_url=database_url), factory=factory, config=away)
    try:
        outcome = run_job(rt, job_id, EXTRACTION)
    finally:
        nowhere.dispose()
    assert outcome.status in ("retry", "requeue"), outcome
    found = job(factory, job_id)
    assert (found.status, found.worker, found.attempts) == ("queued", None, 0)


def test_a_run_whose_end_cannot_be_written_sends_its_message_again_once_its_lease_is_stale(
    factory, database_url, monkeypatch
):
    """The database went away after the claim: the write of the run's end raised out of the task, the
    message was acked and the job waited on the sweeper. Now the message comes back once the lease is
    stale, for the claim to take it over."""
    from sqlalchemy import create_engine

    from worker.config_store import ConfigReader
    from worker.jobs import lifecycle
    from worker.runtime import Runtime
    from worker.settings import Settings

    job_id = new_job(factory)
    nowhere = create_engine("postgresql+psycopg://127.0.0.1:9/none", connect_args={"connect_timeout": 1})

    def settle_away(*args: Any, **kwargs: Any) -> Any:
        with nowhere.connect():  # the real error of a database gone
            raise AssertionError("unreachable")

    monkeypatch.setattr(lifecycle, "settle", settle_away)
    settings = Settings(database_url=database_url, job_stale_after_seconds=30)
    rt = Runtime(settings=settings, factory=factory, config=ConfigReader(factory, ttl=0))
    try:
        outcome = lifecycle.run_job(rt, job_id, EXTRACTION)
    finally:
        nowhere.dispose()
    assert outcome.status == "unclaimed" and outcome.retry_in is not None and 35 <= outcome.retry_in <= 45
    assert "the database is unavailable" in outcome.detail


def test_a_healthy_run_keeps_its_lease_at_the_smallest_stale_after_allowed(factory):
    """stale_after may be two beats; stopping a full beat before it left one beat, and a check between a
    beat's wait and its write (every beat getting through) stopped a healthy run."""
    import time as clock

    from worker.jobs.leases import Heartbeat

    job_id = new_job(factory, "default|healthy")
    assert claim(factory, job_id, "w1", stale_after=60, budgets=BUDGETS) is not None
    # Two beats a second apart: half a beat (0.5 s) of margin for a slow write on a loaded machine
    # (at 0.3 s a beat, 150 ms of fsync or scheduling failed a healthy run).
    with Heartbeat(factory, job_id, "w1", interval=1.0, stale_after=2.0) as beat:
        deadline = clock.monotonic() + 4.5
        while clock.monotonic() < deadline:
            beat.check()
            clock.sleep(0.01)


def test_a_run_that_spent_the_last_worker_loss_is_not_rerun_for_new_content(tx_factory):
    """finish restarted the rerun with fresh counters after any failure: a page whose runs kill the
    database backend (or the worker) crash-looped for as long as deliveries came."""
    crashing, failing = new_job(tx_factory, "default|crash"), new_job(tx_factory, "default|fail")
    for job_id in (crashing, failing):
        assert claim(tx_factory, job_id, "w1", stale_after=60, budgets=BUDGETS) is not None
    with tx_factory.begin() as session:
        request_job(session, EXTRACTION, "default|crash")  # new content for both
        request_job(session, EXTRACTION, "default|fail")
    assert finish(tx_factory, crashing, "w1", "failed", worker_lost=True) == Finished(None)
    assert job(tx_factory, crashing).status == "failed"
    assert finish(tx_factory, failing, "w1", "failed", attempt=True) == Finished((failing, EXTRACTION))
    rerun = job(tx_factory, failing)
    assert (rerun.status, rerun.attempts, rerun.worker_losses) == ("queued", 0, 0)


def test_the_sweep_asks_the_broker_before_it_locks_a_row_and_takes_a_batch_at_a_time(factory, monkeypatch):
    """It asked the broker for each queue's depth while holding every overdue job's row lock: a broker
    that hung held back the claims, deliveries and erasures of those jobs; and it locked the whole
    backlog of a bulk ingest every sweep, however long."""
    import worker.jobs.outbox as outbox

    sent = [new_job(factory, f"default|s{i}") for i in range(3)]
    enqueue(factory, [(i, EXTRACTION) for i in sent], Recorder())
    with factory.begin() as session:
        session.execute(update(Job).values(enqueued_at=now() - timedelta(seconds=100)))

    def depth(queue: str) -> int:
        with factory.begin() as other:  # another worker claiming one of them, meanwhile
            other.execute(text("SET LOCAL lock_timeout = '200ms'"))
            other.execute(select(Job.id).where(Job.id == sent[0]).with_for_update())
        return 0

    monkeypatch.setattr(outbox, "SWEEP_BATCH", 2, raising=False)

    def resent() -> list[int]:
        return swept(factory, depth)[1]

    first = resent()
    assert len(first) == 2
    with factory.begin() as session:  # the two sent again are no longer overdue; the third still is
        session.execute(update(Job).where(Job.id.in_(first)).values(enqueued_at=now()))
    assert resent() == [job_id for job_id in sent if job_id not in first]


def test_a_source_limited_job_list_reads_its_sources_jobs_by_their_index(tx_factory):
    """A key limited to a source with few jobs read every job backwards (0.3 s at a million, bench/
    job_list.py); the statement now matches ix_jobs_page_source, constants and all."""
    ids = {}
    with tx_factory.begin() as session:
        for n in range(30):
            source = "rare" if n < 2 else f"s{n % 3}"
            ids[n] = request_job(session, EXTRACTION, page_subject(source, f"p{n}")).job_id
        compaction = request_job(session, "compaction", "rare|not-a-page").job_id
    with tx_factory() as session:
        rare = list_jobs(session, source_ids={"rare"})
        assert [j.id for j in rare] == [ids[1], ids[0]] and compaction not in [j.id for j in rare]
        both = list_jobs(session, source_ids={"rare", "s1"}, limit=3)
        assert [j.id for j in both] == sorted(
            (ids[n] for n in range(30) if n < 2 or n % 3 == 1), reverse=True
        )[:3]
        assert list_jobs(session, source_ids={"none"}) == []
        session.execute(text("SET LOCAL enable_seqscan = off"))  # a 30-row table: make the index the choice
        statement = job_list_query(None, None, 50, None, {"rare"}).compile(
            dialect=postgresql.dialect(), compile_kwargs={"literal_binds": True}
        )
        plan = "\n".join(session.scalars(text(f"EXPLAIN {statement}")))
        assert "ix_jobs_page_source" in plan, plan


def test_the_max_facts_setting_is_what_an_extraction_job_asks_for(factory, database_url, simulator):
    """FACTMILL_EXTRACTION_MAX_FACTS was documented and read by nothing: every job asked for 10 facts
    a segment whatever it said. The config key still overrides it."""
    import httpx

    from tests.integration.test_extraction import put_page
    from worker.config_store import EXTRACTION_MAX_FACTS, ConfigReader, set_config
    from worker.jobs.lifecycle import run_job
    from worker.jobs.outbox import page_subject
    from worker.runtime import Runtime
    from worker.settings import Settings

    settings = Settings(
        database_url=database_url, simulator_url=simulator.base_url, llm="simulator", extraction_max_facts=3
    )
    rt = Runtime(settings=settings, factory=factory, config=ConfigReader(factory, ttl=0))
    put_page(factory)
    subject = page_subject("default", "conversations/imessage/alice-example")

    def last_prompt() -> str:
        return json.dumps(httpx.get(f"{simulator.url}/_simulator/requests").json()["requests"][-1])

    try:
        assert run_job(rt, new_job(factory, subject), EXTRACTION).status == "succeeded"
        assert "Return at most 3 facts" in last_prompt()
        with factory.begin() as session:
            set_config(session, EXTRACTION_MAX_FACTS, "5", updated_by="test")
        put_page(factory, slug="conversations/imessage/bob-example")
        second = new_job(factory, page_subject("default", "conversations/imessage/bob-example"))
        assert run_job(rt, second, EXTRACTION).status == "succeeded"
        assert "Return at most 5 facts" in last_prompt()
    finally:
        rt.close()


def test_a_provider_missing_its_key_fails_the_job_at_once_saying_what_to_set(factory, database_url):
    """Unsorted, it was retried with backoff until the attempts ran out: five runs, each failing alike."""
    from tests.integration.test_extraction import put_page
    from worker.config_store import ConfigReader
    from worker.jobs.lifecycle import run_job
    from worker.runtime import Runtime
    from worker.settings import Settings

    settings = Settings(database_url=database_url, llm="openai", openai_api_key=None, job_max_attempts=5)
    rt = Runtime(settings=settings, factory=factory, config=ConfigReader(factory, ttl=0))
    put_page(factory)
    job_id = new_job(factory, page_subject("default", "conversations/imessage/alice-example"))
    try:
        assert run_job(rt, job_id, EXTRACTION).status == "failed"
        failed = job(factory, job_id)
        assert failed.attempts == 1 and "FACTMILL_LLM=openai needs OPENAI_API_KEY" in (
            failed.last_error or ""
        )
    finally:
        rt.close()


def test_pending_jobs_are_locked_in_the_order_their_subjects_are_inserted_whatever_the_collation(
    session: Session, collation_unlike_c: str
) -> None:
    """Subjects are inserted in Python's sort (code point by code point) and the pending ones were locked
    in the database's collation, en_US on the official Postgres images, where "Bob" sorts after
    "alice": two requests for overlapping subjects could each wait on the other. Here the column is
    given that collation (in the test's transaction, rolled back)."""
    from worker.jobs.outbox import _PENDING_OF

    session.execute(text(f'ALTER TABLE jobs ALTER COLUMN subject TYPE text COLLATE "{collation_unlike_c}"'))
    subjects = ["default|alice", "default|Bob", "default|ab", "default|a-c", "default|Zed", "default|zed"]
    request_jobs(session, EXTRACTION, subjects)
    locked = [row.subject for row in session.execute(_PENDING_OF, {"kind": EXTRACTION, "subjects": subjects})]
    assert locked == sorted(subjects), locked
