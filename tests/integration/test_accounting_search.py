"""With an `llm.prices` override set, every LLM call is costed by it: here search's expansion, HyDE/vec
query embeddings and fact embeddings (each purpose records through the one Ledger). The expected USD is
worked out by hand from the override, as in test_accounting.py."""

from __future__ import annotations

import base64
import json
import logging
import struct
from typing import Any

import pytest
from sqlalchemy import insert, text
from sqlalchemy.orm import Session, sessionmaker

from models import Fact
from tests.conftest import TABLES
from tests.integration.test_accounting import usd_by_hand
from worker import db
from worker.accounting import PRICES_KEY, Ledger
from worker.config_store import ConfigReader, set_config
from worker.llm.errors import LLMError
from worker.llm.openai_compat import OpenAIChatClient
from worker.search import embed_facts, embed_new_facts, search

pytestmark = pytest.mark.integration

# Neither simulator model has a list price, so without the override every call would cost 0.
OVERRIDE = {
    "simulator-1": {"input": 1000, "output": 2000, "cache_read": 100, "cache_write": 1250},
    "simulator-embedding-1": {"input": 500, "output": 0, "cache_read": 50, "cache_write": 500},
}


def _sim_llm(simulator: Any) -> OpenAIChatClient:
    return OpenAIChatClient(
        model="simulator-1",
        base_url=simulator.base_url,
        provider="simulator",
        embedding_model="simulator-embedding-1",
    )


def _set_prices(factory: sessionmaker[Session]) -> None:
    with factory.begin() as session:
        set_config(session, PRICES_KEY, json.dumps(OVERRIDE))


def _assert_costed_by_the_override(factory: sessionmaker[Session], purpose: str) -> int:
    """Every llm_calls row of ``purpose`` costs what the override says; returns how many there are."""
    with factory() as session:
        rows = session.execute(
            text(
                "SELECT model, input_tokens, output_tokens, cache_read_tokens, cache_write_tokens, cost_usd, "
                "outcome FROM llm_calls WHERE purpose = :p"
            ),
            {"p": purpose},
        ).all()
    assert rows, f"no {purpose} call was recorded"
    for row in rows:
        tokens = (row.input_tokens, row.output_tokens, row.cache_read_tokens, row.cache_write_tokens)
        expected = usd_by_hand(OVERRIDE[row.model], tokens)
        assert row.outcome == "ok"
        assert expected > 0
        assert row.cost_usd == expected, (
            f"{purpose} call on {row.model} costed {row.cost_usd}, not {expected}"
        )
    return len(rows)


def _seed_facts(factory: sessionmaker[Session], page: str, facts: list[str]) -> None:
    rows = [
        {
            "source_id": "default",
            "fact": fact,
            "kind": "fact",
            "entity_slug": "bob",
            "confidence": 0.9,
            "notability": "medium",
            "context": "conversation segment 2024-04-02T18:00:00Z to 2024-04-02T18:25:00Z",
            "valid_from": None,
            "source": "cli:extract-conversation-facts",
            "source_session": f"cli:extract-conversation-facts:{page}",
            "source_markdown_slug": page,
            "row_num": row_num,
            "is_audit": False,
        }
        for row_num, fact in enumerate(facts)
    ]
    with factory.begin() as session:
        session.execute(insert(Fact), rows)


# Truncation: the vector store may be another database (the embedded pgserver, its own engine from a URL).
@pytest.fixture
def vector_factory(vector_database_url: str, factory: sessionmaker[Session]) -> sessionmaker[Session]:
    engine = db.get_engine(vector_database_url)
    with engine.begin() as conn:
        conn.execute(text(f"TRUNCATE {TABLES} RESTART IDENTITY CASCADE"))
    return sessionmaker(engine, expire_on_commit=False)


def test_search_expansion_is_costed_by_the_price_override(
    tx_factory: sessionmaker[Session], simulator: Any
) -> None:
    _set_prices(tx_factory)
    _seed_facts(tx_factory, "bob-chat", ["Bob adopted a greyhound named Pixel"])
    # An intent always expands.
    outcome = search(tx_factory, _sim_llm(simulator), "who has a dog", intent="pets")
    assert outcome.expanded
    assert _assert_costed_by_the_override(tx_factory, "search_expansion") == 1


