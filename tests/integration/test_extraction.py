"""Extraction runs against a real Postgres and the LLM simulator through the real openai SDK."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import httpx
import pytest
from pydantic import ValidationError
from sqlalchemy import func, select, text
from sqlalchemy.orm import Session, sessionmaker

from models import ExtractionAudit, Fact, Job, LLMCall, OpCheckpoint, Page
from tests.integration.test_hostile_input import letters
from worker.config_store import set_config
from worker.consolidation.operators import entity_timeline
from worker.core.conversation import MAX_PAGE_BODY_BYTES
from worker.extraction import (
    OP_NAME,
    PER_SEGMENT_SOURCE_PREFIX,
    TERMINAL_AUDIT_SOURCE,
    ExtractionDisabledError,
    ExtractOptions,
    NoProgress,
    PageIn,
    decode_checkpoint_entry,
    extract_conversation_facts_fingerprint,
    run_extract_conversation_facts,
    upsert_page,
)
from worker.extraction.erase import erase_page
from worker.extraction.facts import read_entity_facts
from worker.extraction.options import CheckpointConflictError
from worker.extraction.pages import MAX_PAGE_KEY_BYTES, page_key_bytes
from worker.extraction.rows import HELD_NOTE
from worker.llm.openai_compat import OpenAIChatClient
from worker.search import SearchError, SearchFilters

pytestmark = pytest.mark.integration

SLUG = "conversations/imessage/alice-example"


def fmt(name: str, date: str, time: str, body: str) -> str:
    return f"**{name}** ({date} {time}): {body}"


SAMPLE_LINES = [
    fmt("Alice Example", "2024-03-15", "9:00 AM", "Hi, I just signed the offer letter for Acme Corp."),
    fmt("Bob Demo", "2024-03-15", "9:01 AM", "Congrats! What's the title?"),
    fmt("Alice Example", "2024-03-15", "9:02 AM", "Staff engineer on the platform team."),
    fmt("Bob Demo", "2024-03-15", "9:03 AM", "Nice."),
    # Big time gap → new segment.
    fmt("Alice Example", "2024-03-16", "8:00 AM", "Update: I started at Acme Corp this morning."),
    fmt("Bob Demo", "2024-03-16", "8:05 AM", "Day one! How is it?"),
]
SAMPLE_BODY = "\n".join(SAMPLE_LINES)


def put_page(
    factory: sessionmaker[Session],
    slug: str = SLUG,
    body: str = SAMPLE_BODY,
    type: str = "conversation",
    title: str = "iMessage: Alice Example",
    source_id: str = "default",
) -> int:
    with factory.begin() as session:
        return upsert_page(
            session, PageIn(source_id=source_id, slug=slug, type=type, title=title, compiled_truth=body)
        ).page_id


@pytest.fixture
def pages(tx_factory: sessionmaker[Session]) -> sessionmaker[Session]:
    with tx_factory.begin() as session:
        set_config(session, "facts.extraction_enabled", "true")
    put_page(tx_factory)
    put_page(
        tx_factory,
        "people/alice-example",
        "Profile content for Alice Example.",
        type="person",
        title="Alice Example",
    )
    return tx_factory


@pytest.fixture
def llm(simulator: Any) -> OpenAIChatClient:
    return OpenAIChatClient(model="simulator-1", base_url=simulator.base_url, provider="simulator")


def faulty_llm(simulator: Any, fault: str) -> OpenAIChatClient:
    return OpenAIChatClient(
        model="simulator-1",
        base_url=simulator.base_url,
        provider="simulator",
        default_headers={"x-simulator-fault": fault},
    )


def run(factory: sessionmaker[Session], llm: Any, **kwargs: Any):  # type: ignore[no-untyped-def]
    return run_extract_conversation_facts(factory, llm, ExtractOptions(**{"slug": SLUG, **kwargs}))


def count(factory: sessionmaker[Session], model: Any, *where: Any) -> int:
    with factory() as session:
        return int(session.scalar(select(func.count()).select_from(model).where(*where)) or 0)


def page_facts(factory: sessionmaker[Session], slug: str = SLUG) -> list[Fact]:
    with factory() as session:
        return list(
            session.scalars(
                select(Fact)
                .where(Fact.source == PER_SEGMENT_SOURCE_PREFIX, Fact.source_markdown_slug == slug)
                .order_by(Fact.row_num)
            )
        )


def terminal_rows(factory: sessionmaker[Session], slug: str = SLUG) -> int:
    return count(
        factory,
        Fact,
        Fact.source == TERMINAL_AUDIT_SOURCE,
        Fact.source_session == f"{TERMINAL_AUDIT_SOURCE}:{slug}",
    )


def sim_requests(simulator: Any) -> int:
    return int(simulator.stats()["requests_total"])


# ---------------------------------------------------------------------------
# Seed twins: runExtractConversationFactsCore.
# ---------------------------------------------------------------------------


def test_dry_run_reports_segmentation_without_writing_facts(pages, llm, simulator):
    before = sim_requests(simulator)
    result = run(pages, llm, dry_run=True)
    assert result.pages_considered == 1
    assert result.pages_processed == 1
    assert result.facts_inserted == 0
    assert result.segments_processed == 2
    # Better than the original: a dry run makes no LLM call and writes nothing at all.
    assert sim_requests(simulator) == before
    assert result.llm_calls == 0
    for model in (Fact, ExtractionAudit, LLMCall, OpCheckpoint):
        assert count(pages, model) == 0


def test_non_conversation_pages_are_skipped(pages, llm):
    result = run_extract_conversation_facts(
        pages, llm, ExtractOptions(slug="people/alice-example", dry_run=True)
    )
    assert result.pages_considered == 0


def test_since_iso_filters_already_processed_history(pages, llm):
    result = run(pages, llm, dry_run=True, since_iso="2099-01-01T00:00:00Z")
    assert result.pages_processed == 0
    assert result.pages_skipped == 1


def test_a_since_run_sends_a_late_reply_the_last_run_left_alone(pages, llm, simulator):
    """A reply appended to an extracted conversation, then a new conversation the next day: a run with
    --since dropped the reply for being alone (only a run without --since joined it to the first new
    segment) and moved the checkpoint past it, so no run ever sent it."""
    run(pages, llm)
    late = fmt("Bob Demo", "2024-03-16", "8:20 AM", "Also: my sister Zebedee moves to Oslo in May.")
    next_day = [
        fmt("Alice Example", "2024-03-17", "9:00 AM", "Lunch on Friday?"),
        fmt("Bob Demo", "2024-03-17", "9:02 AM", "Sure, noon works."),
    ]
    put_page(pages, body="\n".join([*SAMPLE_LINES, late, *next_day]))
    run(pages, llm, since_iso="2024-03-01T00:00:00Z")
    logged = httpx.get(f"{simulator.url}/_simulator/requests").json()["requests"]
    assert any("Zebedee" in json.dumps(request) for request in logged[-2:]), "the late reply was sent"
    # Extracted to its end, the page has nothing new (and nothing after the checkpoint to join).
    again = run(pages, llm, since_iso="2024-03-01T00:00:00Z")
    assert again.pages[0].status == "skipped" and "nothing new" in again.pages[0].reason


def test_writes_facts_with_per_segment_source_session_and_terminal_audit_row(pages, llm):
    result = run(pages, llm)
    assert result.pages_processed == 1
    assert result.facts_inserted > 0
    assert (
        count(
            pages,
            Fact,
            Fact.source == PER_SEGMENT_SOURCE_PREFIX,
            Fact.source_session == f"{PER_SEGMENT_SOURCE_PREFIX}:{SLUG}",
        )
        > 0
    )
    assert terminal_rows(pages) == 1


def test_people_named_in_any_script_are_distinct_entities(pages, llm):
    """Entity slugs were ASCII-only: every name in Chinese became the one entity "people", and
    Zoë Ångström people/zo-ngstr-m. Readers take a name in the slug rule's form too."""
    slug = "conversations/imessage/li-lei-and-zoe"
    lines = [
        fmt("李雷", "2024-03-15", "9:00 AM", "I prefer running in the morning."),
        fmt("韩梅梅", "2024-03-15", "9:01 AM", "I moved to Lisbon last month."),
        fmt("Zoë Ångström", "2024-03-15", "9:02 AM", "I prefer tea over coffee."),
    ]
    put_page(pages, slug, "\n".join(lines), title="three friends")
    run(pages, llm, slug=slug)
    with pages() as session:
        entities = set(session.scalars(select(Fact.entity_slug).where(Fact.source_markdown_slug == slug)))
        assert {"people/李雷", "people/韩梅梅", "people/zoë-ångström"} <= entities, entities
        assert "people" not in entities
        found = read_entity_facts(session, "People/Zoë Ångström")
        assert found.entity == "people/zoë-ångström" and found.total >= 1
        assert [e.fact for e in entity_timeline(session, "people/Zoe\u0308 A\u030angstro\u0308m")] == [
            f.fact for f in reversed(found.facts)
        ]
    assert SearchFilters(entity="People/李雷").entity == "people/李雷"
    with pytest.raises(SearchError, match="has no letters or digits"):
        SearchFilters(entity="!?")


