"""Batch-mode extraction through the real openai/anthropic SDKs against the simulator's batch endpoints,
and the batch copies at the provider: deleted once committed, or owed and deleted by beat's poll."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from datetime import timedelta
from decimal import Decimal
from typing import Any

import anthropic
import openai
import pytest
from sqlalchemy import func, select, update
from sqlalchemy.orm import Session, sessionmaker
from typer.testing import CliRunner

from models import ExtractionAudit, Fact, LLMCall, Page, ProviderCopy
from tests.integration.test_extraction import put_page
from worker.accounting import Price, cost_usd
from worker.api.metrics import BackfillCollector
from worker.config_store import ConfigReader, set_config
from worker.extraction import (
    TERMINAL_AUDIT_SOURCE,
    BatchExtractionCounters,
    ExtractionDisabledError,
    ExtractOptions,
    run_batch_extraction,
    run_extract_conversation_facts,
)
from worker.extraction.prompts import extraction_request, first_turn
from worker.extraction.provider_copies import (
    RETRY_AFTER,
    ProviderCopies,
    delete_owed,
    discard_batch,
    sweep_provider_copies,
)
from worker.llm.anthropic_provider import AnthropicChatClient
from worker.llm.batch_api import BatchLLMClient
from worker.llm.batches import AnthropicBatchClient, OpenAIBatchClient
from worker.llm.errors import LLMError
from worker.llm.openai_compat import OpenAIChatClient
from worker.llm.retry import RetryPolicy
from worker.llm.types import Usage
from worker.settings import Settings
from worker.simulator import Simulator, SimulatorConfig

pytestmark = pytest.mark.integration

POLL = 0.02
PRICES = '{"simulator-1": {"input": 1000, "output": 1000}}'


def fmt(name: str, day: int, time: str, body: str) -> str:
    return f"**{name}** (2024-03-{day:02d} {time}): {body}"


def page_body(person: str, company: str) -> str:
    """Four segments (a day apart), each with a fact-worthy line."""
    lines = []
    for offset, (what, reply) in enumerate(
        [
            (f"I just signed the offer letter for {company}.", "Congrats!"),
            (f"Update: I started at {company} this morning.", "Day one!"),
            ("I moved to Lisbon last weekend with my partner.", "Nice city."),
            ("I will run the Berlin marathon in September.", "Good luck."),
        ]
    ):
        day = 10 + offset
        lines += [fmt(person, day, "9:00 AM", what), fmt("Bob Demo", day, "9:01 AM", reply)]
    return "\n".join(lines)


PAGES = [
    ("conversations/alice", "Alice Example", "Acme Corp"),
    ("conversations/carol", "Carol Sample", "Globex"),
    ("conversations/dave", "Dave Tester", "Initech"),
]


@pytest.fixture(scope="module")
def sim() -> Iterator[Simulator]:
    """A simulator of our own: these tests change its batch and fault knobs."""
    with Simulator(SimulatorConfig(batch_delay_seconds=0.05)) as simulator:
        yield simulator


@pytest.fixture
def clean_sim(sim: Simulator) -> Simulator:
    sim.configure(**SimulatorConfig(batch_delay_seconds=0.05).model_dump())
    sim.reset()
    return sim


def seed(factory: sessionmaker[Session]) -> sessionmaker[Session]:
    with factory.begin() as session:
        set_config(session, "facts.extraction_enabled", "true")
    for source in ("online", "batch"):
        for slug, person, company in PAGES:
            put_page(factory, slug, page_body(person, company), title=f"chat: {person}", source_id=source)
    return factory


@pytest.fixture
def store(tx_factory: sessionmaker[Session]) -> sessionmaker[Session]:
    return seed(tx_factory)


# Truncation: the CLI opens its own engine from FACTMILL_DATABASE_URL.
@pytest.fixture
def committed_store(factory: sessionmaker[Session]) -> sessionmaker[Session]:
    """``store`` with real commits, for the CLI (its own engine from FACTMILL_DATABASE_URL)."""
    return seed(factory)


def openai_chat(sim: Simulator) -> OpenAIChatClient:
    return OpenAIChatClient(model="simulator-1", base_url=sim.base_url, provider="simulator")


def openai_batch(sim: Simulator) -> OpenAIBatchClient:
    return OpenAIBatchClient(openai_chat(sim))


def facts_of(factory: sessionmaker[Session], source: str) -> list[tuple[str, int, str]]:
    with factory() as session:
        rows = session.execute(
            select(Fact.source_markdown_slug, Fact.row_num, Fact.fact)
            .where(Fact.source_id == source, Fact.source != TERMINAL_AUDIT_SOURCE)
            .order_by(Fact.source_markdown_slug, Fact.row_num)
        ).all()
    return [tuple(row) for row in rows]  # type: ignore[misc]


def terminal_slugs(factory: sessionmaker[Session], source: str) -> set[str]:
    with factory() as session:
        return set(
            session.scalars(
                select(Fact.source_markdown_slug).where(
                    Fact.source_id == source, Fact.source == TERMINAL_AUDIT_SOURCE
                )
            )
        )


def audit_outcomes(factory: sessionmaker[Session], source: str) -> list[str]:
    with factory() as session:
        return list(
            session.scalars(select(ExtractionAudit.outcome).where(ExtractionAudit.source_id == source))
        )


def run_online(factory: sessionmaker[Session], sim: Simulator, source: str = "online") -> Any:
    return run_extract_conversation_facts(factory, openai_chat(sim), ExtractOptions(source_id=source))


def run_batch(factory: sessionmaker[Session], client: Any, source: str = "batch") -> BatchExtractionCounters:
    return run_batch_extraction(factory, client, ExtractOptions(source_id=source), poll_seconds=POLL)


def assert_complete_like_online(factory: sessionmaker[Session]) -> None:
    online = facts_of(factory, "online")
    batch = facts_of(factory, "batch")
    assert online and batch == online
    for slug, _, _ in PAGES:  # row_num runs 0..n-1 per page: no gaps, no duplicates
        nums = [row for s, row, _ in batch if s == slug]
        assert nums == list(range(len(nums)))
    assert terminal_slugs(factory, "batch") == {slug for slug, _, _ in PAGES}


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_a_result_holding_a_unicode_line_separator_is_read_whole(tx_factory, clean_sim, provider):
    """JSON may hold U+2028, U+2029 and U+0085 unescaped (the results files are UTF-8, as the
    simulator writes them); str.splitlines cut such a result line in two, both halves were skipped
    as not JSON, and the paid result was lost (its segment expired, run again and paid again)."""
    with tx_factory.begin() as session:
        set_config(session, "facts.extraction_enabled", "true")
    for source in ("online", "batch"):
        body = page_body("Eve Sample", "Acme\u2028Corp\u0085Group")
        put_page(tx_factory, "conversations/eve", body, title="chat: Eve", source_id=source)
    run_online(tx_factory, clean_sim)
    counters = run_batch(tx_factory, batch_client(clean_sim, provider))
    assert counters.segments_failed == 0
    batch = facts_of(tx_factory, "batch")
    assert batch == facts_of(tx_factory, "online") and any("\u2028" in fact for _, _, fact in batch)


def test_batch_extracts_the_same_facts_as_an_online_run(store, clean_sim):
    online = run_online(store, clean_sim)
    counters = run_batch(store, openai_batch(clean_sim))

    assert counters.batch_id and counters.batch_id.startswith("sim-batch_")
    assert counters.batch_status == "completed"
    assert counters.segments_submitted == 12 and counters.segments_missing == 0
    assert counters.pages_processed == 3 and counters.pages_failed == counters.pages_incomplete == 0
    assert counters.segments_processed == online.segments_processed == 12
    assert counters.facts_inserted == online.facts_inserted > 0
    assert counters.llm_calls == 12
    assert_complete_like_online(store)
    assert set(audit_outcomes(store, "batch")) == {"ok"}
    # The batched requests went through the simulator's batch route, not the online one.
    assert clean_sim.stats()["by_route"]["batch.chat.completions"] == 12

    again = run_batch(store, openai_batch(clean_sim))  # nothing new: no batch at all
    assert again.batch_id is None and again.pages_skipped == 3


def test_batch_calls_cost_half_the_online_price(store, clean_sim):
    clean_sim.configure(cache_capacity=0)  # no cache hits, so both runs see identical usage
    with store.begin() as session:
        set_config(session, "llm.prices", PRICES)
    run_online(store, clean_sim)
    run_batch(store, openai_batch(clean_sim))
    with store() as session:
        calls = session.execute(
            select(LLMCall.id, LLMCall.input_tokens, LLMCall.output_tokens, LLMCall.cost_usd, LLMCall.purpose)
            .join(ExtractionAudit, ExtractionAudit.llm_call_id == LLMCall.id)
            .add_columns(ExtractionAudit.source_id)
        ).all()
    price = Price(Decimal(1000), Decimal(1000), Decimal(100), Decimal(1000))
    by_source: dict[str, Decimal] = {"online": Decimal(0), "batch": Decimal(0)}
    for _, tokens_in, tokens_out, cost, purpose, source in calls:
        assert purpose == "extraction"
        full = cost_usd("simulator-1", Usage(tokens_in, tokens_out), {"simulator-1": price})
        assert cost == (full / 2 if source == "batch" else full)
        by_source[source] += cost
    assert by_source["online"] > 0 and by_source["batch"] * 2 == by_source["online"]


def test_expired_batch_commits_a_prefix_and_a_rerun_completes_it(store, clean_sim):
    run_online(store, clean_sim)
    clean_sim.configure(batch_expire=True)
    first = run_batch(store, openai_batch(clean_sim))
    assert first.batch_status == "expired"
    assert first.segments_submitted == 12 and first.segments_missing == 6
    # Requests go in page order: the first page is whole, the second half done, the third untouched.
    reports = {report.slug: report for report in first.pages}
    assert reports["conversations/alice"].status == "processed"
    assert reports["conversations/carol"].status == "incomplete"
    assert reports["conversations/carol"].segments == 2
    assert reports["conversations/dave"].status == "incomplete"
    assert "no result" in reports["conversations/dave"].reason
    assert first.pages_incomplete == 2 and first.pages_failed == 0
    assert terminal_slugs(store, "batch") == {"conversations/alice"}
    partial = facts_of(store, "batch")
    assert partial == [f for f in facts_of(store, "online") if f[0] != "conversations/dave"][: len(partial)]
    # Missing results leave no rows: 6 ok audits, 6 llm_calls.
    assert audit_outcomes(store, "batch") == ["ok"] * 6

    clean_sim.configure(batch_expire=False)
    second = run_online(store, clean_sim, source="batch")  # an online rerun picks up where it stopped
    assert second.segments_processed == 6
    assert_complete_like_online(store)


def test_a_batch_holds_what_the_providers_take_by_bytes_and_a_rerun_sends_the_rest(
    store, clean_sim, monkeypatch
):
    """Only the request count was capped: tens of thousands of pending segments made a file past the
    providers' ~200 MB, refused alike on every run. Here each request "costs" 1,000 bytes and a batch
    holds 2,500 (FACTMILL_BACKFILL_BATCH_MAX_BYTES, as backfills take it): the first page sends its first
    two segments, the others wait for the next run."""
    from worker.extraction import batch as batch_module

    run_online(store, clean_sim)
    monkeypatch.setattr(batch_module, "request_overhead_bytes", lambda max_facts, cap: 0)
    monkeypatch.setattr(batch_module, "segment_bytes", lambda segment, label="": 1000)
    first = run_batch_extraction(
        store, openai_batch(clean_sim), ExtractOptions(source_id="batch"), poll_seconds=POLL, max_bytes=2500
    )
    reports = {report.slug: report for report in first.pages}
    assert first.segments_submitted == 2
    assert (reports["conversations/alice"].status, reports["conversations/alice"].segments) == (
        "incomplete",
        2,
    )
    assert {reports[s].status for s in ("conversations/carol", "conversations/dave")} == {"skipped"}
    assert "the batch is full" in reports["conversations/carol"].reason
    assert "the batch is full (2 requests, about 2000 bytes)" in reports["conversations/carol"].reason
    run_batch(store, openai_batch(clean_sim))  # at FACTMILL_BACKFILL_BATCH_MAX_BYTES's default
    assert_complete_like_online(store)


def test_a_page_whose_next_segment_alone_is_past_a_batch_fails_and_holds_no_one_back(
    store, clean_sim, monkeypatch
):
    """A first page whose next segment alone was more than a batch takes joined it with no request, and
    every page after it was skipped as "the batch is full (0 requests, about 0 bytes)", run after run.
    It fails now, saying to extract it online; the pages after it go."""
    from worker.extraction import batch as batch_module

    run_online(store, clean_sim)
    monkeypatch.setattr(batch_module, "request_overhead_bytes", lambda max_facts, cap: 0)
    real = batch_module.segment_bytes

    def alice_too_big(segment: Any, label: str = "") -> int:
        return 10**6 if "Alice" in label else real(segment, label)

    monkeypatch.setattr(batch_module, "segment_bytes", alice_too_big)
    counters = run_batch_extraction(
        store, openai_batch(clean_sim), ExtractOptions(source_id="batch"), poll_seconds=POLL, max_bytes=10**5
    )
    reports = {report.slug: report for report in counters.pages}
    alice = reports["conversations/alice"]
    assert alice.status == "failed" and "alone is more than a batch takes (100000 bytes)" in alice.reason
    assert {reports[s].status for s in ("conversations/carol", "conversations/dave")} == {"processed"}
    assert counters.segments_submitted > 0


def test_a_batch_holds_as_many_pages_as_a_run_keeps_in_memory_and_a_rerun_sends_the_rest(
    store, clean_sim, monkeypatch
):
    """A batch was measured by its requests and their bytes alone, while each planned page keeps its
    parsed messages for the whole wait (up to a day): pages with a little new each made a batch of ten
    thousand whole pages, tens of GB. Here a run keeps one page's body: the others wait."""
    from worker.extraction import batch as batch_module

    run_online(store, clean_sim)
    with store() as session:
        one_page = session.scalar(select(func.max(func.octet_length(Page.compiled_truth))))
    monkeypatch.setattr(batch_module, "MAX_HELD_PAGE_BYTES", one_page)
    first = run_batch_extraction(
        store, openai_batch(clean_sim), ExtractOptions(source_id="batch"), poll_seconds=POLL
    )
    reports = {report.slug: report for report in first.pages}
    assert [slug for slug, report in reports.items() if report.status != "skipped"] == ["conversations/alice"]
    assert "as many as one run keeps; run again" in reports["conversations/carol"].reason
    monkeypatch.undo()
    run_batch(store, openai_batch(clean_sim))
    assert_complete_like_online(store)


