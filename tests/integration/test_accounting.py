"""The `llm.prices` override costs every purpose's llm_calls rows: one test per purpose (and mode).

Each test sets the override for a model that also has a list price, makes that purpose call the
simulator under that model name, and checks every llm_calls row of the purpose against the override
(never the list price). A feature adds its purpose here as one more test using ``assert_costed_by_override``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from decimal import Decimal

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from models import LLMCall
from tests.integration.test_extraction import put_page
from worker.accounting import PRICES, cost_usd, parse_prices
from worker.config_store import set_config
from worker.extraction import ExtractOptions, run_batch_extraction, run_extract_conversation_facts
from worker.llm.batches import OpenAIBatchClient
from worker.llm.openai_compat import OpenAIChatClient
from worker.llm.types import Usage
from worker.simulator import Simulator, SimulatorConfig

pytestmark = pytest.mark.integration

# A model with a list price, so a row costed at list price is told apart from one costed by the override.
MODEL = "gpt-4o-mini"
OVERRIDE = json.dumps({MODEL: {"input": 1000, "output": 2000}})
assert MODEL in PRICES


@pytest.fixture(scope="module")
def sim() -> Iterator[Simulator]:
    """A simulator of our own with quick batches (the shared one keeps its default batch delay)."""
    with Simulator(SimulatorConfig(batch_delay_seconds=0.05)) as simulator:
        yield simulator


@pytest.fixture
def priced(tx_factory: sessionmaker[Session], sim: Simulator) -> sessionmaker[Session]:
    """A database with the price override set (and the simulator's counters reset)."""
    sim.configure(**SimulatorConfig(batch_delay_seconds=0.05).model_dump())
    sim.reset()
    with tx_factory.begin() as session:
        set_config(session, "llm.prices", OVERRIDE, updated_by="test")
    return tx_factory


def chat_client(sim: Simulator) -> OpenAIChatClient:
    return OpenAIChatClient(model=MODEL, base_url=sim.base_url, provider="simulator")


def assert_costed_by_override(factory: sessionmaker[Session], purpose: str, *, batch: bool = False) -> None:
    """Every llm_calls row of ``purpose`` costs what the override says (at the batch discount if batched)."""
    override = parse_prices(OVERRIDE)
    with factory() as session:
        calls = list(session.scalars(select(LLMCall).where(LLMCall.purpose == purpose)))
    assert calls, f"no llm_calls rows for {purpose!r}"
    for call in calls:
        assert call.model == MODEL
        usage = Usage(call.input_tokens, call.output_tokens, call.cache_read_tokens, call.cache_write_tokens)
        expected = cost_usd(MODEL, usage, override, batch=batch)
        assert expected > 0
        assert call.cost_usd == expected, (call.id, call.cost_usd, expected)
        assert call.cost_usd != cost_usd(MODEL, usage, PRICES, batch=batch)  # not the list price
    assert sum((call.cost_usd for call in calls), Decimal(0)) > 0


# --- extraction -----------------------------------------------------------------------------------


def test_extraction_online_calls_are_costed_by_the_override(priced, sim):
    put_page(priced)
    counters = run_extract_conversation_facts(priced, chat_client(sim), ExtractOptions())
    assert counters.llm_calls > 0
    assert_costed_by_override(priced, "extraction")


def test_extraction_batch_calls_are_costed_by_the_override(priced, sim):
    put_page(priced)
    counters = run_batch_extraction(
        priced, OpenAIBatchClient(chat_client(sim)), ExtractOptions(), poll_seconds=0.02
    )
    assert counters.batch_status == "completed" and counters.llm_calls > 0
    assert_costed_by_override(priced, "extraction", batch=True)