def test_fact_listings_read_no_vectors(pages, llm):
    """A page's or an entity's facts read each fact's 256-float vector and threw it away (2.6 s of CPU
    for a page of 10,000 facts)."""
    from sqlalchemy import event

    from worker.extraction.facts import read_page_facts

    run(pages, llm)
    with pages() as session:
        statements: list[str] = []

        def seen(*args: Any) -> None:
            statements.append(args[2])

        connection = session.connection()
        event.listen(connection, "before_cursor_execute", seen)
        listed = read_page_facts(session, "default", SLUG)
        entity = read_entity_facts(session, listed.facts[0].entity_slug or "alice")
        event.remove(connection, "before_cursor_execute", seen)
    assert listed.total >= 1 and entity.total >= 1
    reads = [sql for sql in statements if "FROM facts" in sql]
    unshown = re.compile(r"facts\.(embedding|search_vector)\b")
    assert len(reads) >= 2 and not any(unshown.search(sql) for sql in reads), reads


def test_row_num_accumulator_segment_2_facts_start_after_segment_1(pages, llm):
    run(pages, llm)
    facts = page_facts(pages)
    nums = [f.row_num for f in facts]
    assert nums == list(range(len(nums)))
    # Both segments contributed, so the accumulator really crossed a segment boundary.
    assert len({f.context for f in facts}) == 2


def test_force_clears_resume_entry_allowing_re_run(pages, llm):
    first = run(pages, llm)
    assert first.pages_processed == 1
    second = run(pages, llm)
    assert second.pages_skipped == 1
    third = run(pages, llm, force=True)
    assert third.pages_processed == 1
    assert third.segments_processed >= 1


def test_honors_facts_extraction_enabled_kill_switch(pages, llm, simulator):
    with pages.begin() as session:
        set_config(session, "facts.extraction_enabled", "false")
    before = sim_requests(simulator)
    with pytest.raises(ExtractionDisabledError, match=r"extraction_enabled=false") as info:
        run(pages, llm)
    assert "override" in str(info.value)
    assert sim_requests(simulator) == before


def run_switching_off_during_the_first_call(pages: Any, llm: Any) -> None:
    """Extract SLUG; the guard turns the kill switch off while the first call is made."""
    from worker.config_store import ConfigReader

    asked: list[int] = []

    def switch_off_during_the_first_call() -> None:
        asked.append(1)
        if len(asked) == 1:
            with pages.begin() as session:
                set_config(session, "facts.extraction_enabled", "false")

    with pytest.raises(ExtractionDisabledError):
        run_extract_conversation_facts(
            pages,
            llm,
            ExtractOptions(slug=SLUG),
            config=ConfigReader(pages, ttl=0),
            guard=switch_off_during_the_first_call,
        )


