"""A provider that cannot serve (an outage, the account's money spent) against Postgres: the job spends
neither budget and waits the outage out on its clock (worker.jobs.outages), failing only once the
provider has served it nothing for FACTMILL_JOB_PROVIDER_OUTAGE_PATIENCE_SECONDS."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest
from sqlalchemy import update

from models import Job, LLMCall
from tests.clock import now
from tests.integration.test_job_budgets import job, kind_doing, new_job, set_job
from worker.jobs.lifecycle import JobContext, WorkResult, run_job
from worker.jobs.outbox import EXTRACTION, request_job, retry_job
from worker.jobs.registry import Backoff
from worker.llm.errors import LLMError

pytestmark = pytest.mark.integration

PATIENCE = 3600.0
OVERLOADED = LLMError("HTTP 503: overloaded", retryable=True, status=503)


def due(factory, job_id: int) -> None:  # type: ignore[no-untyped-def]
    """The retry's backoff skipped: the next run_job claims the job at once."""
    set_job(factory, job_id, enqueued_at=now())


def raising(error: LLMError):  # type: ignore[no-untyped-def]
    def work(ctx: JobContext) -> WorkResult:
        raise error

    return kind_doing(work)


def since(factory, job_id: int) -> datetime | None:  # type: ignore[no-untyped-def]
    return job(factory, job_id).provider_outage_since


def test_a_provider_outage_spends_neither_budget_and_the_job_fails_only_past_the_patience(
    factory, runtime, sim
) -> None:
    """A page whose calls fail with retryable errors past the retry layer's wait: as the job's own
    failure, every job in flight failed within ten minutes of an outage; as a worker loss (20 of them),
    within three quarters of an hour, and its requeues counted as the crash loops that budget stops.
    It waits now, with no budget spent, for as long as the patience allows."""
    from tests.integration.test_extraction import put_page
    from worker.jobs.outbox import page_subject

    rt = runtime(
        llm="simulator",
        simulator_url=sim.base_url,
        llm_max_attempts=2,
        llm_backoff_base_seconds=0.01,
        job_max_attempts=1,
        job_max_worker_losses=1,
        job_provider_outage_patience_seconds=PATIENCE,
    )
    put_page(factory, "chats/outage")
    with factory.begin() as session:
        job_id = request_job(session, EXTRACTION, page_subject("default", "chats/outage")).job_id
    sim.configure(rate_500=1.0)
    first = run_job(rt, job_id, EXTRACTION)
    state = job(factory, job_id)
    assert first.status == "retry" and (state.status, state.attempts, state.worker_losses) == ("queued", 0, 0)
    assert first.retry_in is not None and first.retry_in <= 5.0, "the first wait is the backoff's base"
    started = state.provider_outage_since
    assert started is not None
    assert (state.last_error or "").startswith(
        "the LLM provider cannot serve this job; it waits (failed after 60 min"
    )
    assert "provider_error" in (state.last_error or "")
    # Still down: the clock keeps its start (one loss allowed and one attempt: neither is spent).
    due(factory, job_id)
    assert run_job(rt, job_id, EXTRACTION).status == "retry"
    state = job(factory, job_id)
    assert (state.status, state.attempts, state.worker_losses, state.provider_outage_since) == (
        "queued",
        0,
        0,
        started,
    )
    # Two hours without an answer, past the hour's patience: the job fails, saying why and what to do.
    set_job(factory, job_id, provider_outage_since=now() - timedelta(hours=2), enqueued_at=now())
    assert run_job(rt, job_id, EXTRACTION).status == "failed"
    state = job(factory, job_id)
    assert (state.status, state.attempts, state.worker_losses) == ("failed", 0, 0)
    assert (state.last_error or "").startswith("the LLM provider served this job nothing for 2.0 h"), (
        state.last_error
    )
    assert "retry it by hand" in (state.last_error or "") and state.provider_outage_since is None
    # An operator's retry starts over; a request the provider rejects (the page's own fault) spends an
    # attempt, as before.
    with factory.begin() as session:
        retry_job(session, job_id)
    sim.configure(
        rate_500=0.0, raw_replies={"chat.completions": {"error": {"message": "no"}}}, raw_status=400
    )
    try:
        assert run_job(rt, job_id, EXTRACTION).status == "failed"
    finally:
        sim.configure(raw_replies={}, raw_status=200)
    state = job(factory, job_id)
    assert (state.attempts, state.worker_losses, state.provider_outage_since) == (1, 0, None)


def test_the_outage_clock_starts_over_once_the_provider_has_answered_the_job(factory, runtime) -> None:
    """A flapping provider, or a long page making progress between incidents: an answer since the
    clock started (any reply, a malformed one too) means the provider serves the job, so the outage
    counts from now. A failed call is no answer."""
    rt = runtime(job_provider_outage_patience_seconds=PATIENCE)
    kind = raising(OVERLOADED)
    answered, unanswered = new_job(factory, "default|a"), new_job(factory, "default|b")
    long_ago = now() - timedelta(hours=2)
    with factory.begin() as session:
        for job_id, outcome in ((answered, "malformed_output"), (unanswered, "provider_error")):
            session.execute(update(Job).where(Job.id == job_id).values(provider_outage_since=long_ago))
            session.add(
                LLMCall(
                    job_id=job_id,
                    provider="simulator",
                    model="simulator-1",
                    purpose="extraction",
                    outcome=outcome,
                    created_at=long_ago + timedelta(minutes=30),
                )
            )
    outcome = run_job(rt, answered, kind)
    state = job(factory, answered)
    assert outcome.status == "retry" and state.status == "queued"
    assert state.provider_outage_since is not None and state.provider_outage_since > now() - timedelta(
        minutes=5
    )
    assert outcome.retry_in is not None and outcome.retry_in <= 5.0, "a clock started anew waits the base"
    assert run_job(rt, unanswered, kind).status == "failed"
    assert job(factory, unanswered).status == "failed"


