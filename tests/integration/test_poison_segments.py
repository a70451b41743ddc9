"""Poison segments against a real Postgres and the simulator over HTTP: a segment that fails permanently
K times is skipped and its page goes on; `--skipped` re-extracts it exactly once."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
from sqlalchemy import func, select
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from models import ExtractionAudit, Fact, Job, LLMCall, OpCheckpoint
from tests.conftest import fresh_database
from worker import db
from worker.config_store import set_config
from worker.extraction import (
    PER_SEGMENT_SOURCE_PREFIX,
    TERMINAL_AUDIT_SOURCE,
    ExtractOptions,
    PageIn,
    run_extract_conversation_facts,
    upsert_page,
)
from worker.llm.openai_compat import OpenAIChatClient

pytestmark = pytest.mark.integration

SLUG = "conversations/poison"
POISON = "[[sim:refusal]]"


def segment_lines(day: int, marker: str = "") -> list[str]:
    return [
        f"**Alice Example** (2024-03-{day:02d} 9:00 AM): I moved to Lisbon in 20{day}, I love it. {marker}",
        f"**Bob Demo** (2024-03-{day:02d} 9:01 AM): I will call Acme Corp about order {day} tomorrow.",
        f"**Alice Example** (2024-03-{day:02d} 9:02 AM): I prefer tea over coffee since {day} years.",
    ]


def page_body(marker: str = POISON) -> str:
    """Three segments a day apart; the middle one carries the simulator's fault marker."""
    return "\n".join([*segment_lines(15), *segment_lines(16, marker), *segment_lines(17)])


MIDDLE_START = "2024-03-16T09:00:00Z"


def put_page(factory: sessionmaker[Session], body: str) -> None:
    with factory.begin() as session:
        set_config(session, "facts.extraction_enabled", "true")
        upsert_page(session, PageIn(slug=SLUG, type="conversation", title="Poison", compiled_truth=body))


def run(factory: sessionmaker[Session], llm: Any, **options: Any):  # type: ignore[no-untyped-def]
    return run_extract_conversation_facts(factory, llm, ExtractOptions(slug=SLUG, **options))


def facts(factory: sessionmaker[Session]) -> list[tuple[int, str, str]]:
    with factory() as session:
        rows = session.execute(
            select(Fact.row_num, Fact.context, Fact.fact)
            .where(Fact.source == PER_SEGMENT_SOURCE_PREFIX, Fact.source_markdown_slug == SLUG)
            .order_by(Fact.row_num)
        )
        return [(n, context, fact) for n, context, fact in rows]


def checkpoint(factory: sessionmaker[Session]) -> OpCheckpoint:
    with factory() as session:
        return session.scalars(select(OpCheckpoint)).one()


def audits(factory: sessionmaker[Session], outcome: str | None = None) -> list[ExtractionAudit]:
    query = select(ExtractionAudit).order_by(ExtractionAudit.id)
    if outcome is not None:
        query = query.where(ExtractionAudit.outcome == outcome)
    with factory() as session:
        return list(session.scalars(query))


def requests(sim: Any) -> int:
    return int(sim.stats()["requests_total"])


@pytest.fixture
def llm(sim: Any) -> OpenAIChatClient:
    return OpenAIChatClient(model="simulator-1", base_url=sim.base_url, provider="simulator")


def clean_facts(server_url: str, sim: Any) -> list[tuple[str, str]]:
    """(context, fact) of an uninterrupted run of the same page, the marker answered normally."""
    sim.configure(text_faults=False)
    try:
        with fresh_database(server_url, "clean") as url:
            db.upgrade(url)
            factory = sessionmaker(db.get_engine(url), expire_on_commit=False)
            put_page(factory, page_body())
            llm = OpenAIChatClient(model="simulator-1", base_url=sim.base_url, provider="simulator")
            assert run(factory, llm).pages_processed == 1
            rows = [(context, fact) for _, context, fact in facts(factory)]
            db.get_engine(url).dispose()
    finally:
        sim.configure(text_faults=True)
    return rows