def test_a_batch_the_provider_fails_as_a_whole_says_why_and_a_rerun_sends_it_again(store, clean_sim):
    """OpenAI fails a batch as a whole past the queued-token limit (or for a bad line): it was read as
    expired, its reason (the batch's ``errors``) never read, and the simulator never did it."""
    run_online(store, clean_sim)
    clean_sim.configure(batch_fail="token_limit_exceeded")
    first = run_batch(store, openai_batch(clean_sim))
    assert first.batch_status is not None and first.batch_status.startswith("failed: token_limit_exceeded")
    assert first.pages_incomplete == 3 and facts_of(store, "batch") == []
    clean_sim.configure(batch_fail=None)
    run_batch(store, openai_batch(clean_sim))
    assert_complete_like_online(store)


def test_faulted_requests_leave_pages_incomplete_and_recorded_then_a_rerun_finishes(store, clean_sim):
    run_online(store, clean_sim)
    clean_sim.configure(seed=7, rate_500=0.2, rate_malformed=0.1, rate_refusal=0.05, rate_truncated=0.05)
    first = run_batch(store, openai_batch(clean_sim))
    assert first.batch_status == "completed" and first.segments_missing == 0
    assert first.pages_failed >= 1
    failed = [report for report in first.pages if report.status == "failed"]
    assert all(
        report.outcome in {"provider_error", "malformed_output", "refusal", "truncated_output"}
        for report in failed
    )
    outcomes = audit_outcomes(store, "batch")
    assert set(outcomes) - {"ok"}, outcomes  # every failure is in extraction_audit (and llm_calls)
    with store() as session:
        recorded = session.scalars(select(LLMCall.outcome)).all()
    assert set(outcomes) - {"ok"} <= set(recorded)
    assert len(terminal_slugs(store, "batch")) < 3

    clean_sim.configure(rate_500=0, rate_malformed=0, rate_refusal=0, rate_truncated=0)
    second = run_batch(store, openai_batch(clean_sim))
    assert second.pages_failed == 0 and second.pages_incomplete == 0
    assert_complete_like_online(store)