def test_the_kill_switch_is_read_before_every_attempt_of_a_segment(pages, sim):
    """Read before a segment's first attempt only: a malformed first reply was followed by up to three
    paid retries and repair turns (the segment's whole text again) after the switch went off."""
    sim.configure(rate_malformed=1.0)  # every reply needs the repair turn
    llm = OpenAIChatClient(model="simulator-1", base_url=sim.base_url, provider="simulator")
    run_switching_off_during_the_first_call(pages, llm)
    assert sim_requests(sim) == 1, "no attempt after the switch went off"
    assert count(pages, ExtractionAudit) >= 1, "the paid attempt is recorded"


def test_the_kill_switch_is_read_between_the_gateways_tries_of_one_call(pages, sim):
    """Read before each attempt only: under it the retry layer went on trying one call for minutes (five
    tries, two minutes of backoff) after the switch went off during a provider's incident, when it is
    used. The try made before it is recorded."""
    from worker.llm.retry import RetryingClient, RetryPolicy

    sim.configure(rate_500=1.0)  # every try fails, and is retried
    provider = OpenAIChatClient(model="simulator-1", base_url=sim.base_url, provider="simulator")
    llm = RetryingClient(provider, RetryPolicy(max_attempts=5), sleep=lambda seconds: None)
    run_switching_off_during_the_first_call(pages, llm)
    assert sim_requests(sim) == 1, "no try after the switch went off"
    with pages() as session:
        assert session.scalars(select(LLMCall.outcome)).all() == ["provider_error"], "the try is recorded"


def test_a_sigterm_between_a_segments_attempts_keeps_the_paid_one(sim) -> None:
    """A SIGTERM is raised as SystemExit, no Exception: between a segment's attempts it escaped with the
    paid first attempt in a local list, and no row recorded it."""
    from worker.extraction.segments import SegmentAbortedError, extract_segment

    sim.configure(rate_malformed=1.0)  # the first reply needs the repair turn
    llm = OpenAIChatClient(model="simulator-1", base_url=sim.base_url, provider="simulator")
    asked: list[int] = []

    def terminated_after_the_first() -> None:
        asked.append(1)
        if len(asked) > 1:
            raise SystemExit(143)

    with pytest.raises(SegmentAbortedError) as aborted:
        extract_segment(
            llm, "**A** (2024-01-01 9:00 AM): hi", 10, 1024, before_call=terminated_after_the_first
        )
    assert isinstance(aborted.value.cause, SystemExit)
    assert [a.outcome for a in aborted.value.attempts] == ["malformed_output"]


def test_a_stopping_worker_finishes_the_segment_it_began_paying_for(pages, sim):
    """Stopping is checked at segment boundaries: between a segment's attempts it threw the paid first
    attempt away, and the next worker paid for the whole segment again."""
    from worker.jobs.shutdown import WorkerStoppingError

    sim.configure(rate_malformed=1.0)  # the first reply needs the repair turn
    llm = OpenAIChatClient(model="simulator-1", base_url=sim.base_url, provider="simulator")
    asked: list[int] = []

    def stopping_after_the_first_call() -> None:
        asked.append(1)
        if len(asked) > 1:
            raise WorkerStoppingError("the worker is stopping")

    run_extract_conversation_facts(pages, llm, ExtractOptions(slug=SLUG), guard=stopping_after_the_first_call)
    assert sim_requests(sim) == 2, "the repair turn of the segment begun was still asked"


def test_a_refusal_s_words_stay_out_of_the_page_s_failure_reason(pages, sim):
    """The reason (jobs.last_error for a page job) quoted the model's refusal, which can paraphrase the
    page, and no erasure of the page reads last_error; the audit rows keep it, and go with the page."""
    sim.configure(rate_refusal=1.0)
    llm = OpenAIChatClient(model="simulator-1", base_url=sim.base_url, provider="simulator")
    [report] = run(pages, llm).pages
    assert report.status == "failed" and report.reason.startswith("segment 1: refusal (permanent failure 1;")
    assert "simulated refusal" not in report.reason
    with pages() as session:
        kept = (
            session.scalars(select(ExtractionAudit.error)).all()
            + session.scalars(select(ExtractionAudit.reply)).all()
        )
    assert any("simulated refusal" in (text or "") for text in kept), "the audit row keeps it"


def test_a_database_error_holding_a_forced_run_s_result_keeps_the_batch_s_spend(
    pages, sim, monkeypatch: pytest.MonkeyPatch
):
    """On the whole-page path one failed hold (a deadlock, a timeout) raised with the rest of the batch
    taken from the feed and paid for, and nothing recorded its calls: the budgets counted low."""
    from sqlalchemy.exc import OperationalError

    from worker.extraction.store import ExtractionStore

    llm = OpenAIChatClient(model="simulator-1", base_url=sim.base_url, provider="simulator")
    real_hold = ExtractionStore.hold_attempts
    holds: list[int] = []

    def fails_once(self: Any, *args: Any, **kwargs: Any) -> None:
        holds.append(1)
        if len(holds) == 1:
            raise OperationalError("INSERT ...", {}, Exception("deadlock detected (the test's)"))
        real_hold(self, *args, **kwargs)

    monkeypatch.setattr(ExtractionStore, "hold_attempts", fails_once)
    with pytest.raises(OperationalError):
        run(pages, llm, force=True, segment_concurrency=2)  # two segments, one batch
    assert sim_requests(sim) == 2
    assert count(pages, LLMCall) == 2, "both paid calls are recorded"


def test_a_sigterm_inside_a_commit_keeps_the_batch_s_spend(pages, sim, monkeypatch: pytest.MonkeyPatch):
    """A SIGTERM (SystemExit) landing in a commit rolled it back, and only an Exception had its calls
    recorded: the committer counts every segment handed to the store as kept, so a batch of paid calls
    went unrecorded and the budgets counted low."""
    from worker.extraction.store import ExtractionStore

    llm = OpenAIChatClient(model="simulator-1", base_url=sim.base_url, provider="simulator")

    def stopped(self: Any, *args: Any, **kwargs: Any) -> None:
        raise SystemExit(143)

    monkeypatch.setattr(ExtractionStore, "_advance_checkpoint", stopped)
    with pytest.raises(SystemExit):
        run(pages, llm)
    assert sim_requests(sim) >= 1
    assert count(pages, LLMCall) == sim_requests(sim), "each paid call is recorded"
    assert count(pages, Fact) == 0


