"""A provider that cannot serve (an outage, the account's money spent) against Postgres: the job spends
neither budget and waits the outage out on its clock (worker.jobs.outages), failing only once the
provider has served it nothing for FACTMILL_JOB_PROVIDER_OUTAGE_PATIENCE_SECONDS."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest

from models import LLMCall
from tests.clock import now
from tests.integration.test_job_budgets import job, kind_doing, new_job, set_job
from worker.jobs.lifecycle import JobContext, WorkResult, run_job
from worker.jobs.outbox import EXTRACTION, request_job, retry_job
from worker.jobs.registry import Backoff, KillSwitchOffError
from worker.jobs.shutdown import WorkerStoppingError
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


def answered(factory, job_id: int, outcome: str = "ok", at: datetime | None = None) -> None:  # type: ignore[no-untyped-def]
    """An llm_calls row of the job: a call the provider answered (or, ``provider_error``, did not)."""
    values = {"created_at": at} if at is not None else {}
    with factory.begin() as session:
        session.add(
            LLMCall(
                job_id=job_id,
                provider="simulator",
                model="simulator-1",
                purpose="extraction",
                outcome=outcome,
                **values,
            )
        )


def test_a_run_the_provider_answered_in_part_with_nothing_gone_forward_spends_an_attempt(
    factory, runtime
) -> None:
    """A segment the provider fails with a 500 every time ("the model produced invalid content"), its
    later segments answered in the same run and thrown away: taken for an outage, the page waited out
    the whole patience, paying on every run for the calls in flight. It is the job's own failure."""
    rt = runtime(job_provider_outage_patience_seconds=PATIENCE)
    job_id = new_job(factory)

    def work(ctx: JobContext) -> WorkResult:
        answered(factory, ctx.job.id, "malformed_output")  # an answer, even one of no use
        return WorkResult("outage", note="HTTP 500: the model produced invalid content", progressed=False)

    set_job(factory, job_id, provider_outage_since=now() - timedelta(minutes=10))
    outcome = run_job(rt, job_id, kind_doing(work))
    state = job(factory, job_id)
    assert outcome.status == "retry" and (state.attempts, state.worker_losses) == (1, 0)
    assert state.provider_outage_since is None
    assert (state.last_error or "").startswith(
        "the provider answered this run's other calls but not this one"
    )


def test_an_outage_raised_by_a_kind_that_cannot_say_whether_it_went_forward_waits_on_the_clock(
    factory, runtime
) -> None:
    """A consolidation whose rounds committed before the provider went away (or a backfill pass that
    collected a batch and then failed a send) raises: its answered calls were taken for "nothing went
    forward", and every job in flight lost an attempt each time an outage began."""
    rt = runtime(job_provider_outage_patience_seconds=PATIENCE)
    job_id = new_job(factory)

    def work(ctx: JobContext) -> WorkResult:
        answered(factory, ctx.job.id)
        raise OVERLOADED

    assert run_job(rt, job_id, kind_doing(work)).status == "retry"
    state = job(factory, job_id)
    assert (state.attempts, state.worker_losses) == (0, 0) and state.provider_outage_since is not None


def test_an_outage_that_began_mid_run_after_progress_starts_the_clock_anew(factory, runtime) -> None:
    """A page that committed segments before the provider went away: the outage's, not the page's, and
    it began then (kept from an earlier incident, a flapping provider failed a page that went forward
    on every run, its note saying the provider "served it nothing for 24 h")."""
    rt = runtime(job_provider_outage_patience_seconds=PATIENCE)
    job_id = new_job(factory)
    set_job(factory, job_id, provider_outage_since=now() - timedelta(hours=2))  # past the patience

    def work(ctx: JobContext) -> WorkResult:
        answered(factory, ctx.job.id)
        return WorkResult("outage", note="HTTP 503: overloaded", progressed=True)

    outcome = run_job(rt, job_id, kind_doing(work))
    assert outcome.status == "retry" and outcome.retry_in is not None and outcome.retry_in <= 5.0
    state = job(factory, job_id)
    assert (state.attempts, state.worker_losses) == (0, 0)
    assert state.provider_outage_since is not None and state.provider_outage_since > now() - timedelta(
        minutes=5
    )


def test_an_answer_from_before_the_run_does_not_stop_the_clock(factory, runtime) -> None:
    rt = runtime(job_provider_outage_patience_seconds=PATIENCE)
    job_id = new_job(factory)
    long_ago = now() - timedelta(hours=2)
    set_job(factory, job_id, provider_outage_since=long_ago)
    answered(factory, job_id, at=long_ago + timedelta(minutes=30))
    answered(factory, job_id, "provider_error")  # this run's own failed call: no answer
    assert run_job(rt, job_id, raising(OVERLOADED)).status == "failed"
    state = job(factory, job_id)
    assert state.status == "failed" and (state.last_error or "").startswith(
        "the LLM provider served this job nothing"
    )


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


@pytest.mark.parametrize(
    ("ending", "kept"),
    [
        (RuntimeError("a bug"), False),  # the job's own failure: a run the provider had nothing to do with
        (WorkResult("succeeded"), False),
        (KillSwitchOffError("switched off mid-run"), False),  # a pause: time paused is no outage time
        (WorkerStoppingError("stopping"), True),  # handed back by a stopping worker: no verdict
    ],
    ids=["own failure", "succeeded", "paused", "released"],
)
def test_a_run_that_ends_otherwise_empties_the_clock_unless_it_reached_no_verdict(
    factory, runtime, ending, kept
) -> None:
    """A pause left the clock running: an operator who switched extraction off for a day's incident saw
    every job fail at its first 429 after turning it on, the provider having "served it nothing for 26 h"."""
    rt = runtime(job_provider_outage_patience_seconds=PATIENCE)

    def work(ctx: JobContext) -> WorkResult:
        if isinstance(ending, Exception):
            raise ending
        return ending  # type: ignore[no-any-return]

    job_id = new_job(factory)
    started = now() - timedelta(minutes=10)
    set_job(factory, job_id, provider_outage_since=started)
    run_job(rt, job_id, kind_doing(work))
    assert since(factory, job_id) == (started if kept else None)


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