def test_an_ended_batch_leaves_no_copy_of_the_pages_at_the_provider(store, clean_sim):
    """The input file holds the pages' text and the result files the facts drawn from it: once the
    results are committed, both are deleted at the provider (an erased page must not outlive itself
    there). OpenAI keeps the batch object, without its files; Anthropic deletes the batch with its results."""
    held_before = held_files(clean_sim)
    clean_sim.configure(seed=7, rate_500=0.3)  # some requests fail: an error file besides the output file
    counters = run_batch(store, openai_batch(clean_sim))
    assert counters.batch_status == "completed" and counters.provider_copy_deleted
    sdk = openai.OpenAI(base_url=clean_sim.base_url, api_key="sim", max_retries=0)
    batch = sdk.batches.retrieve(counters.batch_id)
    files = [batch.input_file_id, batch.output_file_id, batch.error_file_id]
    assert all(files), files
    for file_id in files:
        with pytest.raises(openai.NotFoundError):
            sdk.files.content(file_id)
    assert facts_of(store, "batch")  # committed before the copy went
    openai_batch(clean_sim).discard(batch.id)  # deleted already (a run that died in between): fine

    clean_sim.configure(rate_500=0)
    put_page(store, "conversations/erin", page_body("Erin Case", "Hooli"), title="chat: Erin", source_id="a")
    chat = AnthropicChatClient(model="simulator-1", base_url=clean_sim.url, provider="simulator")
    counters = run_batch(store, AnthropicBatchClient(chat), source="a")
    assert counters.pages_processed == 1 and counters.provider_copy_deleted
    with pytest.raises(anthropic.NotFoundError):
        anthropic.Anthropic(base_url=clean_sim.url, api_key="sim", max_retries=0).messages.batches.retrieve(
            counters.batch_id
        )
    assert held_files(clean_sim) == held_before