def test_a_sigterm_after_a_commit_records_its_calls_once(pages, sim, monkeypatch: pytest.MonkeyPatch):
    """A signal handled once the batch's COMMIT returned: the rows are stored, so its spend is not
    recorded a second time (the budgets counted high)."""
    from sqlalchemy import event
    from sqlalchemy.orm import Session as OrmSession

    llm = OpenAIChatClient(model="simulator-1", base_url=sim.base_url, provider="simulator")

    def stopped_after(session: Any) -> None:
        raise SystemExit(143)

    event.listen(OrmSession, "after_commit", stopped_after)
    try:
        with pytest.raises(SystemExit):
            run(pages, llm)
    finally:
        event.remove(OrmSession, "after_commit", stopped_after)
    assert count(pages, LLMCall) == sim_requests(sim) >= 1


def test_a_commit_whose_commit_call_failed_after_committing_records_its_calls_once(
    pages, sim, monkeypatch: pytest.MonkeyPatch
):
    """The connection dropped as the COMMIT ran, after the server had committed: the failed commit's
    spend was recorded again (the budgets counted it twice). Its own llm_calls row says it committed."""
    from sqlalchemy import event
    from sqlalchemy.exc import OperationalError
    from sqlalchemy.orm import Session as OrmSession

    from worker.extraction.store import ExtractionStore

    llm = OpenAIChatClient(model="simulator-1", base_url=sim.base_url, provider="simulator")
    advance = ExtractionStore._advance_checkpoint
    failed: list[bool] = []

    def marked(self: Any, session: Any, *args: Any) -> None:
        session.info["moves_checkpoint"] = True
        advance(self, session, *args)

    def dropped_after(session: Any) -> None:
        if not failed and session.info.pop("moves_checkpoint", False):
            failed.append(True)
            raise OperationalError("COMMIT", {}, Exception("server closed the connection unexpectedly"))

    monkeypatch.setattr(ExtractionStore, "_advance_checkpoint", marked)
    event.listen(OrmSession, "after_commit", dropped_after)
    try:
        with contextlib.suppress(Exception):  # the page failed: its spend is what is checked
            run(pages, llm)
    finally:
        event.remove(OrmSession, "after_commit", dropped_after)
    assert failed, "a segment's commit ran"
    assert count(pages, LLMCall) == sim_requests(sim), "each paid call is recorded once"


def test_override_disabled_bypasses_kill_switch(pages, llm):
    with pages.begin() as session:
        set_config(session, "facts.extraction_enabled", "false")
    result = run(pages, llm, override_disabled=True)
    assert result.pages_processed == 1


# ---------------------------------------------------------------------------
# Beyond the seed.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["0", "no", "OFF", " False "])
def test_every_disabled_spelling_stops_the_run(pages, llm, value):
    with pages.begin() as session:
        session.execute(
            text("UPDATE config SET value = :v WHERE key = 'facts.extraction_enabled'"), {"v": value}
        )
    with pytest.raises(ExtractionDisabledError):
        run(pages, llm)


def test_missing_kill_switch_means_enabled(tx_factory, llm):
    put_page(tx_factory)
    assert run(tx_factory, llm).pages_processed == 1


def test_page_types_considered_and_narrowed_by_config(tx_factory, llm):
    for page_type in ("conversation", "meeting", "slack", "email", "imessage", "person", "note"):
        put_page(tx_factory, f"p/{page_type}", type=page_type)
    all_types = run_extract_conversation_facts(tx_factory, llm, ExtractOptions(dry_run=True))
    assert all_types.pages_considered == 5
    with tx_factory.begin() as session:
        set_config(session, "extraction.page_types", "slack, email")
    narrowed = run_extract_conversation_facts(tx_factory, llm, ExtractOptions(dry_run=True))
    assert narrowed.pages_considered == 2
    assert sorted(p.slug for p in narrowed.pages) == ["p/email", "p/slack"]


def test_fact_rows_carry_provenance(pages, llm):
    run(pages, llm)
    facts = page_facts(pages)
    assert facts
    for fact in facts:
        assert fact.source_session == f"{PER_SEGMENT_SOURCE_PREFIX}:{SLUG}"
        assert fact.source_markdown_slug == SLUG
        assert fact.source_id == "default"
        assert fact.is_audit is False
        assert fact.kind in ("event", "preference", "commitment", "belief", "fact")
        assert 0.0 <= fact.confidence <= 1.0
    contexts = sorted({f.context for f in facts})
    assert contexts == [
        "conversation segment 2024-03-15T09:00:00Z to 2024-03-15T09:03:00Z",
        "conversation segment 2024-03-16T08:00:00Z to 2024-03-16T08:05:00Z",
    ]


def test_each_segment_commits_audit_llm_call_and_checkpoint_together(pages, llm):
    result = run(pages, llm)
    with pages() as session:
        audits = list(session.scalars(select(ExtractionAudit).order_by(ExtractionAudit.id)))
        calls = {c.id: c for c in session.scalars(select(LLMCall))}
        checkpoint = session.scalars(select(OpCheckpoint)).one()
    assert [a.outcome for a in audits] == ["ok", "ok"]
    assert [a.segment_start for a in audits] == ["2024-03-15T09:00:00Z", "2024-03-16T08:00:00Z"]
    assert sum(a.facts_count for a in audits) == result.facts_inserted
    for audit in audits:
        call = calls[audit.llm_call_id]
        assert (call.outcome, call.purpose, call.provider) == ("ok", "extraction", "simulator")
        assert call.input_tokens > 0 and call.output_tokens > 0
    assert result.llm_calls == 2
    assert result.input_tokens == sum(c.input_tokens for c in calls.values())
    assert checkpoint.op == OP_NAME
    assert checkpoint.fingerprint == extract_conversation_facts_fingerprint("default")
    entry = decode_checkpoint_entry(checkpoint.completed_key)
    assert entry is not None
    assert (entry.source_id, entry.slug, entry.end_iso) == ("default", SLUG, "2024-03-16T08:05:00Z")