@pytest.mark.parametrize(("losses", "kept"), [(1, False), (3, True)], ids=["losses spent", "losses left"])
def test_a_run_the_database_cut_short_leaves_the_clock_unless_it_fails_the_job(
    factory, runtime, losses, kept
):
    """A database outage tells nothing of the provider's: the clock is left; but the run that spends the
    last worker loss fails the job, and a failed job showed an outage clock still running."""
    rt = runtime(job_provider_outage_patience_seconds=PATIENCE, job_max_worker_losses=losses)

    def work(ctx: JobContext) -> WorkResult:
        return WorkResult("requeue", note="the database is unavailable")

    job_id = new_job(factory)
    started = now() - timedelta(minutes=10)
    set_job(factory, job_id, provider_outage_since=started)
    assert run_job(rt, job_id, kind_doing(work)).status == ("retry" if kept else "failed")
    assert since(factory, job_id) == (started if kept else None)


class AnswersThenDown:
    """``llm``, answering its first ``answers`` chats (``garbled``: with text that is no JSON), then a
    503 past the retry layer (an outage)."""

    def __init__(self, llm, answers: int, *, garbled: bool = False) -> None:  # type: ignore[no-untyped-def]
        self.llm, self.provider, self.model, self.left = llm, llm.provider, llm.model, answers
        self.garbled = garbled

    def chat(self, request):  # type: ignore[no-untyped-def]
        from worker.llm.types import ChatResponse, Usage

        self.left -= 1
        if self.left < 0:
            raise LLMError("HTTP 503: overloaded", retryable=True, status=503)
        if self.garbled:
            return ChatResponse("no facts here, sorry", "end", Usage(100, 10), self.provider, self.model, 5)
        return self.llm.chat(request)

    def embed(self, texts, *, purpose="embedding"):  # type: ignore[no-untyped-def]
        return self.llm.embed(texts, purpose=purpose)


def edited_after_extraction(factory, runtime, sim, slug: str, **config: str):  # type: ignore[no-untyped-def]
    """(runtime, job id): ``slug`` extracted, ``config`` set, then its first message edited, so its job
    re-extracts it whole (one call at a time, one try each, its facts neither embedded nor consolidated)."""
    from tests.integration.test_extraction import SAMPLE_BODY, put_page
    from worker.config_store import set_config
    from worker.jobs.outbox import page_subject

    rt = runtime(
        llm="simulator",
        simulator_url=sim.base_url,
        llm_max_attempts=1,
        llm_concurrency=1,
        consolidate_after_extraction=False,
        embed_after_extraction=False,
        job_provider_outage_patience_seconds=PATIENCE,
    )
    subject = page_subject("default", slug)
    put_page(factory, slug)
    with factory.begin() as session:
        first = request_job(session, EXTRACTION, subject).job_id
    assert run_job(rt, first, EXTRACTION).status == "succeeded"
    with factory.begin() as session:
        for key, value in config.items():
            set_config(session, key, value)
    put_page(factory, slug, body=SAMPLE_BODY.replace("I just signed", "I just signed and sealed"))
    with factory.begin() as session:
        return rt, request_job(session, EXTRACTION, subject).job_id


def test_a_page_re_extracted_whole_that_the_provider_left_mid_run_waits_on_the_clock(
    factory, runtime, sim
) -> None:
    """An edited page is re-extracted whole and commits at its end: its answered segments, held for the
    swap, were not counted as going forward, so an outage that began mid-run was taken for the job's
    own failure and spent an attempt (five outages, five attempts, each paying for the page again)."""
    rt, job_id = edited_after_extraction(factory, runtime, sim, "chats/whole")
    real = rt.llm
    rt._llm = AnswersThenDown(real, answers=1)  # the first segment answered, the second not
    assert run_job(rt, job_id, EXTRACTION).status == "retry"
    state = job(factory, job_id)
    assert (state.attempts, state.worker_losses) == (0, 0) and state.provider_outage_since is not None
    # Its answered segment is not kept (the swap never came): the clock runs on, not restarted by it,
    # or every run paid for that segment again for as long as the provider failed the next.
    set_job(factory, job_id, provider_outage_since=now() - timedelta(seconds=PATIENCE + 60))
    due(factory, job_id)
    rt._llm = AnswersThenDown(real, answers=1)
    run_job(rt, job_id, EXTRACTION)
    assert job(factory, job_id).status == "failed"


def test_a_page_re_extracted_whole_whose_answered_segment_was_skipped_waits_on_the_clock_too(
    factory, runtime, sim
) -> None:
    """Its only answered segment was skipped (a permanent failure, answered all the same): counted as
    nothing answered, an outage that began mid-run spent an attempt on every run."""
    config = {"extraction.max_segment_failures": "1"}
    rt, job_id = edited_after_extraction(factory, runtime, sim, "chats/skipped", **config)
    # The first segment's reply and its repair are no JSON (skipped at once), the second meets an outage.
    rt._llm = AnswersThenDown(rt.llm, answers=2, garbled=True)
    assert run_job(rt, job_id, EXTRACTION).status == "retry"
    state = job(factory, job_id)
    assert (state.attempts, state.worker_losses) == (0, 0) and state.provider_outage_since is not None