def test_a_poison_segment_is_skipped_after_k_failures_and_the_page_gets_every_other_segment(
    tx_factory, sim, llm, server_url
):
    clean = clean_facts(server_url, sim)
    middle = f"conversation segment {MIDDLE_START} to 2024-03-16T09:02:00Z"
    assert any(context == middle for context, _ in clean)
    put_page(tx_factory, page_body())
    # Below K (3) the page fails as before: the checkpoint stops before the poison segment.
    for failure in (1, 2):
        result = run(tx_factory, llm)
        assert (result.pages_failed, result.segments_skipped) == (1, 0), result.pages
        assert f"permanent failure {failure}; the segment is skipped at 3" in result.pages[0].reason
        assert [c for _, c, _ in facts(tx_factory)] == [c for c, _ in clean if c < middle]
    assert not audits(tx_factory, "skipped")
    # The third permanent failure skips it, and the page goes on past it in the same run.
    third = run(tx_factory, llm)
    assert (third.pages_failed, third.pages_processed, third.segments_skipped) == (0, 1, 1)
    assert third.pages[0].skipped == 1
    stored = facts(tx_factory)
    assert [(c, f) for _, c, f in stored] == [(c, f) for c, f in clean if c != middle]
    assert [n for n, _, _ in stored] == list(range(len(stored)))
    [skip] = audits(tx_factory, "skipped")
    assert skip.segment_start == MIDDLE_START and skip.facts_count == 0 and skip.llm_call_id is None
    assert "skipped after 3 permanent failures" in (skip.error or "") and "refusal" in (skip.error or "")
    assert "simulated refusal" in (skip.reply or ""), "the model's words are kept"
    assert sum(a.permanent for a in audits(tx_factory)) == 3
    state = checkpoint(tx_factory)
    assert [(e["start_iso"], e["end_iso"]) for e in state.skipped] == [(MIDDLE_START, "2024-03-16T09:02:00Z")]
    with tx_factory() as session:
        terminal = session.scalars(select(Fact).where(Fact.source == TERMINAL_AUDIT_SOURCE)).all()
    assert len(terminal) == 1
    # The next run does not try the skipped segment again.
    before = requests(sim)
    again = run(tx_factory, llm)
    assert again.pages_skipped == 1 and requests(sim) == before

    # Once the segment is good, `--skipped` extracts only it, once, on the page's next row numbers.
    sim.configure(text_faults=False)
    furthest = checkpoint(tx_factory).completed_key
    retried = run(tx_factory, llm, retry_skipped=True)
    # The seed's entry still names the furthest segment (it named the retried one's older end).
    assert checkpoint(tx_factory).completed_key == furthest and furthest.endswith("|2024-03-17T09:02:00Z")
    assert (retried.segments_unskipped, retried.segments_skipped, retried.llm_calls) == (1, 0, 1)
    after = facts(tx_factory)
    assert after[: len(stored)] == stored
    assert [n for n, _, _ in after] == list(range(len(after)))
    assert [(c, f) for _, c, f in after[len(stored) :]] == [(c, f) for c, f in clean if c == middle]
    assert sorted((c, f) for _, c, f in after) == sorted(clean)
    assert checkpoint(tx_factory).skipped == []
    assert checkpoint(tx_factory).next_row_num == len(after)
    before = requests(sim)
    assert run(tx_factory, llm, retry_skipped=True).llm_calls == 0 and requests(sim) == before
    assert facts(tx_factory) == after


