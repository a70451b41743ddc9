"""A job's two budgets against Postgres: attempts (its own failures) and worker losses (infrastructure),
held on every path: the claim, the sweeper, the lifecycle's retries, pauses and manual retry."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from decimal import Decimal

import pytest
from sqlalchemy import text, update
from sqlalchemy.orm import Session, sessionmaker

from models import Job
from tests.clock import now
from worker.config_store import set_config
from worker.jobs.budgets import JobBudgets
from worker.jobs.leases import claim, finish
from worker.jobs.lifecycle import JobContext, WorkResult, run_job
from worker.jobs.outbox import EXTRACTION, request_job, resume_paused, retry_job, sweep
from worker.jobs.registry import Backoff, JobKind, KillSwitchOffError
from worker.llm.errors import BudgetExhaustedError

pytestmark = pytest.mark.integration

SWITCH = "facts.extraction_enabled"
NO_WAIT = Backoff(base_seconds=0.01, max_seconds=0.01)


def sent_nowhere(task: str, job_id: int, queue: str) -> None:
    """The broker: these tests read what the sweeper decided from its report and the jobs table."""


def new_job(factory: sessionmaker[Session], subject: str = "default|p") -> int:
    with factory.begin() as session:
        return request_job(session, EXTRACTION, subject).job_id


def job(factory: sessionmaker[Session], job_id: int) -> Job:
    with factory() as session:
        found = session.get(Job, job_id)
        assert found is not None
        return found


def set_job(factory: sessionmaker[Session], job_id: int, **values: object) -> None:
    with factory.begin() as session:
        session.execute(update(Job).where(Job.id == job_id).values(**values))


def go_stale(factory: sessionmaker[Session], job_id: int) -> None:
    """The holder stopped beating (SIGKILL, OOM): its heartbeat is older than stale_after."""
    set_job(factory, job_id, heartbeat_at=now() - timedelta(seconds=600))


def sweep_once(factory: sessionmaker[Session], budgets: JobBudgets):  # type: ignore[no-untyped-def]
    return sweep(
        factory,
        stale_after=60,
        requeue_after=300,
        enabled=lambda key: True,
        job_budgets=budgets,
        sender=sent_nowhere,
    )


def test_the_sweeper_driven_past_the_cap_fails_the_job_at_max_worker_losses(tx_factory):
    budgets = JobBudgets(max_attempts=2, max_worker_losses=4)
    job_id = new_job(tx_factory)
    for loss in range(1, budgets.max_worker_losses):
        assert claim(tx_factory, job_id, f"w{loss}", stale_after=60, budgets=budgets) is not None
        go_stale(tx_factory, job_id)
        report = sweep_once(tx_factory, budgets)
        assert report.requeued_stale == [job_id] and report.failed_spent == []
        state = job(tx_factory, job_id)
        assert (state.status, state.attempts, state.worker_losses) == ("queued", 0, loss)
    # The last lease the budget allows dies too: the sweeper fails the job instead of re-sending it.
    assert claim(tx_factory, job_id, "w-last", stale_after=60, budgets=budgets) is not None
    go_stale(tx_factory, job_id)
    report = sweep_once(tx_factory, budgets)
    assert (report.requeued_stale, report.failed_spent, report.total) == ([], [job_id], 0)
    failed = job(tx_factory, job_id)
    assert (failed.status, failed.worker_losses, failed.attempts) == ("failed", 4, 0)
    assert failed.last_error == "worker lost 4 times" and failed.finished_at is not None
    assert failed.worker is None and failed.heartbeat_at is None
    # Past the cap nothing moves: more sweeps (even with an old message) and claims leave it failed.
    set_job(tx_factory, job_id, enqueued_at=now() - timedelta(seconds=3600))
    assert sweep_once(tx_factory, budgets).total == 0
    assert claim(tx_factory, job_id, "w-late", stale_after=60, budgets=budgets) is None
    assert job(tx_factory, job_id).worker_losses == budgets.max_worker_losses


def test_a_stale_lease_taken_over_by_a_claim_counts_one_loss_and_the_cap_holds(tx_factory):
    """A redelivered message reaching a dead worker's job (no sweep in between) counts the loss at
    claim, once: the takeover refreshes the lease, so the sweeper has nothing left to count."""
    budgets = JobBudgets(max_attempts=5, max_worker_losses=2)
    job_id = new_job(tx_factory)
    claim(tx_factory, job_id, "w1", stale_after=60, budgets=budgets)
    go_stale(tx_factory, job_id)
    taken = claim(tx_factory, job_id, "w2", stale_after=60, budgets=budgets)
    assert taken is not None and (taken.status, taken.worker_losses, taken.attempts) == ("running", 1, 0)
    assert sweep_once(tx_factory, budgets).requeued_stale == [], "a fresh lease is not a loss"
    go_stale(tx_factory, job_id)
    spent = claim(tx_factory, job_id, "w3", stale_after=60, budgets=budgets)
    assert spent is not None and (spent.status, spent.worker_losses) == ("failed", 2)
    assert spent.last_error == "worker lost 2 times" and spent.worker is None


def test_jobs_already_past_a_cap_are_failed_by_the_sweeper_and_the_claim_never_run(tx_factory):
    """Rows from before the caps held (attempts 6 and 7 against 5 were seen), or a lowered setting."""
    budgets = JobBudgets(max_attempts=5, max_worker_losses=20)
    resent, at_claim = new_job(tx_factory, "default|a"), new_job(tx_factory, "default|b")
    set_job(tx_factory, resent, attempts=7, created_at=now() - timedelta(seconds=60))
    set_job(tx_factory, at_claim, attempts=6, enqueued_at=now())  # its message is still on the broker
    report = sweep_once(tx_factory, budgets)
    assert (report.resent_queued, report.failed_spent) == ([], [resent])
    assert (
        job(tx_factory, resent).status == "failed" and "attempts spent" in job(tx_factory, resent).last_error
    )
    refused = claim(tx_factory, at_claim, "w1", stale_after=60, budgets=budgets)
    assert refused is not None and (refused.status, refused.attempts) == ("failed", 6)
    assert "attempts spent (6 of 5)" in (refused.last_error or "")


def test_finish_counts_a_verdict_as_an_attempt_and_a_pause_as_nothing(tx_factory):
    budgets = JobBudgets(max_attempts=5, max_worker_losses=20)
    job_id = new_job(tx_factory)
    for turn in range(3):  # the kill switch off, then on again, three times over
        claim(tx_factory, job_id, f"w{turn}", stale_after=60, budgets=budgets)
        finish(tx_factory, job_id, f"w{turn}", "paused", pause_reason="kill_switch")
        with tx_factory.begin() as session:
            assert resume_paused(session, [EXTRACTION]) == [(job_id, EXTRACTION)]
    assert (job(tx_factory, job_id).attempts, job(tx_factory, job_id).worker_losses) == (0, 0)
    claim(tx_factory, job_id, "w-run", stale_after=60, budgets=budgets)
    finish(tx_factory, job_id, "w-run", "succeeded", attempt=True)
    assert (job(tx_factory, job_id).status, job(tx_factory, job_id).attempts) == ("succeeded", 1)


def test_a_manual_retry_starts_both_budgets_over(tx_factory):
    job_id = new_job(tx_factory)
    set_job(
        tx_factory, job_id, status="failed", attempts=5, worker_losses=20, last_error="worker lost 20 times"
    )
    with tx_factory.begin() as session:
        retried = retry_job(session, job_id)
        assert (retried.status, retried.attempts, retried.worker_losses) == ("queued", 0, 0)


# ---------------------------------------------------------------------------
# The lifecycle (run_job) with work functions that fail in each way; real Postgres, real threads.
# ---------------------------------------------------------------------------


def kind_doing(work: Callable[[JobContext], WorkResult]) -> JobKind:
    """The extraction kind's registry entry with another work function (the lifecycle is the same)."""
    return JobKind(EXTRACTION, "tasks.extraction.extract_page", "extraction", SWITCH, work, NO_WAIT)