@contextmanager
def first_facts_insert_fails(factory: sessionmaker[Session]) -> Iterator[list[str]]:
    """The first INSERT INTO facts on the factory's engine raises (a connection dropped mid-commit);
    yields the statements it refused."""
    from sqlalchemy import event

    engine = factory.kw["bind"].engine
    failed: list[str] = []

    def fail_once(conn, cursor, statement, parameters, context, executemany):  # type: ignore[no-untyped-def]
        if statement.startswith("INSERT INTO facts") and not failed:
            failed.append(statement)
            raise RuntimeError("the connection dropped mid-commit")

    event.listen(engine, "before_cursor_execute", fail_once)
    try:
        yield failed
    finally:
        event.remove(engine, "before_cursor_execute", fail_once)


def test_a_commit_that_fails_keeps_the_spend_of_its_segments(pages, llm, simulator):
    # A deadlock, a statement timeout or a dropped connection mid-commit rolled back the llm_calls rows
    # of every segment of the group with the facts: the budgets counted low and the retry paid again.
    asked_before = simulator.stats()["by_route"].get("chat.completions", 0)
    with first_facts_insert_fails(pages) as failed, pytest.raises(RuntimeError, match="dropped mid-commit"):
        run(pages, llm)
    asked = simulator.stats()["by_route"].get("chat.completions", 0) - asked_before
    with pages() as session:
        calls = session.scalar(
            select(func.count()).select_from(LLMCall).where(LLMCall.purpose == "extraction")
        )
        facts = session.scalar(select(func.count()).select_from(Fact))
    assert failed and facts == 0 and asked >= 1
    assert calls == asked, "every call was paid for: recorded though no fact was committed"


def test_a_failed_commit_keeps_the_spend_of_the_results_ready_beside_it(tx_factory):
    # Two results ready together, the second refused (it ends the page); the first one's commit fails.
    # The store keeps the spend it was given; the refused result, paid for too, was never handed to
    # it and was lost (only a checkpoint conflict kept such results).

    from worker.accounting import Ledger
    from worker.config_store import ConfigReader
    from worker.core.facts import ExtractedFact
    from worker.extraction import ExtractOptions
    from worker.extraction.committer import SegmentCommitter
    from worker.extraction.options import ExtractionCounters, NoProgress
    from worker.extraction.planner import PagePlan, PagePlanner
    from worker.extraction.segments import Attempt, SegmentResult
    from worker.extraction.store import ExtractionStore
    from worker.llm.types import ChatResponse, Usage

    put_page(tx_factory)
    store = ExtractionStore(tx_factory, Ledger(ConfigReader(tx_factory, ttl=0).get))
    planner = PagePlanner(store, ExtractOptions(slug=SLUG), ConfigReader(tx_factory, ttl=0))
    plan = planner.plan(planner.pages()[0])
    assert isinstance(plan, PagePlan) and len(plan.segments) == 2
    reply = ChatResponse("{}", "end", Usage(input_tokens=100, output_tokens=10), "p", "m", 5)
    fact = ExtractedFact("Alice signed with Acme.", "event", "alice", 0.9, "high")
    results = [
        (0, plan.segments[0], SegmentResult([Attempt.of(reply, "ok", facts=[fact])])),
        (1, plan.segments[1], SegmentResult([Attempt.of(replace(reply, finish="refusal"), "refusal")], True)),
    ]
    committer = SegmentCommitter(store, planner, ExtractionCounters(), NoProgress(), 3)
    with first_facts_insert_fails(tx_factory) as failed, pytest.raises(RuntimeError, match="mid-commit"):
        committer.commit_page(plan, (batch for batch in [results]))
    assert failed and count(tx_factory, Fact) == 0
    assert count(tx_factory, LLMCall) == 2, "both results were paid for"


def test_second_run_with_nothing_new_skips_and_calls_nothing(pages, llm, simulator):
    run(pages, llm)
    before_facts = [(f.row_num, f.fact) for f in page_facts(pages)]
    before = sim_requests(simulator)
    again = run(pages, llm)
    assert again.pages_skipped == 1 and again.pages_processed == 0
    assert sim_requests(simulator) == before
    assert [(f.row_num, f.fact) for f in page_facts(pages)] == before_facts


def test_appended_messages_extract_only_the_new_segments(pages, llm):
    run(pages, llm)
    before = page_facts(pages)
    appended = [
        *SAMPLE_LINES,
        fmt("Alice Example", "2024-03-20", "7:00 PM", "I moved to Lisbon last weekend."),
        fmt("Bob Demo", "2024-03-20", "7:02 PM", "I love Lisbon, I will visit you in May."),
    ]
    put_page(pages, body="\n".join(appended))
    result = run(pages, llm)
    assert (result.pages_processed, result.segments_processed, result.llm_calls) == (1, 1, 1)
    after = page_facts(pages)
    assert [(f.row_num, f.fact) for f in after[: len(before)]] == [(f.row_num, f.fact) for f in before]
    assert [f.row_num for f in after] == list(range(len(after)))
    assert len(after) > len(before)
    assert terminal_rows(pages) == 1


def test_an_extracted_page_whose_first_appended_segment_fails_is_no_longer_marked_complete(
    pages, llm, simulator
):
    run(pages, llm)
    assert terminal_rows(pages) == 1
    appended = [
        *SAMPLE_LINES,
        fmt("Alice Example", "2024-03-20", "7:00 PM", "I moved to Lisbon last weekend."),
        fmt("Bob Demo", "2024-03-20", "7:02 PM", "I love Lisbon, I will visit you in May."),
    ]
    put_page(pages, body="\n".join(appended))
    assert run(pages, faulty_llm(simulator, "500")).pages_failed == 1
    assert terminal_rows(pages) == 0  # before: the page was still marked extracted to its end
    assert run(pages, llm).segments_processed == 1 and terminal_rows(pages) == 1