def held_files(sim: Simulator) -> int:
    """The files the module's simulator holds: what earlier tests left too (a reset keeps them), so a
    test compares with what it found (== 0 failed when another test ran first in the same worker)."""
    return int(sim.stats()["batches"]["held"]["files"])


def anthropic_batch(sim: Simulator) -> AnthropicBatchClient:
    chat = AnthropicChatClient(model="simulator-1", base_url=sim.url, provider="simulator")
    return AnthropicBatchClient(chat)


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_a_garbled_result_line_costs_its_request_only(store, clean_sim, caplog, provider):
    """One result line that is not JSON failed every collection of the batch (a JSONDecodeError out of
    the results, ours or the Anthropic SDK's reader); now its request has no result (the next run
    extracts it) and the rest of the batch commits."""
    run_online(store, clean_sim)
    clean_sim.configure(batch_garbled_lines=1)
    client = openai_batch(clean_sim) if provider == "openai" else anthropic_batch(clean_sim)
    with caplog.at_level("WARNING", logger="worker.llm.batches"):
        first = run_batch(store, client)
    assert first.batch_status in ("completed", "ended") and first.segments_missing == 1
    assert first.pages_processed == 2 and first.pages_incomplete == 1  # the first page stops at it
    assert any("result line 1 is not a JSON object" in r.getMessage() for r in caplog.records)
    clean_sim.configure(batch_garbled_lines=0)
    second = run_batch(store, client)
    assert second.pages_processed == 1 and second.pages_incomplete == 0
    assert_complete_like_online(store)


def test_anthropic_message_batches_match_an_online_anthropic_run(store, clean_sim):
    chat = AnthropicChatClient(model="simulator-1", base_url=clean_sim.url, provider="simulator")
    run_extract_conversation_facts(store, chat, ExtractOptions(source_id="online"))
    counters = run_batch(store, AnthropicBatchClient(chat))
    assert counters.batch_id and counters.batch_id.startswith("sim-msgbatch_")
    assert counters.batch_status == "ended" and counters.pages_processed == 3
    assert_complete_like_online(store)

    clean_sim.configure(batch_expire=True)
    put_page(
        store, "conversations/erin", page_body("Erin Case", "Hooli"), title="chat: Erin", source_id="batch"
    )
    partial = run_batch(store, AnthropicBatchClient(chat))
    assert partial.segments_submitted == 4 and partial.segments_missing == 2 and partial.pages_incomplete == 1


def test_cli_extract_batch_json(committed_store, clean_sim, database_url, monkeypatch):
    from worker.cli import app
    from worker.settings import get_settings

    monkeypatch.setenv("FACTMILL_DATABASE_URL", database_url)
    monkeypatch.setenv("FACTMILL_LLM", "simulator")
    monkeypatch.setenv("FACTMILL_SIMULATOR_URL", clean_sim.url)
    get_settings.cache_clear()
    try:
        args = ["extract", "--source-id", "batch", "--batch", "--poll-seconds", "0.02", "--json"]
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output
        counters = json.loads(result.output)
        assert counters["batch_id"].startswith("sim-batch_") and counters["batch_status"] == "completed"
        assert counters["pages_processed"] == 3 and counters["segments_submitted"] == 12
        # A batch that expires runs none of what it was sent: exit 0 read as "all committed".
        put_page(
            committed_store,
            "conversations/erin",
            page_body("Erin Case", "Hooli"),
            title="chat: Erin",
            source_id="batch",
        )
        clean_sim.configure(batch_expire=True)
        expired = CliRunner().invoke(app, args)
        assert expired.exit_code == 4, expired.output
        assert json.loads(expired.output)["segments_missing"] > 0
        clean_sim.configure(batch_expire=False)
        monkeypatch.setenv("FACTMILL_LLM", "openai-compatible")
        monkeypatch.setenv("FACTMILL_LLM_BASE_URL", clean_sim.base_url)
        get_settings.cache_clear()
        refused = CliRunner().invoke(app, ["extract", "--batch", "--json"])
        assert refused.exit_code == 2 and "no batch API" in refused.output
    finally:
        get_settings.cache_clear()


# -- the provider's copy of a batch: deleted, or owed and deleted by beat's backfill poll --------

ONCE = RetryPolicy(max_attempts=1)


