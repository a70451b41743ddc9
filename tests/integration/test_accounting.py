"""Every llm_calls row is costed by the one costing function with the live `llm.prices` override: one test
per purpose (extraction, its repair turn, compaction, search expansion, HyDE/vec and fact embeddings; the
last four in test_accounting_compaction.py and test_accounting_search.py), online and batch.

The expected USD is worked out here, by hand, from the override's numbers and the row's tokens (never
through worker.accounting), and the prices are chosen so every amount is exact at the column's six
decimals. A feature adds its purpose as one more test using ``assert_costed_by_override``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from decimal import Decimal

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from models import LLMCall
from tests.integration.test_consolidation import JAN_BODY, JAN_PAGE, MAR_BODY, MAR_PAGE, consolidate, extract
from tests.integration.test_extraction import put_page
from worker.accounting import PRICES, PRICES_KEY, Ledger, LLMCallRecord
from worker.config_store import ConfigReader, set_config
from worker.extraction import ExtractOptions, run_batch_extraction, run_extract_conversation_facts
from worker.llm.anthropic_provider import AnthropicChatClient
from worker.llm.batches import AnthropicBatchClient, OpenAIBatchClient
from worker.llm.openai_compat import OpenAIChatClient
from worker.llm.types import Usage
from worker.simulator import Simulator, SimulatorConfig

pytestmark = pytest.mark.integration

# A model with a list price, so a row costed at list price is told apart from one costed by the override.
MODEL = "gpt-4o-mini"
assert MODEL in PRICES
# USD per 1M tokens, every class given: per token 0.001, 0.002, 0.0001 and 0.00125 (half in a batch).
PRICE = {"input": 1000, "output": 2000, "cache_read": 100, "cache_write": 1250}
OVERRIDE = json.dumps({MODEL: PRICE})


def usd_by_hand(
    price: Mapping[str, float], tokens: tuple[int, int, int, int], *, batch: bool = False
) -> Decimal:
    """tokens = (input, output, cache read, cache write); input counts every prompt token, cached ones
    included, so the uncached part is what is left after both cache classes."""
    input_tokens, output, read, write = tokens
    per_million = (
        (input_tokens - read - write) * Decimal(str(price["input"]))
        + read * Decimal(str(price["cache_read"]))
        + write * Decimal(str(price["cache_write"]))
        + output * Decimal(str(price["output"]))
    )
    dollars = per_million / 1_000_000
    return dollars / 2 if batch else dollars  # both providers' batch APIs bill half of every class


def row_tokens(call: LLMCall) -> tuple[int, int, int, int]:
    return call.input_tokens, call.output_tokens, call.cache_read_tokens, call.cache_write_tokens


def assert_costed_by_override(
    factory: sessionmaker[Session],
    purpose: str,
    prices: Mapping[str, Mapping[str, float]] | None = None,
    *,
    batch: bool = False,
) -> list[LLMCall]:
    """Every llm_calls row of ``purpose`` costs what ``prices`` (default: this module's override) says,
    at half price when ``batch``, and is marked batch or online accordingly; returns the rows."""
    prices = prices if prices is not None else {MODEL: PRICE}
    with factory() as session:
        calls = list(session.scalars(select(LLMCall).where(LLMCall.purpose == purpose)))
    assert calls, f"no llm_calls rows for {purpose!r}"
    for call in calls:
        assert call.model in prices, call.model
        assert call.batch is batch
        if call.outcome == "ok" or call.input_tokens:
            expected = usd_by_hand(prices[call.model], row_tokens(call), batch=batch)
            assert expected > 0
            assert call.cost_usd == expected, (purpose, call.id, call.cost_usd, expected)
    return calls


@pytest.fixture(scope="module")
def sim() -> Iterator[Simulator]:
    """A simulator of our own with quick batches (the shared one keeps its default batch delay)."""
    with Simulator(SimulatorConfig(batch_delay_seconds=0.05)) as simulator:
        yield simulator


@pytest.fixture
def priced(tx_factory: sessionmaker[Session], sim: Simulator) -> sessionmaker[Session]:
    """A database with the price override set (and the simulator's counters and cache reset)."""
    sim.configure(**SimulatorConfig(batch_delay_seconds=0.05).model_dump())
    sim.reset()
    with tx_factory.begin() as session:
        set_config(session, PRICES_KEY, OVERRIDE, updated_by="test")
    return tx_factory


def chat_client(sim: Simulator) -> OpenAIChatClient:
    return OpenAIChatClient(model=MODEL, base_url=sim.base_url, provider="simulator")


def claude_client(sim: Simulator) -> AnthropicChatClient:
    return AnthropicChatClient(model=MODEL, base_url=sim.anthropic_base_url, provider="simulator")


# --- extraction -----------------------------------------------------------------------------------


def test_extraction_online_calls_are_costed_by_the_override(priced, sim):
    put_page(priced)
    counters = run_extract_conversation_facts(priced, chat_client(sim), ExtractOptions())
    assert counters.llm_calls > 0
    calls = assert_costed_by_override(priced, "extraction")
    # The second segment reads the instructions from the prompt cache: the cache-read price is used.
    assert any(call.cache_read_tokens > 0 for call in calls)


def test_extraction_online_through_anthropic_prices_cache_writes_and_reads(priced, sim):
    put_page(priced)
    counters = run_extract_conversation_facts(priced, claude_client(sim), ExtractOptions())
    assert counters.llm_calls > 0
    calls = assert_costed_by_override(priced, "extraction")
    assert any(call.cache_write_tokens > 0 for call in calls)
    assert any(call.cache_read_tokens > 0 for call in calls)


def test_a_repair_turn_is_costed_by_the_override(priced, sim):
    # Every reply to this segment is malformed: the first ask and its repair turn are both recorded.
    put_page(
        priced, body="**Alice** (2024-03-15 9:00 AM): [[sim:malformed]] hi\n**Bob** (2024-03-15 9:01 AM): ok"
    )
    counters = run_extract_conversation_facts(priced, chat_client(sim), ExtractOptions())
    assert counters.llm_calls == 2
    repair = [
        r for r in sim.recent_requests() if [m["role"] for m in r["messages"]][-2:] == ["assistant", "user"]
    ]
    assert len(repair) == 1  # the second request carried the bad reply and the repair message
    calls = assert_costed_by_override(priced, "extraction")
    assert [call.outcome for call in sorted(calls, key=lambda c: c.id)] == ["malformed_output"] * 2
    # The repair turn repeats the first prompt, so most of it is a cache read.
    assert max(call.cache_read_tokens for call in calls) > 0


@pytest.mark.parametrize("api", ["openai", "anthropic"])
def test_extraction_batch_calls_are_costed_by_the_override_at_half_price(priced, sim, api):
    put_page(priced)
    client = (
        OpenAIBatchClient(chat_client(sim)) if api == "openai" else AnthropicBatchClient(claude_client(sim))
    )
    counters = run_batch_extraction(priced, client, ExtractOptions(), poll_seconds=0.02)
    assert counters.batch_status in ("completed", "ended") and counters.llm_calls > 0
    assert_costed_by_override(priced, "extraction", batch=True)


# --- consolidation (the fact lifecycle's one batched call per entity) ------------------------------


def test_consolidation_calls_are_costed_by_the_override(priced, sim):
    llm = chat_client(sim)
    for page, body in ((JAN_PAGE, JAN_BODY), (MAR_PAGE, MAR_BODY)):
        put_page(priced, page, body)
        extract(priced, llm, page)
        consolidate(priced, llm)
    [call] = assert_costed_by_override(priced, "consolidation")  # the March page's ambiguous pairs
    assert call.outcome == "ok" and call.input_tokens > 0


# --- the one costing function, for the purposes with no batch path of their own ------------------


@pytest.mark.parametrize(
    "purpose",
    ["extraction", "compaction", "search_expansion", "search_embedding", "embedding", "consolidation"],
)
@pytest.mark.parametrize("batch", [False, True])
def test_the_ledger_costs_every_purpose_alike_online_and_batch(priced, purpose, batch):
    """Compaction, search and embeddings run online only today; a batch row of theirs would still be
    billed at half price by the same function, and an online one at full price."""
    ledger = Ledger(ConfigReader(priced, ttl=0).get)
    usage = Usage(input_tokens=3000, output_tokens=400, cache_read_tokens=1200, cache_write_tokens=800)
    with priced.begin() as session:
        ledger.record(session, LLMCallRecord(purpose, "openai", MODEL, usage, 50, "ok", batch=batch))
    [call] = assert_costed_by_override(priced, purpose, batch=batch)
    assert call.cost_usd == usd_by_hand(PRICE, (3000, 400, 1200, 800), batch=batch)