def test_trailing_single_message_is_picked_up_once_it_has_company(pages, llm):
    lone = [*SAMPLE_LINES, fmt("Alice Example", "2024-03-20", "7:00 PM", "I moved to Lisbon.")]
    put_page(pages, body="\n".join(lone))
    run(pages, llm)
    put_page(pages, body="\n".join([*lone, fmt("Bob Demo", "2024-03-20", "7:01 PM", "Great, I will visit.")]))
    result = run(pages, llm)
    assert result.segments_processed == 1
    assert any("Lisbon" in f.fact for f in page_facts(pages))


def test_a_conversation_s_last_message_appended_alone_is_sent_with_the_next_segment(pages, llm):
    """Its segment was extracted before it came; alone after the checkpoint it was dropped (too few), and
    the run that extracted the next conversation (after a gap) moved the checkpoint past it: no run
    ever sent it. A full run has it in its conversation's segment."""
    lines = [*SAMPLE_LINES]
    run(pages, llm)
    lines.append(fmt("Bob Demo", "2024-03-16", "8:10 AM", "PS: I am moving to Berlin on June 1."))
    put_page(pages, body="\n".join(lines))
    assert run(pages, llm).segments_processed == 0  # alone: it waits
    lines += [
        fmt("Alice Example", "2024-03-20", "7:00 PM", "Dinner on Friday?"),
        fmt("Bob Demo", "2024-03-20", "7:02 PM", "Yes, at eight."),
    ]
    put_page(pages, body="\n".join(lines))
    result = run(pages, llm)
    assert result.segments_processed == 1
    assert any("Berlin" in f.fact for f in page_facts(pages))
    assert run(pages, llm).segments_processed == 0 and terminal_rows(pages) == 1


def test_edit_to_extracted_messages_re_extracts_the_page(pages, llm):
    run(pages, llm)
    edited = [SAMPLE_LINES[0].replace("Acme Corp", "Globex Inc"), *SAMPLE_LINES[1:]]
    put_page(pages, body="\n".join(edited))
    result = run(pages, llm)
    assert (result.pages_processed, result.segments_processed) == (1, 2)
    facts = page_facts(pages)
    assert [f.row_num for f in facts] == list(range(len(facts)))
    assert any("Globex" in f.fact for f in facts)
    assert not any("signed the offer letter for Acme" in f.fact for f in facts)
    assert terminal_rows(pages) == 1


def test_an_edited_page_is_re_extracted_whole_under_since(pages, llm):
    """Its facts are replaced whole: narrowed by since, the replacement deleted the first day's facts
    and moved the checkpoint past them, so no later run brought them back."""
    run(pages, llm)
    edited = [*SAMPLE_LINES[:-1], SAMPLE_LINES[-1].replace("Day one!", "Day one at Acme!")]
    edited[0] = edited[0].replace("offer letter", "offer")
    put_page(pages, body="\n".join(edited))
    result = run(pages, llm, since_iso="2024-03-15T23:00:00Z")
    assert (result.pages_processed, result.segments_processed) == (1, 2)
    assert any(f.valid_from and f.valid_from.day == 15 for f in page_facts(pages))


def test_since_and_force_together_are_refused(pages, llm):
    """A forced run replaces the page's facts with what it extracts: narrowed by since, that deleted
    every fact from before since."""
    run(pages, llm)
    before = len(page_facts(pages))
    with pytest.raises(ValueError, match="cannot be combined"):
        run(pages, llm, force=True, since_iso="2024-03-15T23:00:00Z")
    assert len(page_facts(pages)) == before


def test_force_yields_the_same_facts_without_duplicates(pages, llm):
    run(pages, llm)
    first = [(f.row_num, f.fact, f.kind, f.context) for f in page_facts(pages)]
    with pages() as session:
        before = session.scalar(select(func.max(ExtractionAudit.id)))
    result = run(pages, llm, force=True)
    assert result.facts_inserted == len(first)
    assert [(f.row_num, f.fact, f.kind, f.context) for f in page_facts(pages)] == first
    assert terminal_rows(pages) == 1
    # A re-extraction's rows are written as each segment is held, before the swap that may not come: as
    # "ok, N facts" alone they looked committed when a later segment failed. They say they were held.
    with pages() as session:
        held = session.execute(
            select(ExtractionAudit.outcome, ExtractionAudit.error).where(ExtractionAudit.id > before)
        ).all()
    assert held and all(row == ("ok", HELD_NOTE) for row in held), held
    with pages() as session:  # the audit rows' note: on a call that succeeded it read as an error
        assert session.scalar(select(func.count()).where(LLMCall.error.is_not(None))) == 0


def test_a_forced_run_overtaken_by_the_page_s_job_replaces_nothing(pages, llm):
    """The page's job extracted an append while a forced run re-extracted the page as it was: the swap
    took the append's facts out and moved the checkpoint back, and nothing extracted them again."""
    run(pages, llm)
    lines = list(SAMPLE_LINES)

    class AppendAndExtract(NoProgress):
        def __init__(self, day: int, text: str) -> None:
            self.appended = [
                fmt("Alice Example", f"2024-03-{day}", "9:00 AM", text),
                fmt("Bob Demo", f"2024-03-{day}", "9:01 AM", "Oh, nice."),
            ]
            self.done = False

        def segment_finished(self, slug: str, outcome: str) -> None:
            if not self.done:
                self.done = True
                lines.extend(self.appended)
                put_page(pages, body="\n".join(lines))
                assert run(pages, llm).segments_processed == 1  # the page's own job, meanwhile

    progress = AppendAndExtract(20, "I moved to Lisbon last week.")
    result = run_extract_conversation_facts(
        pages, llm, ExtractOptions(slug=SLUG, force=True), progress=progress
    )
    [report] = result.pages
    assert (result.pages_failed, report.status) == (1, "failed") and "another run" in report.reason
    assert any("Lisbon" in f.fact for f in page_facts(pages))
    assert run(pages, llm).segments_processed == 0  # the checkpoint still covers the append
    assert terminal_rows(pages) == 1
    with pages.begin() as session:  # a job's run raises instead: the lifecycle retries it
        job = Job(kind="extraction", subject=f"default|{SLUG}", status="running")
        session.add(job)
        session.flush()
        job_id = job.id
    progress = AppendAndExtract(22, "I adopted a dog named Biscuit.")
    with pytest.raises(CheckpointConflictError, match="another run"):
        run_extract_conversation_facts(
            pages, llm, ExtractOptions(slug=SLUG, force=True, job_id=job_id), progress=progress
        )
    assert any("Biscuit" in f.fact for f in page_facts(pages))


