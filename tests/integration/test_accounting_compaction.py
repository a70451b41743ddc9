"""One accounting path: with an `llm.prices` override set, compaction's llm_calls rows are costed by it
(the expected USD is worked out by hand from the override and each row's tokens, as in
test_accounting.py). The summarizer is the simulator, through the real SDK, asked for a listed model (it
answers as the model it is asked for)."""

from __future__ import annotations

import json
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
from worker.llm.openai_compat import OpenAIChatClient
from worker.llm.types import Usage
from worker.runtime import Runtime
from worker.settings import Settings

pytestmark = pytest.mark.integration

LISTED_MODEL = "gpt-4o-mini"  # has a list price, so a row costed at list prices would show it
OVERRIDE = json.dumps({LISTED_MODEL: PRICE})
PASS_ALL = ActiveThreshold(0.0, None)
# Window 6,000 and reserve 2,000: a compaction is due above 4,000 estimated tokens.
SETTINGS = {"context_window": 6000, "reserve_tokens": 2000, "keep_recent_tokens": 1500}


def listed_model(simulator: Any) -> OpenAIChatClient:
    """The simulator over the OpenAI SDK, asked for a listed model."""
    return OpenAIChatClient(model=LISTED_MODEL, base_url=simulator.base_url, provider="simulator")


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


def set_override(factory: sessionmaker[Session]) -> None:
    with factory.begin() as session:
        set_config(session, PRICES_KEY, OVERRIDE)


def assert_costed_by_the_override(factory: sessionmaker[Session]) -> None:
    """Every compaction row costs what the override makes of its tokens, which list prices would not."""
    with factory() as session:
        rows = session.execute(
            select(LLMCall.model, LLMCall.input_tokens, LLMCall.output_tokens, LLMCall.cost_usd).where(
                LLMCall.purpose == "compaction"
            )
        ).all()
    assert rows, "no compaction call was recorded"
    for model, input_tokens, output_tokens, cost in rows:
        assert model == LISTED_MODEL and input_tokens > 0 and output_tokens > 0
        assert cost == usd_by_hand(PRICE, (input_tokens, output_tokens, 0, 0)), rows
        assert cost != cost_usd(LISTED_MODEL, Usage(input_tokens, output_tokens))  # not the list price


def test_a_compaction_job_costs_its_llm_call_with_the_price_override(
    database_url: str, tx_factory: sessionmaker[Session], simulator: Any
) -> None:
    job_id = long_transcript(tx_factory, "priced-job")
    set_override(tx_factory)
    rt = Runtime(
        settings=Settings(database_url=database_url, threshold_cache_seconds=0),
        factory=tx_factory,
        config=ConfigReader(tx_factory, ttl=0),
        _llm=listed_model(simulator),
    )
    assert run_job(rt, job_id, jobs.COMPACTION).status == "succeeded"
    assert_costed_by_the_override(tx_factory)  # one row per summarizer attempt


def test_compact_transcript_without_a_ledger_still_applies_the_price_override(
    tx_factory: sessionmaker[Session], simulator: Any
) -> None:
    long_transcript(tx_factory, "priced-cli")
    set_override(tx_factory)
    llm = listed_model(simulator)
    outcome = compact_transcript(tx_factory, llm, "priced-cli", threshold=lambda: PASS_ALL)
    assert outcome.status == "accepted"
    assert_costed_by_the_override(tx_factory)