def batch_client(simulator: Simulator, provider: str) -> BatchLLMClient:
    if provider == "openai":
        return OpenAIBatchClient(
            OpenAIChatClient(model="simulator-1", base_url=simulator.base_url, provider="simulator"), ONCE
        )
    chat = AnthropicChatClient(model="simulator-1", base_url=simulator.url, provider="simulator")
    return AnthropicBatchClient(chat, ONCE)


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_a_create_whose_answer_is_lost_is_not_sent_again(provider):
    """The provider accepts the batch but its answer never arrives (a timeout): the create was tried
    again by the retry policy, and every try started (and billed) another batch. A create is tried once
    now; a backfill's next pass finds the accepted batch by its key. (A simulator of its own: what it
    leaves held would count in the other tests'.)"""
    retrying = RetryPolicy(max_attempts=3, backoff_base_seconds=0.01, jitter=0)
    with Simulator(SimulatorConfig(batch_create_hold_seconds=1.5)) as sim:
        client: BatchLLMClient
        if provider == "openai":
            chat = OpenAIChatClient(
                model="simulator-1", base_url=sim.base_url, provider="simulator", timeout=0.5
            )
            client = OpenAIBatchClient(chat, retrying)
        else:
            messages = AnthropicChatClient(
                model="simulator-1", base_url=sim.url, provider="simulator", timeout=0.5
            )
            client = AnthropicBatchClient(messages, retrying)
        request = extraction_request([first_turn("**Ann** (2024-03-10 9:00 AM): I moved to Oslo.")], 10, 256)
        with pytest.raises(LLMError):
            client.submit([("k-1", request)], key="k")

        def held() -> int:
            return int(sim.stats()["batches"]["held"]["batches"])

        # The held create stores its batch 1.5 s after it came (later on a loaded machine: a fixed
        # 2 s wait failed in a full run); a create sent again would store its own within the hold.
        deadline = time.monotonic() + 15
        while held() == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.5)
        assert held() == 1


def owed(factory: sessionmaker[Session]) -> list[tuple[str, str, int, str | None]]:
    with factory() as session:
        rows = session.execute(
            select(
                ProviderCopy.provider, ProviderCopy.batch_id, ProviderCopy.attempts, ProviderCopy.last_error
            )
        )
        return [tuple(row) for row in rows]  # type: ignore[misc]


def held_at_provider(simulator: Simulator, provider: str, batch_id: str) -> bool:
    if provider == "openai":
        return simulator.stats()["batches"]["held"]["files"] > 0
    sdk = anthropic.Anthropic(base_url=simulator.url, api_key="sim", max_retries=0)
    try:
        sdk.messages.batches.retrieve(batch_id)
    except anthropic.NotFoundError:
        return False
    return True


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_a_failed_delete_is_owed_and_deleted_by_the_poll(store, clean_sim, caplog, provider):
    """The delete after the commit failed and was only logged: the pages' text stayed at the provider
    for good. Now it is a provider_copies row; the poll's sweep retries it once due (not before), counts
    each failure, and drops the row once the provider has deleted the copy."""
    clean_sim.configure(batch_delete_fails=True)
    client = batch_client(clean_sim, provider)
    with caplog.at_level(logging.WARNING, logger="worker.extraction.provider_copies"):
        counters = run_batch(store, client)
    assert counters.pages_processed == 3 and not counters.provider_copy_deleted
    assert facts_of(store, "batch")  # the results were committed all the same
    ((who, batch_id, attempts, error),) = owed(store)
    assert (who, batch_id, attempts) == ("simulator", counters.batch_id, 0) and "500" in (error or "")
    assert any("retried later" in r.getMessage() and batch_id in r.getMessage() for r in caplog.records)
    assert held_at_provider(clean_sim, provider, batch_id)

    copies = ProviderCopies(store)
    assert copies.due("simulator") == []  # tried a moment ago: due after RETRY_AFTER
    swept = delete_owed(copies, client, retry_after=timedelta(0))
    assert (swept.deleted, swept.failed) == (0, 1) and owed(store)[0][2] == 1  # still failing: counted
    clean_sim.configure(batch_delete_fails=False)
    swept = delete_owed(copies, client, retry_after=timedelta(0))
    assert (swept.deleted, swept.failed) == (1, 0) and owed(store) == []
    assert not held_at_provider(clean_sim, provider, batch_id)
    assert delete_owed(copies, client, retry_after=timedelta(0)).deleted == 0  # nothing left
    assert timedelta(0) < RETRY_AFTER


def test_a_run_stopped_while_its_batch_runs_cancels_it_and_owes_its_delete(store, clean_sim):
    """Ctrl-C in a wait of hours (or a cancel, a poll or a download that failed) left the batch and its
    files at the provider, and nothing else knew its id. Now its delete is owed; and the batch is
    cancelled (left running, it was billed whole and its results deleted unread)."""
    clean_sim.configure(batch_delay_seconds=30.0)
    client = openai_batch(clean_sim)

    def interrupted(_: float) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_batch_extraction(
            store, client, ExtractOptions(source_id="batch"), poll_seconds=0.01, sleep=interrupted
        )
    ((who, batch_id, attempts, error),) = owed(store)
    assert (who, attempts) == ("simulator", 0) and "stopped before collecting it (KeyboardInterrupt)" in (
        error or ""
    )
    assert client.status(batch_id).status in ("cancelling", "cancelled")  # not left to run for 30 s
    deadline = time.monotonic() + 30
    while not client.status(batch_id).ended:  # then beat's sweep deletes it (here, its function)
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert delete_owed(ProviderCopies(store), client, retry_after=timedelta(0)).deleted == 1


def test_a_run_stopped_in_its_send_owes_and_cancels_the_batch_the_provider_took(
    store, clean_sim, monkeypatch
):
    """Ctrl-C or SIGTERM in a batch's send (an upload and create of minutes for 95 MB), or a create whose
    answer was lost: a batch the provider took ran on, billed whole, its files (the pages' text) there
    for good, and no row knew it. It is looked up by its key now, owed and cancelled."""
    clean_sim.configure(batch_delay_seconds=30.0)
    client = openai_batch(clean_sim)
    send = OpenAIBatchClient.submit

    def taken_then_stopped(self: OpenAIBatchClient, requests: Any, key: str | None = None) -> str:
        send(self, requests, key)
        raise KeyboardInterrupt

    monkeypatch.setattr(OpenAIBatchClient, "submit", taken_then_stopped)
    with pytest.raises(KeyboardInterrupt):
        run_batch_extraction(store, client, ExtractOptions(source_id="batch"), poll_seconds=0.01)
    ((who, batch_id, _, error),) = owed(store)
    assert who == "simulator" and "stopped before collecting it (KeyboardInterrupt)" in (error or "")
    assert client.status(batch_id).status in ("cancelling", "cancelled")  # not left to run, billed