def test_a_skipped_segment_that_still_fails_stays_skipped_on_retry(tx_factory, sim, llm):
    with tx_factory.begin() as session:
        set_config(session, "extraction.max_segment_failures", "1")
    put_page(tx_factory, page_body())
    first = run(tx_factory, llm)
    assert (first.pages_processed, first.segments_skipped) == (1, 1)
    stored = facts(tx_factory)
    retried = run(tx_factory, llm, retry_skipped=True)
    assert (retried.llm_calls, retried.segments_skipped, retried.segments_unskipped) == (1, 1, 0)
    assert retried.pages_processed == 1 and retried.pages_failed == 0
    assert facts(tx_factory) == stored
    assert len(checkpoint(tx_factory).skipped) == 1
    assert len(audits(tx_factory, "skipped")) == 2


def skipped_once(factory: sessionmaker[Session], llm: Any) -> int:
    """The page's poison segment skipped at its first failure; how many llm_calls rows there are then."""
    with factory.begin() as session:
        set_config(session, "extraction.max_segment_failures", "1")
    put_page(factory, page_body())
    assert run(factory, llm).segments_skipped == 1
    with factory() as session:
        return session.scalar(select(func.count()).select_from(LLMCall)) or 0


def failure_count_unreadable(self: Any, place: Any) -> int:
    """ExtractionStore.permanent_failures with the database away."""
    raise OperationalError("SELECT count(*) FROM extraction_audit", {}, Exception("server closed"))


class SignalsMidCall:
    """A chat client that signals this process while its call is in flight (on a pipe thread), so the
    main thread is interrupted waiting for it, as `extract --skipped` is by a SIGTERM."""

    def __init__(self, inner: OpenAIChatClient) -> None:
        self.inner, self.provider, self.model = inner, inner.provider, inner.model

    def chat(self, request: Any) -> Any:
        os.kill(os.getpid(), signal.SIGUSR2)
        time.sleep(0.2)  # the main thread is interrupted before the answer comes back
        return self.inner.chat(request)


def test_a_skipped_segment_s_retry_interrupted_in_flight_still_records_its_call(tx_factory, sim, llm):
    calls_before = skipped_once(tx_factory, llm)

    def stop(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGUSR2, stop)  # (refused off the main thread: no silent pass)
    try:
        with pytest.raises(SystemExit):
            run(tx_factory, SignalsMidCall(llm), retry_skipped=True)
    finally:
        signal.signal(signal.SIGUSR2, previous)
    with tx_factory() as session:
        calls_after = session.scalar(select(func.count()).select_from(LLMCall))
    assert calls_after == calls_before + 1  # before: the retry's paid call went unrecorded


def test_a_skipped_segment_s_retry_whose_failure_count_cannot_be_read_still_records_its_call(
    tx_factory, sim, llm, monkeypatch
):
    """The retry's reply came back paid, then reading its failure count raised (the database away), and
    nothing recorded the call: budgets counted low, and the next retry paid for it again."""
    from worker.extraction import store

    calls_before = skipped_once(tx_factory, llm)

    monkeypatch.setattr(store.ExtractionStore, "permanent_failures", failure_count_unreadable)
    with pytest.raises(OperationalError):
        run(tx_factory, llm, retry_skipped=True)
    with tx_factory() as session:
        assert session.scalar(select(func.count()).select_from(LLMCall)) == calls_before + 1


def test_a_rejected_request_discarded_behind_an_earlier_failure_does_not_count_towards_skipping(
    tx_factory, sim, llm
):
    """A refusal discarded behind an earlier failure counts (it is the segment's: several poison
    segments in a page are all skipped within max_segment_failures runs); a rejected request does not
    (a setting the provider does not blame itself for rejects every request alike: a batch of them
    counted every segment of every page at once, and skipped pages whole)."""
    from worker.extraction.committer import counts_when_discarded
    from worker.extraction.segments import Attempt, SegmentResult

    with tx_factory.begin() as session:
        set_config(session, "extraction.max_segment_failures", "2")
    body = "\n".join([*segment_lines(15), *segment_lines(16, POISON), *segment_lines(17, POISON)])
    put_page(tx_factory, body)
    assert run(tx_factory, llm, segment_concurrency=3).pages_failed == 1  # the three asked at once
    assert len([a for a in audits(tx_factory) if a.permanent]) == 2  # the refusal behind counts too
    rejected = Attempt("provider_error", None, [], "HTTP 400: max_tokens too large", rejected=True)
    assert not counts_when_discarded(SegmentResult([rejected], permanent=True))
    refused = Attempt("refusal", None, [], "no")
    assert counts_when_discarded(SegmentResult([refused], permanent=True))