def switch(factory: sessionmaker[Session], value: str) -> None:
    with factory.begin() as session:
        set_config(session, SWITCH, value, updated_by="test")


def test_a_pause_costs_no_attempt_whether_at_claim_mid_run_or_for_the_llm_budget(factory, runtime):
    rt = runtime()
    pauses = iter(
        [
            KillSwitchOffError("switched off mid-run"),
            BudgetExhaustedError("day", Decimal("1"), Decimal("1"), key="llm.budget_daily_usd"),
        ]
    )

    def work(ctx: JobContext) -> WorkResult:
        pause = next(pauses, None)
        if pause is not None:
            raise pause
        return WorkResult("succeeded", counters={"ran": True})

    kind, job_id = kind_doing(work), new_job(factory)

    def run_and_read() -> tuple[str, str, int, int, str | None]:
        outcome = run_job(rt, job_id, kind)
        state = job(factory, job_id)
        return outcome.status, state.status, state.attempts, state.worker_losses, state.pause_reason

    switch(factory, "false")
    assert run_and_read() == ("paused", "paused", 0, 0, "kill_switch")  # the switch is read at claim
    switch(factory, "true")
    with factory.begin() as session:
        resume_paused(session, [EXTRACTION])
    assert run_and_read() == ("paused", "paused", 0, 0, "kill_switch")  # switched off mid-run
    with factory.begin() as session:
        resume_paused(session, [EXTRACTION])
    assert run_and_read() == ("paused", "paused", 0, 0, "budget")
    with factory.begin() as session:
        resume_paused(session, [EXTRACTION], reason="budget")
    assert run_and_read() == ("succeeded", "succeeded", 1, 0, None), "it ran once: one attempt"