def test_a_run_stopped_between_its_upload_and_its_create_deletes_the_upload(store, clean_sim, monkeypatch):
    """Stopped after the upload (the pages' text) and before the create, the upload stayed at the
    provider, named nowhere: with no batch under the send's key, it is deleted."""
    held = held_files(clean_sim)

    def stopped(*args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(openai.resources.batches.Batches, "create", stopped)
    with pytest.raises(KeyboardInterrupt):
        run_batch_extraction(
            store, openai_batch(clean_sim), ExtractOptions(source_id="batch"), poll_seconds=0.01
        )
    assert owed(store) == [] and held_files(clean_sim) == held


def test_a_batch_not_ended_is_deleted_once_it_has(store, clean_sim):
    """A run that gives up on a batch (it never ended) leaves it running at the provider with the
    pages' text; its delete is owed, and the sweep waits for it to end (deleting an OpenAI batch's
    input before its output exists would leave the output behind) and then deletes everything."""
    held_before = held_files(clean_sim)
    clean_sim.configure(batch_delay_seconds=1.5)
    client = batch_client(clean_sim, "openai")
    request = extraction_request([first_turn("**Ann** (2024-03-10 9:00 AM): I moved to Oslo.")], 10, 256)
    batch_id = client.submit([("k-1", request)], key="k")
    copies = ProviderCopies(store)
    copies.owe(client.provider, batch_id, "did not end in time")
    swept = delete_owed(copies, client, retry_after=timedelta(0))
    assert (swept.waiting, swept.deleted) == (1, 0) and owed(store)[0][2] == 0  # waiting is no failure
    deadline = time.monotonic() + 30
    while not client.status(batch_id).ended:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert delete_owed(copies, client, retry_after=timedelta(0)).deleted == 1 and owed(store) == []
    assert held_files(clean_sim) == held_before


def test_a_copy_the_provider_no_longer_has_is_settled(store, clean_sim):
    """An Anthropic batch deleted by hand (or by the provider after 29 days) answers 404: nothing is
    left to delete, so the row goes rather than failing for ever."""
    client = batch_client(clean_sim, "anthropic")
    copies = ProviderCopies(store)
    copies.owe(client.provider, "msgbatch_gone", "HTTP 500")
    assert discard_batch(client, "msgbatch_gone", copies) is True  # a 404 on delete is success
    assert owed(store) == [], "a copy deleted is settled"
    copies.owe(client.provider, "msgbatch_gone", "HTTP 500")  # the sweep's status read: a 404 too
    swept = delete_owed(copies, client, retry_after=timedelta(0))
    assert swept.deleted == 1 and owed(store) == []


def test_the_sweep_stops_at_the_first_failure_and_tries_each_call_once(
    store, clean_sim, database_url, caplog
):
    """During an outage each owed copy cost the gateway's whole retry (5 tries, up to 2 minutes) and the
    poll went through all of them, holding its worker; now one try, and the rest wait for the next poll."""
    clean_sim.configure(batch_delete_fails=True)
    client = batch_client(clean_sim, "openai")  # what FACTMILL_LLM=simulator opens
    copies = ProviderCopies(store)
    request = extraction_request([first_turn("**Ann** (2024-03-10 9:00 AM): I moved to Oslo.")], 10, 256)
    for key in ("a", "b"):
        copies.owe("simulator", client.submit([(f"{key}-1", request)], key=key), "HTTP 500")
    with store.begin() as session:
        session.execute(update(ProviderCopy).values(tried_at=func.now() - RETRY_AFTER))
    time.sleep(0.2)  # both batches end (batch_delay_seconds 0.05)
    settings = Settings(llm="simulator", simulator_url=clean_sim.base_url, database_url=database_url)  # type: ignore[call-arg]
    with caplog.at_level(logging.WARNING, logger="worker.llm.batches"):
        swept = sweep_provider_copies(store, settings)
    assert (swept.failed, swept.deleted) == (1, 0)
    assert sorted(row[2] for row in owed(store)) == [0, 1]  # one tried, the other left for later
    assert not [r for r in caplog.records if "retrying" in r.getMessage()]  # one try a call


def test_cli_extract_batch_says_when_the_batch_stays_at_the_provider(
    committed_store, clean_sim, database_url, monkeypatch
):
    """The --json report had provider_copy_deleted false and nothing else: a person reading the run's
    summary learnt nothing of the pages' text left at the provider. Now one line says so, and how it
    goes."""
    from worker.cli import app
    from worker.settings import get_settings

    clean_sim.configure(batch_delete_fails=True)
    monkeypatch.setenv("FACTMILL_DATABASE_URL", database_url)
    monkeypatch.setenv("FACTMILL_LLM", "simulator")
    monkeypatch.setenv("FACTMILL_SIMULATOR_URL", clean_sim.url)
    monkeypatch.setenv("FACTMILL_LLM_MAX_ATTEMPTS", "1")
    get_settings.cache_clear()
    try:
        result = CliRunner().invoke(
            app, ["extract", "--source-id", "batch", "--batch", "--poll-seconds", "0.02"]
        )
    finally:
        get_settings.cache_clear()
    assert result.exit_code == 0, result.output
    assert "its files (the pages' text) are still at the provider" in result.stderr
    assert "Beat's backfill poll deletes them" in result.stderr
    assert "`factmill backfill copies --delete`" in result.stderr
    assert len(owed(committed_store)) == 1


def test_a_batch_run_stopped_by_sigterm_owes_the_batch_it_leaves_at_the_provider(
    committed_store, database_url
):
    """SIGTERM or SIGHUP (a closed terminal) in a wait of up to 24 h killed the run at once: no row
    knew the batch, its results were never collected, the pages' text stayed at the provider, and a
    second run paid for a second batch. Now the run stops as Ctrl-C stops it, owing the batch."""
    with Simulator(SimulatorConfig(batch_delay_seconds=3600)) as own:  # the batch it leaves stays here
        _sigterm_a_batch_run(own, committed_store, database_url)


def sigterm_extract(sim: Simulator, database_url: str, args: list[str], ready: Any) -> tuple[int, bytes]:
    """`factmill extract ARGS` on ``sim``, sent SIGTERM once ``ready()``: its exit code and stderr."""
    import os
    import signal
    import subprocess
    import sys

    env = dict(os.environ) | {
        "FACTMILL_DATABASE_URL": database_url,
        "FACTMILL_LLM": "simulator",
        "FACTMILL_SIMULATOR_URL": sim.url,
    }
    command = [sys.executable, "-m", "worker.cli", "extract", "--source-id", "batch", *args]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)  # fmt: skip
    try:
        for _ in range(300):
            if ready():
                break
            time.sleep(0.1)
        assert ready(), "the run never reached the moment to stop it"
        time.sleep(0.3)  # waiting on it now
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, stderr