def test_a_page_changed_under_a_source_wide_run_is_reported_and_the_run_goes_on(tx_factory, llm):
    """A page edited while the CLI extracted it raised out of the run: the pages after it were never
    extracted, nothing was counted, and the CLI printed a traceback."""
    put_page(tx_factory, "conversations/a")
    put_page(tx_factory, "conversations/b")

    class EditFirst(NoProgress):
        done = False

        def segment_finished(self, slug: str, outcome: str) -> None:
            if slug == "conversations/a" and not self.done:
                self.done = True
                put_page(tx_factory, "conversations/a", body=SAMPLE_BODY.replace("Acme", "Globex"))

    result = run_extract_conversation_facts(tx_factory, llm, ExtractOptions(), progress=EditFirst())
    reports = {report.slug: report for report in result.pages}
    assert reports["conversations/a"].status == "failed" and "changed" in reports["conversations/a"].reason
    assert reports["conversations/b"].status == "processed" and reports["conversations/b"].facts > 0
    assert (result.pages_failed, result.pages_processed) == (1, 1)


def test_forced_run_failing_part_way_keeps_the_earlier_facts(pages, llm, simulator):
    run(pages, llm)
    first = [(f.row_num, f.fact) for f in page_facts(pages)]
    result = run(pages, faulty_llm(simulator, "500"), force=True)
    assert result.pages_failed == 1
    assert [(f.row_num, f.fact) for f in page_facts(pages)] == first
    assert terminal_rows(pages) == 1


# ---------------------------------------------------------------------------
# LLM failures are never "0 facts".
# ---------------------------------------------------------------------------


def _audit_outcomes(factory: sessionmaker[Session]) -> list[str]:
    with factory() as session:
        return list(session.scalars(select(ExtractionAudit.outcome).order_by(ExtractionAudit.id)))


@pytest.mark.parametrize(
    ("fault", "outcomes"),
    [
        ("malformed", ["malformed_output", "malformed_output"]),  # one repair turn, then give up
        ("truncated", ["truncated_output", "truncated_output"]),  # one retry with a larger cap
        ("refusal", ["refusal"]),
        ("500", ["provider_error"]),
        ("429", ["provider_error"]),
    ],
)
def test_llm_failure_gets_its_outcome_and_moves_nothing(pages, simulator, fault, outcomes):
    result = run(pages, faulty_llm(simulator, fault))
    assert result.pages_failed == 1 and result.pages_processed == 0
    assert result.facts_inserted == 0 and result.segments_failed == 1
    assert _audit_outcomes(pages) == outcomes
    assert count(pages, LLMCall) == len(outcomes)
    with pages() as session:
        assert [c.outcome for c in session.scalars(select(LLMCall).order_by(LLMCall.id))] == outcomes
    assert count(pages, OpCheckpoint) == 0
    assert count(pages, Fact) == 0
    report = result.pages[0]
    assert report.status == "failed" and outcomes[-1] in report.reason


def test_failure_in_second_segment_keeps_first_and_resumes_later(pages, llm, simulator):
    # Let the first segment through, then fail: the checkpoint must stop at segment one.
    class FailSecond:
        provider, model = llm.provider, llm.model

        def __init__(self) -> None:
            self.calls = 0
            self.bad = faulty_llm(simulator, "500")

        def chat(self, request):  # type: ignore[no-untyped-def]
            self.calls += 1
            return (llm if self.calls == 1 else self.bad).chat(request)

    result = run(pages, FailSecond())
    assert (result.pages_failed, result.segments_processed) == (1, 1)
    kept = page_facts(pages)
    assert kept and terminal_rows(pages) == 0
    with pages() as session:
        entry = decode_checkpoint_entry(session.scalars(select(OpCheckpoint.completed_key)).one())
    assert entry is not None and entry.end_iso == "2024-03-15T09:03:00Z"
    resumed = run(pages, llm)
    assert (resumed.pages_processed, resumed.segments_processed) == (1, 1)
    facts = page_facts(pages)
    assert [f.row_num for f in facts] == list(range(len(facts)))
    assert [(f.row_num, f.fact) for f in facts[: len(kept)]] == [(f.row_num, f.fact) for f in kept]
    assert terminal_rows(pages) == 1


# ---------------------------------------------------------------------------
# Bad input: counted and reported, the run goes on, nothing written is lost.
# ---------------------------------------------------------------------------