def test_hyde_and_vec_embeddings_are_costed_by_the_price_override(
    vector_factory: sessionmaker[Session], simulator: Any
) -> None:
    _set_prices(vector_factory)
    llm = _sim_llm(simulator)
    _seed_facts(
        vector_factory, "bob-chat", ["Bob adopted a greyhound named Pixel", "Bob is allergic to peanuts"]
    )
    ledger = Ledger(ConfigReader(vector_factory, ttl=0).get)  # as the runtime passes its own
    embed_facts(vector_factory, llm, ledger=ledger)
    outcome = search(vector_factory, llm, "hyde: Bob has a pet dog\nvec: which pets", ledger=ledger)
    assert outcome.vector_search == "available"
    assert [line.type for line in outcome.lines] == ["hyde", "vec"]
    # Both lines are embedded in one call.
    assert _assert_costed_by_the_override(vector_factory, "search_embedding") == 1
    # A plain query's vec probe and its expansion's vec/hyde lines: one more embedding call.
    search(vector_factory, llm, "who has a dog", intent="pets")
    assert _assert_costed_by_the_override(vector_factory, "search_embedding") == 2
    assert _assert_costed_by_the_override(vector_factory, "search_expansion") == 1


def test_fact_embeddings_are_costed_by_the_price_override(
    tx_factory: sessionmaker[Session], simulator: Any
) -> None:
    _set_prices(tx_factory)
    llm = _sim_llm(simulator)
    _seed_facts(tx_factory, "bob-chat", ["Bob adopted a greyhound named Pixel", "Bob is allergic to peanuts"])
    report = embed_facts(tx_factory, llm, batch_size=1, set_up_vector_store=False)
    assert report.embedded == 2
    _seed_facts(tx_factory, "bob-later", ["Bob prefers aisle seats on long flights"])
    assert embed_new_facts(tx_factory, llm, "default", "bob-later") == 1
    assert _assert_costed_by_the_override(tx_factory, "embedding") == 3


def test_a_failed_record_never_fails_the_search(
    tx_factory: sessionmaker[Session], simulator: Any, caplog: pytest.LogCaptureFixture
) -> None:
    def broken_config(key: str) -> str | None:
        raise RuntimeError("config table unreachable")

    _seed_facts(tx_factory, "bob-chat", ["Bob adopted a greyhound named Pixel"])
    with caplog.at_level(logging.WARNING, logger="worker.search.calls"):
        outcome = search(
            tx_factory, _sim_llm(simulator), "who has a dog", intent="pets", ledger=Ledger(broken_config)
        )
    assert outcome.expanded
    assert "could not record a search_expansion LLM call" in caplog.text
    with tx_factory() as session:
        assert session.scalar(text("SELECT count(*) FROM llm_calls")) == 0


def test_an_embeddings_reply_of_the_wrong_shape_is_billed_as_the_embedding_model(
    tx_factory: sessionmaker[Session], sim: Any
) -> None:
    """An embeddings reply the provider billed but that could not be used (a NaN in a vector) was
    recorded with no tokens, under the chat model: it cost nothing in llm_calls and the budgets."""
    _set_prices(tx_factory)
    _seed_facts(tx_factory, "bob-chat", ["Bob adopted a greyhound named Pixel"])
    nan = base64.b64encode(struct.pack("<3f", 0.1, float("nan"), 0.3)).decode()
    sim.configure(
        raw_replies={"embeddings": {"data": [{"index": 0, "embedding": nan}], "usage": {"prompt_tokens": 9}}}
    )
    with pytest.raises(LLMError, match="NaN"):
        embed_facts(tx_factory, _sim_llm(sim), batch_size=1, set_up_vector_store=False)
    with tx_factory() as session:
        row = session.execute(
            text("SELECT model, outcome, input_tokens, cost_usd FROM llm_calls WHERE purpose = 'embedding'")
        ).one()
    assert (row.model, row.outcome, row.input_tokens) == ("simulator-embedding-1", "provider_error", 9)
    assert row.cost_usd == usd_by_hand(OVERRIDE["simulator-embedding-1"], (9, 0, 0, 0))
