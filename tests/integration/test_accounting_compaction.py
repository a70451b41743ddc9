"""One accounting path: with an `llm.prices` override set, compaction's llm_calls rows are costed by it
(the expected USD is worked out by hand from the override, as in test_accounting.py)."""

from __future__ import annotations

import json
from decimal import Decimal
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from models import LLMCall
from tests.integration.test_accounting import PRICE, usd_by_hand
from worker.accounting import PRICES_KEY, cost_usd
from worker.calibration import ActiveThreshold
from worker.compaction import append_messages, compact_transcript, parse_messages
from worker.config_store import ConfigReader, set_config
from worker.jobs import outbox as jobs
from worker.jobs.lifecycle import run_job
from worker.llm.types import ChatRequest, ChatResponse, EmbeddingResponse, Usage
from worker.runtime import Runtime
from worker.settings import Settings

pytestmark = pytest.mark.integration

LISTED_MODEL = "gpt-4o-mini"  # has a list price, so a row costed at list prices would show it
OVERRIDE = json.dumps({LISTED_MODEL: PRICE})
USAGE = Usage(input_tokens=100, output_tokens=20)
PASS_ALL = ActiveThreshold(0.0, None)
# Window 6,000 and reserve 2,000: a compaction is due above 4,000 estimated tokens.
SETTINGS = {"context_window": 6000, "reserve_tokens": 2000, "keep_recent_tokens": 1500}


class ListedModelLLM:
    """Answers every summarizer call with the same short summary, as a listed model."""

    provider = "openai"
    model = LISTED_MODEL

    def chat(self, request: ChatRequest) -> ChatResponse:
        return ChatResponse("## Goal\nKeep the disk clean.", "end", USAGE, self.provider, self.model, 5)

    def embed(self, texts: list[str], *, purpose: str = "embedding") -> EmbeddingResponse:
        raise NotImplementedError


def long_transcript(factory: sessionmaker[Session], transcript_id: str) -> int:
    """A transcript past its threshold; the id of the compaction job it requested."""
    raw: list[dict[str, Any]] = []
    for i in range(25):
        raw.append({"role": "user", "text": f"Check volume {i} and clean its logs. " * 20})
        raw.append({"role": "assistant", "text": f"Volume {i} is clean; the logs were rotated. " * 20})
    with factory.begin() as session:
        result = append_messages(session, transcript_id, parse_messages(raw), settings=SETTINGS)
    assert result.trigger.job is not None
    return result.trigger.job.job_id


def set_override(factory: sessionmaker[Session]) -> Decimal:
    """Set the `llm.prices` override; the cost of one call under it (which list prices would not give)."""
    with factory.begin() as session:
        set_config(session, PRICES_KEY, OVERRIDE)
    expected = usd_by_hand(PRICE, (USAGE.input_tokens, USAGE.output_tokens, 0, 0))
    assert expected == Decimal("0.14")  # 100 input tokens at 0.001 + 20 output tokens at 0.002
    assert expected != cost_usd(LISTED_MODEL, USAGE)  # not the list price
    return expected


def compaction_costs(factory: sessionmaker[Session]) -> list[Decimal]:
    with factory() as session:
        return list(
            session.scalars(
                select(LLMCall.cost_usd).where(LLMCall.purpose == "compaction").order_by(LLMCall.id)
            )
        )


def test_a_compaction_job_costs_its_llm_call_with_the_price_override(
    database_url: str, tx_factory: sessionmaker[Session]
) -> None:
    job_id = long_transcript(tx_factory, "priced-job")
    expected = set_override(tx_factory)
    rt = Runtime(
        settings=Settings(database_url=database_url, threshold_cache_seconds=0),
        factory=tx_factory,
        config=ConfigReader(tx_factory, ttl=0),
        _llm=ListedModelLLM(),
    )
    assert run_job(rt, job_id, jobs.COMPACTION).status == "succeeded"
    costs = compaction_costs(tx_factory)
    assert costs and costs == [expected] * len(costs)  # one row per summarizer attempt


def test_compact_transcript_without_a_ledger_still_applies_the_price_override(
    tx_factory: sessionmaker[Session],
) -> None:
    long_transcript(tx_factory, "priced-cli")
    expected = set_override(tx_factory)
    outcome = compact_transcript(tx_factory, ListedModelLLM(), "priced-cli", threshold=lambda: PASS_ALL)
    assert outcome.status == "accepted"
    assert compaction_costs(tx_factory) == [expected]