def test_malformed_after_its_repair_turn_counts_once_per_try(tx_factory, sim, llm):
    with tx_factory.begin() as session:
        set_config(session, "extraction.max_segment_failures", "2")
    put_page(tx_factory, page_body("[[sim:malformed]]"))
    assert run(tx_factory, llm).pages_failed == 1
    second = run(tx_factory, llm)
    assert (second.pages_processed, second.segments_skipped) == (1, 1)
    malformed = audits(tx_factory, "malformed_output")
    assert len(malformed) == 4  # two tries, each a reply and its repair turn
    assert [a.permanent for a in malformed] == [False, True, False, True]
    [skip] = audits(tx_factory, "skipped")
    assert "malformed_output" in (skip.error or "") and "Sure! Here is" in (skip.reply or "")


def test_transient_failures_never_skip_a_segment(tx_factory, sim, llm):
    with tx_factory.begin() as session:
        set_config(session, "extraction.max_segment_failures", "1")
    put_page(tx_factory, page_body(marker=""))
    flaky = OpenAIChatClient(
        model="simulator-1",
        base_url=sim.base_url,
        provider="simulator",
        default_headers={"x-simulator-fault": "500"},
    )
    for _ in range(3):
        result = run(tx_factory, flaky)
        assert (result.pages_failed, result.segments_skipped) == (1, 0)
    assert not audits(tx_factory, "skipped") and not any(a.permanent for a in audits(tx_factory))


def test_a_forced_re_extraction_skips_too_and_swaps_in_the_other_segments(tx_factory, sim, llm):
    with tx_factory.begin() as session:
        set_config(session, "extraction.max_segment_failures", "1")
    put_page(tx_factory, page_body())
    sim.configure(text_faults=False)
    run(tx_factory, llm)
    whole = facts(tx_factory)
    sim.configure(text_faults=True)
    forced = run(tx_factory, llm, force=True)
    assert (forced.pages_processed, forced.segments_skipped) == (1, 1)
    middle = [c for _, c, _ in whole if MIDDLE_START in c]
    assert middle and not any(MIDDLE_START in c for _, c, _ in facts(tx_factory))
    assert len(checkpoint(tx_factory).skipped) == 1 and len(audits(tx_factory, "skipped")) == 1
    sim.configure(text_faults=False)
    assert run(tx_factory, llm, retry_skipped=True).segments_unskipped == 1
    assert sorted((c, f) for _, c, f in facts(tx_factory)) == sorted((c, f) for _, c, f in whole)


def test_a_forced_run_that_fails_after_a_held_skip_counts_no_skip(tx_factory, sim, llm):
    """A page re-extracted whole holds its skips for the swap; a later segment's failure swaps nothing
    in, yet the run counted the skip: a job reported progress that never committed (and so waited out
    an outage's whole patience on a segment the provider fails every time)."""
    import json

    from worker.llm.errors import LLMError

    class LastFails:
        provider, model = llm.provider, llm.model

        def chat(self, request: Any) -> Any:
            if "order 17" in json.dumps(request.messages):
                raise LLMError("HTTP 500: the model produced invalid content", retryable=True, status=500)
            return llm.chat(request)

        def embed(self, texts: list[str], *, purpose: str = "embedding") -> Any:
            return llm.embed(texts, purpose=purpose)

    with tx_factory.begin() as session:
        set_config(session, "extraction.max_segment_failures", "1")
    put_page(tx_factory, page_body())
    sim.configure(text_faults=False)
    run(tx_factory, llm)
    sim.configure(text_faults=True)
    forced = run(tx_factory, LastFails(), force=True)
    assert (forced.pages_failed, forced.segments_processed, forced.segments_skipped) == (1, 0, 0)
    assert forced.pages[0].skipped == 0, "no `--skipped` to offer: nothing was skipped"
    assert not audits(tx_factory, "skipped") and not checkpoint(tx_factory).skipped