def test_too_large_page_is_skipped_and_never_sent(tx_factory, llm, simulator):
    """The webhook and ingest refuse such a page; one stored before they did (or by SQL) is skipped."""
    line = fmt("Alice Example", "2024-03-15", "9:00 AM", "x" * 1000)
    body = "\n".join([line] * (MAX_PAGE_BODY_BYTES // len(line) + 2))
    with pytest.raises(ValidationError, match="over the 26214400-byte cap extraction takes"):
        PageIn(slug="big/page", type="conversation", compiled_truth=body)
    with tx_factory.begin() as session:
        small = PageIn(slug="big/page", type="conversation").model_dump()
        upsert_page(session, PageIn.model_construct(**{**small, "compiled_truth": body}))
    put_page(tx_factory)
    before = sim_requests(simulator)
    result = run_extract_conversation_facts(tx_factory, llm, ExtractOptions())
    assert (result.pages_considered, result.pages_skipped_too_large, result.pages_processed) == (2, 1, 1)
    assert sim_requests(simulator) - before == 2  # only the normal page's two segments
    report = next(p for p in result.pages if p.slug == "big/page")
    assert "over the" in report.reason


def test_garbage_pages_are_reported_and_the_run_goes_on(tx_factory, llm):
    put_page(tx_factory, "junk/no-messages", body="just some notes\nwithout any message lines")
    put_page(tx_factory, "junk/binary", body="\x01\x02\ufffd\x7f" * 500)
    put_page(tx_factory, "junk/one-huge-line", body="y" * 10_000_000)
    put_page(
        tx_factory,
        "junk/huge-message",
        body=fmt("A", "2024-01-01", "9:00", "z" * 10_000_000) + "\n" + fmt("B", "2024-01-01", "9:01", "ok"),
    )
    put_page(tx_factory)
    result = run_extract_conversation_facts(tx_factory, llm, ExtractOptions())
    by_slug = {p.slug: p for p in result.pages}
    assert result.pages_considered == 5
    for slug in ("junk/no-messages", "junk/binary", "junk/one-huge-line"):
        assert by_slug[slug].status == "skipped" and "no message lines" in by_slug[slug].reason
    assert by_slug["junk/huge-message"].status == "processed"  # rendered and truncated to the char limit
    assert by_slug[SLUG].status == "processed"
    assert result.pages_processed == 2 and result.pages_skipped == 3


def test_page_deleted_between_listing_and_extraction(tx_factory, llm):
    put_page(tx_factory)
    put_page(tx_factory, "conversations/other")

    class DeleteOnList(NoProgress):
        def pages_listed(self, count: int) -> None:
            with tx_factory.begin() as session:
                session.execute(text("DELETE FROM pages WHERE slug = 'conversations/other'"))

    result = run_extract_conversation_facts(tx_factory, llm, ExtractOptions(), progress=DeleteOnList())
    assert (result.pages_considered, result.pages_processed, result.pages_skipped) == (2, 1, 1)
    assert "deleted" in next(p for p in result.pages if p.slug == "conversations/other").reason


def test_bad_since_is_a_clear_error(pages, llm):
    with pytest.raises(ValueError, match="ISO-8601"):
        run(pages, llm, since_iso="last tuesday")


def test_pages_of_other_sources_are_untouched(tx_factory, llm):
    put_page(tx_factory, source_id="other")
    result = run_extract_conversation_facts(tx_factory, llm, ExtractOptions(source_id="default"))
    assert result.pages_considered == 0
    assert count(tx_factory, Page) == 1


def test_a_page_whose_source_and_slug_fill_the_key_budget_is_stored_extracted_and_erased(pages, llm):
    """Source id and slug sit together in B-tree indexes capped at 2,704 bytes an entry: 200 + 500
    characters of 4-byte letters were accepted and then failed the upsert (a 500). At the budget
    (2,400 bytes) every index that holds them takes the page, its job, facts and checkpoint."""
    source_id, slug = letters(101) + "xy", "c/" + letters(498, seed=4)  # 406 + 1,994 bytes
    assert page_key_bytes(source_id, slug) == MAX_PAGE_KEY_BYTES
    with pytest.raises(ValueError, match="source_id and slug together are 2401 bytes"):
        PageIn(source_id=source_id + "z", slug=slug, type="conversation")
    put_page(pages, slug, source_id=source_id)
    result = run(pages, llm, source_id=source_id, slug=slug)
    assert result.pages_processed == 1 and result.facts_inserted > 0
    assert erase_page(pages, source_id, slug, "test") is not None


def test_a_page_of_an_entitys_facts_reads_its_own_rows(tx_factory) -> None:
    """Every page of an entity's list read and sorted all of its facts (one ordered read, undated
    last: an order no index had): an entity named in 200,000 facts cost that much a page. Each page
    reads about its own rows now, dated and undated, through ix_facts_entity_timeline."""
    import json as json_module

    from sqlalchemy import event as sqlalchemy_event

    from worker.extraction.facts import entity_cursor

    with tx_factory.begin() as session:
        session.execute(
            text(
                "INSERT INTO facts (source_id, fact, kind, entity_slug, confidence, notability, source, "
                "source_session, source_markdown_slug, row_num, valid_from) "
                "SELECT 'default', 'fact ' || n, 'fact', 'people/busy', 0.9, 'medium', 's', 's', "
                "'conversations/busy', n, CASE WHEN n % 10 = 0 THEN NULL "
                "ELSE timestamptz '2024-01-01' + n * interval '1 minute' END "
                "FROM generate_series(0, 2999) AS n"
            )
        )
        session.execute(text("ANALYZE facts"))
    with tx_factory() as session:
        listed: list = []
        after = None
        while True:  # the whole list, 500 a page: in order, each fact once
            page = read_entity_facts(session, "people/busy", limit=500, after=after)
            listed += page.facts
            after = page.next_after
            if after is None:
                break
        dated = [f for f in listed if f.valid_from is not None]
        assert len(listed) == 3000 and len({f.id for f in listed}) == 3000
        assert dated == sorted(dated, key=lambda f: (f.valid_from, f.id), reverse=True)
        assert all(f.valid_from is None for f in listed[len(dated) :])  # undated last
        plans: list[dict] = []

        @sqlalchemy_event.listens_for(session.get_bind(), "before_cursor_execute", retval=True)
        def explain(conn, cursor, statement, parameters, context, executemany):  # type: ignore[no-untyped-def]
            if "UNION ALL" in statement:
                cursor.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + statement, parameters)
                plans.append(cursor.fetchone()[0][0]["Plan"])
            return statement, parameters

        try:
            middle = read_entity_facts(session, "people/busy", limit=10, after=entity_cursor(listed[1500]))
        finally:
            sqlalchemy_event.remove(session.get_bind(), "before_cursor_execute", explain)
    assert [f.id for f in middle.facts] == [f.id for f in listed[1501:1511]]

    def scanned(node: dict) -> int:
        own = node.get("Actual Rows", 0) if "Scan" in node.get("Node Type", "") else 0
        return own + sum(scanned(child) for child in node.get("Plans", ()))

    [plan] = plans
    assert "ix_facts_entity_timeline" in json_module.dumps(plan) and scanned(plan) <= 40, plan
