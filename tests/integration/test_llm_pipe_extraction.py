"""Extraction through a shared LLM pipe (as a worker process runs it): real Postgres, the simulator over
HTTP through the openai SDK, several pages on one pipe from several job threads at once."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from models import ExtractionAudit, Fact, OpCheckpoint
from tests.integration.test_service import conversation, expected_facts, fact_rows
from worker.extraction import PER_SEGMENT_SOURCE_PREFIX, ExtractOptions, run_extract_conversation_facts
from worker.extraction.pages import PageIn, upsert_page
from worker.llm.openai_compat import OpenAIChatClient
from worker.llm.pipe import LLMPipe
from worker.llm.types import ChatRequest, ChatResponse

pytestmark = pytest.mark.integration

WAIT = 30.0  # a deadlock guard, not a timing assertion


def segment_number(request: ChatRequest) -> int:
    """Which segment of a `conversation()` page a request is about (its lines say "order S-M")."""
    text = request.messages[0][1]
    return int(text.split("order ", 1)[1].split("-", 1)[0])


class Scripted:
    """The simulator's client, holding segment 0's call until every other call has returned (so the
    page's results are all ready together) and failing ``fail`` (a 500) if given."""

    def __init__(self, simulator: Any, segments: int, fail: int | None = None) -> None:
        self.ok = OpenAIChatClient(model="simulator-1", base_url=simulator.base_url, provider="simulator")
        self.bad = OpenAIChatClient(
            model="simulator-1",
            base_url=simulator.base_url,
            provider="simulator",
            default_headers={"x-simulator-fault": "500"},
        )
        self.provider, self.model = self.ok.provider, self.ok.model
        self.others = segments - 1
        self.fail = fail
        self.returned = 0
        self.cond = threading.Condition()
        self.held = False

    def chat(self, request: ChatRequest) -> ChatResponse:
        number = segment_number(request)
        if number == 0:
            with self.cond:
                self.held = self.cond.wait_for(lambda: self.returned >= self.others, WAIT)
        try:
            return (self.bad if number == self.fail else self.ok).chat(request)
        finally:
            with self.cond:
                self.returned += number != 0
                self.cond.notify_all()


def put_pages(factory: sessionmaker[Session], pages: dict[str, str]) -> None:
    with factory.begin() as session:
        for slug, body in pages.items():
            upsert_page(session, PageIn(slug=slug, type="conversation", title=slug, compiled_truth=body))


def transactions(factory: sessionmaker[Session], slug: str) -> int:
    """How many transactions wrote the page's facts (each stamps its rows with its own now())."""
    with factory() as session:
        return int(
            session.scalar(
                select(func.count(func.distinct(Fact.created_at))).where(
                    Fact.source == PER_SEGMENT_SOURCE_PREFIX, Fact.source_markdown_slug == slug
                )
            )
            or 0
        )


def test_segments_ready_together_commit_in_one_transaction_exactly_once(factory, simulator, server_url):
    slug = "conversations/batched"
    pages = {slug: conversation(11, segments=8)}
    put_pages(factory, pages)
    llm = Scripted(simulator, segments=8)
    pipe = LLMPipe(8)
    try:
        counters = run_extract_conversation_facts(
            factory, llm, ExtractOptions(slug=slug, override_disabled=True), pipe=pipe
        )
    finally:
        pipe.close()
    assert llm.held, "segment 0 should have waited for the other seven calls"
    assert (counters.pages_processed, counters.segments_processed) == (1, 8)
    assert transactions(factory, slug) == 1  # the eight segments and the checkpoint, together
    assert fact_rows(factory) == expected_facts(server_url, pages, simulator)
    with factory() as session:
        checkpoint = session.scalars(select(OpCheckpoint)).one()
        outcomes = list(session.scalars(select(ExtractionAudit.outcome)))
    assert checkpoint.messages_done == 24 and checkpoint.next_row_num == len(fact_rows(factory))
    assert outcomes == ["ok"] * 8


def test_a_failure_inside_a_ready_run_commits_what_came_before_and_resumes_exactly_once(
    factory, simulator, server_url
):
    slug = "conversations/fails-at-3"
    pages = {slug: conversation(12, segments=8)}
    put_pages(factory, pages)
    pipe = LLMPipe(8)
    options = ExtractOptions(slug=slug, override_disabled=True)
    try:
        failed = run_extract_conversation_facts(factory, Scripted(simulator, 8, fail=3), options, pipe=pipe)
        assert (failed.pages_failed, failed.segments_processed) == (1, 3)
        with factory() as session:
            checkpoint = session.scalars(select(OpCheckpoint)).one()
            audit = list(session.execute(select(ExtractionAudit.outcome, ExtractionAudit.error)))
        assert checkpoint.messages_done == 9  # past segments 0-2 (three messages each)
        assert sorted(outcome for outcome, _ in audit) == ["ok"] * 3 + ["ok"] * 4 + ["provider_error"]
        # The four results after the failure were paid for: recorded, their facts discarded.
        assert sum("discarded" in (error or "") for _, error in audit) == 4
        resumed = run_extract_conversation_facts(factory, Scripted(simulator, 5), options, pipe=pipe)
    finally:
        pipe.close()
    assert (resumed.pages_processed, resumed.segments_processed) == (1, 5)
    assert fact_rows(factory) == expected_facts(server_url, pages, simulator)


def test_pages_of_several_jobs_share_one_pipe_and_each_commits_exactly_once(factory, simulator, server_url):
    pages = {f"conversations/shared-{n}": conversation(20 + n, segments=6 + n) for n in range(6)}
    put_pages(factory, pages)
    llm = OpenAIChatClient(model="simulator-1", base_url=simulator.base_url, provider="simulator")
    pipe = LLMPipe(5)  # fewer slots than pages: they wait for each other's calls
    errors: list[BaseException] = []

    def job(slug: str) -> None:
        try:
            counters = run_extract_conversation_facts(
                factory, llm, ExtractOptions(slug=slug, override_disabled=True), pipe=pipe
            )
            assert counters.pages_processed == 1, counters.as_dict()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=job, args=(slug,)) for slug in pages]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT * 4)
    pipe.close()
    assert not errors, errors
    assert fact_rows(factory) == expected_facts(server_url, pages, simulator)
    with factory() as session:
        assert session.scalar(select(func.count()).select_from(Fact).where(Fact.is_audit)) == len(pages)