def test_only_extraction_jobs_take_skipped(tx_factory):
    from worker.jobs import queries
    from worker.jobs.budgets import JobBudgets
    from worker.jobs.leases import claim, finish
    from worker.jobs.outbox import CALIBRATION, EXTRACTION, RETRY_SKIPPED, request_job

    budgets = JobBudgets(max_attempts=5, max_worker_losses=20)
    put_page(tx_factory, "a page to retry")  # an extraction job's page must be stored to retry it
    with tx_factory.begin() as session:
        page_job = request_job(session, EXTRACTION, f"default|{SLUG}").job_id
        other = request_job(session, CALIBRATION, "default").job_id
    for job_id in (page_job, other):
        claim(tx_factory, job_id, "w", stale_after=60, budgets=budgets)
        finish(tx_factory, job_id, "w", "succeeded", attempt=True)
    with tx_factory.begin() as session, pytest.raises(queries.JobHasNoSegmentsError, match="calibration"):
        queries.retry(session, other, skipped=True)
    with tx_factory.begin() as session:
        assert queries.retry(session, page_job, skipped=True).options[RETRY_SKIPPED] is True
    with tx_factory() as session:
        assert session.get(Job, page_job).options == {RETRY_SKIPPED: True}
    claim(tx_factory, page_job, "w", stale_after=60, budgets=budgets)
    finish(tx_factory, page_job, "w", "succeeded", attempt=True)
    with tx_factory.begin() as session:  # a plain retry turns it off again
        assert queries.retry(session, page_job).options[RETRY_SKIPPED] is False


def test_a_conflict_in_a_skipped_segments_retry_reports_the_page_and_the_run_goes_on(
    tx_factory, sim, llm, monkeypatch: pytest.MonkeyPatch
):
    """`factmill extract --skipped` with another run changing a page during its retry: the conflict
    escaped the run (the retry ran outside the per-page report), the pages after it were never
    extracted, nothing was counted, and the CLI printed a traceback."""
    from worker.extraction.options import CheckpointConflictError
    from worker.extraction.poison import SkippedRetry

    put_page(tx_factory, page_body(marker=""))
    other = "conversations/poison-b"
    with tx_factory.begin() as session:
        upsert_page(session, PageIn(slug=other, type="conversation", title="B", compiled_truth=page_body("")))
    raised: list[str] = []

    def conflicted(self: Any, ref: Any) -> Any:
        if not raised:
            raised.append(ref.slug)
            raise CheckpointConflictError("another run moved the page's checkpoint on")
        return None

    monkeypatch.setattr(SkippedRetry, "retry_page", conflicted)
    result = run_extract_conversation_facts(tx_factory, llm, ExtractOptions(retry_skipped=True))
    assert len(raised) == 1
    assert (result.pages_failed, result.pages_processed) == (1, 1), result.pages


class SlowFor:
    """``llm``, its answer to a prompt holding ``words`` held back ``seconds`` (the next segment's
    comes first: both are ready together)."""

    def __init__(self, llm: Any, words: str, seconds: float) -> None:
        self.llm, self.words, self.seconds = llm, words, seconds
        self.provider, self.model = llm.provider, llm.model

    def chat(self, request: Any) -> Any:
        if any(self.words in text for _, text in request.messages):
            time.sleep(self.seconds)
        return self.llm.chat(request)