def _sigterm_a_batch_run(sim: Simulator, committed_store: sessionmaker[Session], database_url: str) -> None:
    import signal

    returncode, stderr = sigterm_extract(
        sim,
        database_url,
        ["--batch", "--poll-seconds", "0.1"],
        lambda: sim.stats()["batches"]["created"] == 1,
    )
    assert returncode == 128 + signal.SIGTERM, stderr
    [(provider, _, _, error)] = owed(committed_store)
    assert provider == "simulator" and "SystemExit" in (error or ""), error


def test_cli_backfill_copies_lists_and_deletes_the_owed_copies(
    committed_store, clean_sim, database_url, monkeypatch
):
    """Nothing but beat's poll could delete an owed copy, and nothing but SQL showed them: an operator
    asked to purge the pages' text at the provider now (an erasure request) had no command. Now
    `backfill copies` lists them and `--delete` deletes the ended ones with the configured provider."""
    from worker.cli import app
    from worker.settings import get_settings

    clean_sim.configure(batch_delete_fails=True)
    client = batch_client(clean_sim, "openai")
    run_batch(committed_store, client)
    ((_, batch_id, _, _),) = owed(committed_store)
    monkeypatch.setenv("FACTMILL_DATABASE_URL", database_url)
    monkeypatch.setenv("FACTMILL_LLM", "simulator")
    monkeypatch.setenv("FACTMILL_SIMULATOR_URL", clean_sim.url)

    def cli(*args: str) -> Any:
        get_settings.cache_clear()
        try:
            return CliRunner().invoke(app, ["backfill", "copies", *args])
        finally:
            get_settings.cache_clear()

    listed = cli("--json")
    assert listed.exit_code == 0, listed.output
    report = json.loads(listed.stdout)
    assert report["owed"] == 1 and [c["batch_id"] for c in report["copies"]] == [batch_id]
    assert "500" in report["copies"][0]["last_error"]
    shown = cli()
    assert "sim-batch" in shown.stdout and "1 batch copy owed a delete;" in shown.stderr

    failed = cli("--delete")  # the provider still fails: said, counted, exit 1
    assert failed.exit_code == 1 and "0 deleted" in failed.stdout and "1 failed" in failed.stdout
    assert "a delete failed" in failed.stderr and owed(committed_store)[0][2] == 1
    assert held_at_provider(clean_sim, "openai", batch_id)

    clean_sim.configure(batch_delete_fails=False)
    held = clean_sim.stats()["batches"]["held"]["files"]  # an earlier test's may be held there too
    deleted = cli("--delete", "--json")
    assert deleted.exit_code == 0, deleted.output
    assert json.loads(deleted.stdout) == {"deleted": 1, "not_ended": 0, "failed": 0, "owed": 0}
    assert owed(committed_store) == [] and clean_sim.stats()["batches"]["held"]["files"] < held
    assert "no provider batch copy is owed" in cli().stdout

    ProviderCopies(committed_store).owe("anthropic", "msgbatch_elsewhere", "HTTP 500")
    elsewhere = cli("--delete")  # owed by a provider this deployment is not configured with: exit 1
    assert elsewhere.exit_code == 1 and "1 still owed" in elsewhere.stdout
    assert "belong to another provider than the configured one (simulator)" in elsewhere.stderr
    scripted = cli("--delete", "--json")  # (exit 0 and no reason before: a script read "deleted")
    assert scripted.exit_code == 1 and json.loads(scripted.stdout)["owed"] == 1
    assert "belong to another provider" in scripted.stderr

    # A batch an `extract --batch` run sent and still collects: on record, not owed, not deleted.
    ProviderCopies(committed_store).settle("anthropic", "msgbatch_elsewhere")
    ProviderCopies(committed_store).hold("simulator", "sim-batch_collecting", timedelta(hours=25))
    report = json.loads(cli("--json").stdout)
    assert (report["owed"], report["held"]) == (0, 1) and report["copies"][0][
        "batch_id"
    ] == "sim-batch_collecting"
    assert "0 batch copies owed a delete; 1 held by the `extract --batch` run" in cli().stderr
    kept = cli("--delete")
    assert kept.exit_code == 0 and "0 still owed" in kept.stdout and "another provider" not in kept.stderr


def test_an_online_run_stopped_by_sigterm_stops_as_ctrl_c_does(committed_store, database_url):
    """Online, SIGTERM (a `timeout`, a CI cancel) killed the run at once: the clean-up that records the
    calls answered but not yet committed never ran, and budgets and `factmill costs` counted low. It now
    ends the run as Ctrl-C does (exit 128 + 15 from its own handler, not death by the signal)."""
    import signal

    with Simulator(SimulatorConfig(latency_ms=3000)) as slow:
        returncode, stderr = sigterm_extract(
            slow, database_url, ["--json"], lambda: slow.stats()["in_flight"] >= 1
        )
    assert returncode == 128 + signal.SIGTERM, stderr