def test_the_wait_grows_with_the_outage_up_to_the_backoff_s_ceiling(factory, runtime) -> None:
    """As an exponential backoff's tries do, with no counter to keep: about as long as the outage so far."""
    rt = runtime(job_provider_outage_patience_seconds=PATIENCE)
    kind, backoff, job_id = (
        raising(OVERLOADED),
        Backoff(base_seconds=5.0, max_seconds=300.0),
        new_job(factory),
    )
    set_job(factory, job_id, provider_outage_since=now() - timedelta(minutes=2))
    outcome = run_job(rt, job_id, kind, backoff)
    assert outcome.retry_in is not None and 60.0 <= outcome.retry_in <= 125.0, outcome.retry_in
    set_job(factory, job_id, provider_outage_since=now() - timedelta(minutes=40), enqueued_at=now())
    outcome = run_job(rt, job_id, kind, backoff)
    assert outcome.retry_in is not None and 150.0 <= outcome.retry_in <= 300.0, outcome.retry_in


def test_a_run_that_ends_otherwise_keeps_the_clock_and_one_that_finishes_empties_it(factory, runtime) -> None:
    rt = runtime(job_provider_outage_patience_seconds=PATIENCE)
    results = iter([RuntimeError("a bug"), WorkResult("succeeded")])

    def work(ctx: JobContext) -> WorkResult:
        result = next(results)
        if isinstance(result, Exception):
            raise result
        return result

    kind, job_id = kind_doing(work), new_job(factory)
    started = now() - timedelta(minutes=10)
    set_job(factory, job_id, provider_outage_since=started)
    assert run_job(rt, job_id, kind).status == "retry"
    assert since(factory, job_id) == started, "the job's own failure is no answer from the provider"
    due(factory, job_id)
    assert run_job(rt, job_id, kind).status == "succeeded"
    assert since(factory, job_id) is None


def test_a_spent_provider_account_waits_on_the_outage_clock(factory, runtime, sim) -> None:
    """OpenAI's 429 insufficient_quota (and Anthropic's credit balance) blame the account, not the
    request, and are not retried by the gateway: each page failed as an attempt of its own, and every job
    in flight failed within a minute, none coming back after the top-up."""
    from tests.integration.test_extraction import put_page
    from worker.jobs.outbox import page_subject

    rt = runtime(llm="simulator", simulator_url=sim.base_url, llm_max_attempts=2, job_max_attempts=1)
    put_page(factory, "chats/quota")
    with factory.begin() as session:
        job_id = request_job(session, EXTRACTION, page_subject("default", "chats/quota")).job_id
    quota = {
        "message": "You exceeded your current quota",
        "type": "insufficient_quota",
        "code": "insufficient_quota",
    }
    sim.configure(raw_replies={"chat.completions": {"error": quota}}, raw_status=429)
    try:
        first = run_job(rt, job_id, EXTRACTION)
    finally:
        sim.configure(raw_replies={}, raw_status=200)
    state = job(factory, job_id)
    assert first.status == "retry" and (state.status, state.attempts, state.worker_losses) == ("queued", 0, 0)
    assert state.provider_outage_since is not None
    assert "exceeded your current quota" in (state.last_error or "")


def test_a_provider_that_cannot_be_reached_waits_on_the_outage_clock(factory, runtime):
    """Refused connections, resets, no DNS answer (the gateway's tries spent): a network blip of two
    minutes failed every job in flight for good on its five attempts."""
    import httpx2

    from worker.llm.errors import to_llm_error

    rt = runtime(job_max_attempts=1, job_max_worker_losses=1)
    kind, job_id = raising(to_llm_error(httpx2.ConnectError("connection refused"))), new_job(factory)
    assert run_job(rt, job_id, kind).status == "retry"
    state = job(factory, job_id)
    assert (state.status, state.attempts, state.worker_losses) == ("queued", 0, 0)
    assert state.provider_outage_since is not None


def test_any_kind_s_provider_outage_waits_and_a_rejection_spends_an_attempt(factory, runtime):
    rt = runtime(job_max_attempts=3, job_max_worker_losses=3)
    raised: list[LLMError] = [OVERLOADED]

    def work(ctx: JobContext) -> WorkResult:
        raise raised[0]

    kind, job_id = kind_doing(work), new_job(factory)
    assert run_job(rt, job_id, kind).status == "retry"
    state = job(factory, job_id)
    assert (state.status, state.attempts, state.worker_losses) == ("queued", 0, 0)
    # A key refused, or a timeout (a request too large to finish in time fails alike every try): the
    # job's own, on its attempts.
    for error in (
        LLMError("HTTP 401: invalid key", retryable=False, status=401, deployment_fault=True),
        LLMError("the provider timed out", retryable=True),
    ):
        raised[0] = error
        due(factory, job_id)
        run_job(rt, job_id, kind)
    state = job(factory, job_id)
    assert (state.attempts, state.worker_losses) == (2, 0)
    # Any kind's call refused for the account's money: an outage too.
    raised[0] = LLMError(
        "HTTP 400: Your credit balance is too low to access the Anthropic API",
        retryable=False,
        status=400,
        deployment_fault=True,
        code="invalid_request_error",
    )
    due(factory, job_id)
    assert run_job(rt, job_id, kind).status == "retry"
    state = job(factory, job_id)
    assert (state.attempts, state.worker_losses) == (2, 0) and state.provider_outage_since is not None