def test_a_run_whose_lease_lapsed_commits_nothing_more_and_keeps_the_spend(factory, simulator) -> None:
    """The lease was checked on the pipe's threads before calls only: a worker whose lease lapsed went
    on committing every result it held, and the worker that had taken the job over met a checkpoint
    conflict, spending an attempt and its own paid window. Checked before each commit now; what was
    paid for and not committed is still recorded."""
    from models import LLMCall
    from worker.accounting import Budget, Ledger
    from worker.config_store import ConfigReader
    from worker.extraction.service import extract_conversation_facts
    from worker.extraction.store import ExtractionStore
    from worker.jobs.leases import LeaseLostError

    slug = "conversations/lapsed"
    put_pages(factory, {slug: conversation(12, segments=4)})
    llm = OpenAIChatClient(model="simulator-1", base_url=simulator.base_url, provider="simulator")
    checks: list[int] = []

    def lease() -> None:
        checks.append(1)
        if len(checks) > 1:
            raise LeaseLostError("the job's lease lapsed")

    config = ConfigReader(factory, ttl=0)
    options = ExtractOptions(slug=slug, override_disabled=True, segment_concurrency=1)
    store = ExtractionStore(factory, Ledger(config.get))
    with pytest.raises(LeaseLostError):
        extract_conversation_facts(store, llm, options, config, Budget(factory, config.get), lease=lease)
    with factory() as session:
        checkpoint = session.scalars(select(OpCheckpoint)).one()
        calls = session.scalar(select(func.count()).select_from(LLMCall))
    assert checkpoint.messages_done == 3  # the first segment's commit, and nothing after the lapse
    assert calls == 2  # the second segment was paid for: its call is recorded

    # A whole-page swap (--force, an edited page) swaps nothing in once the lease lapsed.
    extract_conversation_facts(store, llm, options, config, Budget(factory, config.get))  # the rest
    with factory() as session:
        before = sorted(session.scalars(select(Fact.id).where(Fact.source_markdown_slug == slug)))
        calls = session.scalar(select(func.count()).select_from(LLMCall))

    def lapsed() -> None:
        raise LeaseLostError("the job's lease lapsed")

    forced = ExtractOptions(slug=slug, override_disabled=True, force=True)
    with pytest.raises(LeaseLostError):
        extract_conversation_facts(store, llm, forced, config, Budget(factory, config.get), lease=lapsed)
    with factory() as session:
        after = sorted(session.scalars(select(Fact.id).where(Fact.source_markdown_slug == slug)))
        paid = session.scalar(select(func.count()).select_from(LLMCall))
    assert before and after == before  # the page's facts as they were
    assert paid == calls + 4  # the four segments' calls of the swap that never happened, recorded