def test_a_page_with_a_skipped_segment_is_processed_not_incomplete(store, clean_sim):
    """A segment refused at its last allowed failure is skipped and the page goes on to its end; the
    batch run counted only the segments with facts, so the page was "incomplete" and the run said the
    next one would extract segments it then found nothing new in."""
    with store.begin() as session:
        set_config(session, "extraction.max_segment_failures", "1")
    body = "\n".join(
        fmt(
            "Alice Example",
            day,
            "9:00 AM",
            f"I moved to Oslo in 20{day}." + (" [[sim:refusal]]" if day == 11 else ""),
        )
        + "\n"
        + fmt("Bob Demo", day, "9:01 AM", "Noted, I will remember that.")
        for day in (10, 11, 12)
    )
    put_page(store, "conversations/skips", body, source_id="skips")
    counters = run_batch(store, openai_batch(clean_sim), source="skips")
    assert (counters.segments_skipped, counters.pages_incomplete, counters.pages_processed) == (1, 0, 1)
    (report,) = counters.pages
    assert report.status == "processed", report.reason
    again = run_batch(store, openai_batch(clean_sim), source="skips")
    assert again.batch_id is None and again.pages_processed == 0, "nothing was left for a next run"


def test_a_batch_that_ends_as_its_cancel_is_refused_is_collected(store, clean_sim):
    """Past the run's timeout the batch is cancelled; one that ended meanwhile refuses the cancel (400).
    That error left the run: its paid results were never read, and the next run paid for them again."""
    clean_sim.configure(batch_delay_seconds=1.0, batch_cancel_fails=True)
    counters = run_batch_extraction(
        store,
        openai_batch(clean_sim),
        ExtractOptions(source_id="batch"),
        poll_seconds=0.05,
        timeout_seconds=0.3,
    )
    assert counters.batch_status == "completed" and counters.pages_processed == len(PAGES)
    assert owed(store) == [], "collected, its copies deleted: nothing owed"


def test_the_kill_switch_stops_a_batch_run_waiting_for_its_batch(store, clean_sim):
    """Switched off while a batch runs (a model writing bad facts), the run waited on and committed
    every page's facts when the batch ended; the online run stops before its next call. The batch is
    cancelled, its delete owed, and nothing is committed."""
    clean_sim.configure(batch_delay_seconds=30.0)
    polls = 0

    def switched_off(_: float) -> None:
        nonlocal polls
        polls += 1
        if polls == 2:
            with store.begin() as session:
                set_config(session, "facts.extraction_enabled", "false")

    with pytest.raises(ExtractionDisabledError):
        run_batch_extraction(
            store,
            openai_batch(clean_sim),
            ExtractOptions(source_id="batch"),
            poll_seconds=0.01,
            sleep=switched_off,
        )
    ((_, batch_id, _, _),) = owed(store)
    assert openai_batch(clean_sim).status(batch_id).status in ("cancelling", "cancelled")
    assert facts_of(store, "batch") == []


def test_a_sent_batch_is_on_record_while_its_run_waits_and_settled_once_collected(store, clean_sim):
    """The batch's id lived only in the run's memory until it stopped: a run killed outright (SIGKILL,
    the OOM killer) in a wait of up to a day left the batch and the pages' text at the provider, with
    no row for the sweep. It is on record from its send, not due while its run may still collect it."""
    clean_sim.configure(batch_delay_seconds=0.3)
    seen: list[Any] = []

    def look(_: float) -> None:
        if not seen:
            due = ProviderCopies(store).due("simulator", retry_after=timedelta(0))
            seen.append((owed(store), due, owed_gauge(store)))
        time.sleep(POLL)

    counters = run_batch_extraction(
        store, openai_batch(clean_sim), ExtractOptions(source_id="batch"), sleep=look
    )
    ((rows, due, gauge),) = seen
    assert [(who, batch_id) for who, batch_id, _, _ in rows] == [("simulator", counters.batch_id)]
    assert due == [] and gauge == 0, "a batch its run may still collect is neither deleted nor owed yet"
    assert counters.provider_copy_deleted and owed(store) == [], "collected and deleted: settled"


def owed_gauge(factory: sessionmaker[Session]) -> float:
    (gauge,) = [m for m in BackfillCollector(factory).collect() if m.name == "factmill_provider_copies_owed"]
    return gauge.samples[0].value


def test_a_database_restarting_during_the_wait_does_not_throw_the_batch_away(store, clean_sim):
    """The kill switch is read at each poll: a database restarting in a wait of hours (the switch
    unreadable for a moment) ended the run, cancelled the batch and threw its work away."""
    import psycopg
    from sqlalchemy.exc import OperationalError

    clean_sim.configure(batch_delay_seconds=0.3)
    reads = 0

    class Restarting(ConfigReader):
        def enabled(self, key: str) -> bool:
            nonlocal reads
            reads += 1
            if reads == 3:  # the first poll's read (after the run's and the send's): the server restarts
                shutdown = psycopg.errors.lookup("57P01")(
                    "terminating connection due to administrator command"
                )
                raise OperationalError("SELECT value FROM config", {}, shutdown)
            return super().enabled(key)

    counters = run_batch_extraction(
        store,
        openai_batch(clean_sim),
        ExtractOptions(source_id="batch"),
        config=Restarting(store, ttl=0),
        poll_seconds=0.02,
    )
    assert reads > 2 and counters.batch_status == "completed" and counters.pages_processed == len(PAGES)


def test_the_kill_switch_turned_off_while_pages_are_planned_sends_no_batch(store, clean_sim, monkeypatch):
    """Read before planning only: switched off while the pages were planned (minutes for a large
    selection), the batch still went out with the pages' text, to be cancelled at the first poll."""
    from worker.extraction.batch import BatchExtraction

    real_plans = BatchExtraction.plans

    def switched_off_meanwhile(self: Any) -> Any:
        planned = real_plans(self)
        with store.begin() as session:
            set_config(session, "facts.extraction_enabled", "false")
        return planned

    monkeypatch.setattr(BatchExtraction, "plans", switched_off_meanwhile)
    with pytest.raises(ExtractionDisabledError):
        run_batch(store, openai_batch(clean_sim))
    assert clean_sim.stats()["batches"]["created"] == 0 and owed(store) == []