def test_a_release_whose_lease_was_taken_over_re_sends_nothing(factory, runtime, broker):
    """A stopping worker whose lease went to another (it beat too late) hands back nothing: the job
    is the new holder's, and a message re-sent for it would only be skipped, or taken as lost."""
    from worker.jobs.shutdown import WorkerStoppingError

    rt, before = runtime(), broker.queued("extraction")

    def work(ctx: JobContext) -> WorkResult:
        set_job(factory, ctx.job.id, worker="another-worker")  # the sweeper gave the lease away
        raise WorkerStoppingError("the worker is stopping")

    kind, job_id = kind_doing(work), new_job(factory)
    outcome = run_job(rt, job_id, kind)
    assert (outcome.status, outcome.detail) == ("lost", "the lease was no longer this run's; nothing re-sent")
    assert broker.queued("extraction") - before == Counter()
    state = job(factory, job_id)
    assert (state.status, state.worker, state.attempts, state.worker_losses) == (
        "running",
        "another-worker",
        0,
        0,
    )


def test_own_failures_stop_at_max_attempts_on_every_path(factory, runtime):
    rt = runtime(job_max_attempts=3, job_max_worker_losses=20)

    def work(ctx: JobContext) -> WorkResult:
        raise RuntimeError("the page is broken")

    kind, job_id = kind_doing(work), new_job(factory)
    outcomes = [run_job(rt, job_id, kind).status for _ in range(3)]
    assert outcomes == ["retry", "retry", "failed"]
    state = job(factory, job_id)
    assert (state.status, state.attempts, state.worker_losses) == ("failed", 3, 0)
    # Named by its class and place: an error no rule sorts may quote what it was working on.
    assert (state.last_error or "").startswith(
        "RuntimeError at "
    ) and "the page is broken" not in state.last_error
    # Neither a late message (the task path) nor the sweeper runs it a fourth time.
    assert run_job(rt, job_id, kind).status == "skipped"
    assert sweep_once(factory, JobBudgets.from_settings(rt.settings)).total == 0
    assert job(factory, job_id).attempts == 3


def test_the_database_going_away_mid_run_is_a_worker_loss_not_an_attempt(factory, runtime):
    """The work's own connection is terminated by the server (what a Postgres restart does to it)."""
    rt = runtime(job_max_attempts=1, job_max_worker_losses=2)

    def work(ctx: JobContext) -> WorkResult:
        with ctx.rt.factory() as session:
            session.execute(text("SELECT pg_terminate_backend(pg_backend_pid())"))
        return WorkResult("succeeded")

    kind, job_id = kind_doing(work), new_job(factory)
    first = run_job(rt, job_id, kind)
    state = job(factory, job_id)
    assert first.status == "retry" and (state.status, state.attempts, state.worker_losses) == ("queued", 0, 1)
    second = run_job(rt, job_id, kind)
    state = job(factory, job_id)
    assert second.status == "failed" and (state.status, state.attempts, state.worker_losses) == (
        "failed",
        0,
        2,
    )
    assert (state.last_error or "").startswith("worker lost 2 times")


def test_a_run_that_fails_while_new_content_arrived_is_sent_again_for_it(factory, runtime, broker):
    """A delivery during a run marks the job for a rerun, and the webhook answers that the running job
    will read it; only a success honoured the mark. A run failing on its last attempt (say, on the
    very change that arrived) left the new content with no job at all."""
    before = broker.queued("extraction")
    rt = runtime(job_max_attempts=1)
    job_id = new_job(factory)

    def work(ctx: JobContext) -> WorkResult:
        with factory.begin() as session:  # a new delivery of the same page meanwhile
            assert request_job(session, EXTRACTION, job(factory, job_id).subject).job_id == job_id
        raise RuntimeError("the page changed under the run")

    outcome = run_job(rt, job_id, kind_doing(work))
    state = job(factory, job_id)
    assert outcome.status == "failed"
    assert broker.queued("extraction") - before == Counter({("tasks.extraction.extract_page", job_id): 1})
    assert (state.status, state.attempts, state.rerun_requested) == ("queued", 0, False)
    assert (state.last_error or "").startswith("RuntimeError at ")


@pytest.mark.parametrize("verdict", ["succeeded", "failed", "paused"])
def test_a_run_whose_lease_was_taken_over_before_its_end_was_written_reports_it_lost(
    factory, runtime, verdict
) -> None:
    """The sweeper took a stale lease over between the run's last check and its end: nothing was
    written, yet the task reported the run's verdict (Flower showed "succeeded" for a job queued
    again), and a failure's note was dropped without a word."""
    rt = runtime()

    def work(ctx: JobContext) -> WorkResult:
        set_job(factory, ctx.job.id, worker="another-worker:abc")  # taken over meanwhile
        return WorkResult(verdict, note="the run's verdict")  # type: ignore[arg-type]

    kind, job_id = kind_doing(work), new_job(factory)
    outcome = run_job(rt, job_id, kind)
    assert outcome.status == "lost" and verdict in outcome.detail
    state = job(factory, job_id)
    assert (state.status, state.worker, state.last_error) == ("running", "another-worker:abc", None)