def test_a_database_error_reading_a_failed_segments_count_keeps_the_spend_of_the_good_ones_before_it(
    tx_factory, llm, sim, monkeypatch
) -> None:
    """A run of ready results, a good segment then one that failed: reading the failed one's count
    raised (a database blip), and the good one, marked handed to a commit never asked, had no llm_calls
    row: budgets undercounted it, and the job's retry paid for it again."""
    from worker.extraction import store

    put_page(tx_factory, page_body())

    monkeypatch.setattr(store.ExtractionStore, "permanent_failures", failure_count_unreadable)
    slow, before = SlowFor(llm, "in 2015", 1.0), requests(sim)
    with pytest.raises(OperationalError):
        run(tx_factory, slow, segment_concurrency=3)
    with tx_factory() as session:
        calls = session.scalar(
            select(func.count()).select_from(LLMCall).where(LLMCall.purpose == "extraction")
        )
    assert calls == requests(sim) - before == 3  # every segment's call was paid: every one recorded


def test_a_failed_pages_calls_in_flight_start_no_other_attempt(tx_factory, sim, llm):
    """When a page fails its calls in flight finish (paid) and their results are discarded; a malformed
    first reply among them still sent its repair turn (the segment's text again: paid, thrown away) and
    the page's thread waited for it. Once the page stops, no call starts another attempt."""
    import dataclasses
    import json

    from worker.llm.errors import LLMError

    asked: list[int] = []

    class Scripted:
        provider, model = llm.provider, llm.model

        def chat(self, request: Any) -> Any:
            text = json.dumps(request.messages)
            if "order 15" in text:  # the first segment fails at once: the page stops
                raise LLMError("HTTP 500: down", retryable=True, status=500)
            if "order 16" in text:  # in flight meanwhile; its reply is malformed after the page failed
                asked.append(16)
                time.sleep(0.5)
                return dataclasses.replace(llm.chat(request), text="this is not JSON")
            return llm.chat(request)

        def embed(self, texts: list[str], *, purpose: str = "embedding") -> Any:
            return llm.embed(texts, purpose=purpose)

    put_page(tx_factory, "\n".join([*segment_lines(15), *segment_lines(16), *segment_lines(17)]))
    report = run(tx_factory, Scripted(), segment_concurrency=3)
    assert report.pages_failed == 1
    assert asked == [16], "the discarded segment's repair turn was sent"
    with tx_factory() as session:  # its paid attempt is recorded all the same (discarded)
        outcomes = session.scalars(select(LLMCall.outcome).order_by(LLMCall.id)).all()
    assert outcomes.count("malformed_output") == 1 and outcomes.count("provider_error") == 1, outcomes


def test_a_skipped_segments_retry_whose_lease_lapsed_commits_nothing_and_keeps_the_spend(
    tx_factory, sim, llm
):
    """The retry of a skipped segment committed with no look at the lease: a run whose lease had lapsed
    moved the page on under the worker that had taken the job over (its commit then a conflict)."""
    from worker.accounting import Budget, Ledger
    from worker.config_store import ConfigReader
    from worker.extraction.service import extract_conversation_facts
    from worker.extraction.store import ExtractionStore
    from worker.jobs.leases import LeaseLostError

    put_page(tx_factory, page_body())
    for _ in range(3):  # skipped at its third permanent failure
        run(tx_factory, llm)
    assert checkpoint(tx_factory).skipped
    stored = facts(tx_factory)
    sim.configure(text_faults=False)
    config = ConfigReader(tx_factory, ttl=0)

    def lapsed() -> None:
        raise LeaseLostError("the job's lease lapsed")

    with tx_factory() as session:
        calls = session.scalar(select(func.count()).select_from(LLMCall))
    store = ExtractionStore(tx_factory, Ledger(config.get))
    options = ExtractOptions(slug=SLUG, retry_skipped=True)
    with pytest.raises(LeaseLostError):
        extract_conversation_facts(store, llm, options, config, Budget(tx_factory, config.get), lease=lapsed)
    assert facts(tx_factory) == stored and checkpoint(tx_factory).skipped  # nothing committed
    with tx_factory() as session:
        assert session.scalar(select(func.count()).select_from(LLMCall)) == calls + 1  # its call, recorded
