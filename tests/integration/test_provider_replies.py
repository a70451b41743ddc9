"""Replies of the wrong shape, as odd OpenAI-compatible servers send them, through the real SDKs over HTTP
(the simulator answers a configured raw body): each is a clear, recorded provider error, never a crash
in a worker nor a database error at commit, and never quotes what the model wrote."""

from __future__ import annotations

import base64
import json
import struct
from decimal import Decimal
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from models import ExtractionAudit, Fact, LLMCall
from tests.integration.test_extraction import put_page
from worker.config_store import set_config
from worker.extraction import ExtractOptions, run_extract_conversation_facts
from worker.llm.anthropic_provider import AnthropicChatClient
from worker.llm.errors import LLMError
from worker.llm.openai_compat import OpenAIChatClient
from worker.llm.retry import RetryingClient, RetryPolicy
from worker.llm.types import ChatRequest
from worker.simulator import Simulator

pytestmark = pytest.mark.integration

REQUEST = ChatRequest(purpose="extraction", system="s", messages=(("user", "hi"),), max_tokens=100)
FACTS = '{"facts": [{"fact": "Alice moved to Lisbon", "kind": "event", "entity": "Alice Example"}]}'


def completion(content: Any = FACTS, **overrides: Any) -> dict[str, Any]:
    body = {
        "id": "chatcmpl-odd",
        "object": "chat.completion",
        "model": "odd-1",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}
        ],
        "usage": {"prompt_tokens": 10, "completion_tokens": 5},
    }
    body.update(overrides)
    return body


def openai_client(sim: Simulator) -> OpenAIChatClient:
    return OpenAIChatClient(model="odd-1", base_url=sim.base_url, provider="openai-compatible", api_key="x")


@pytest.mark.parametrize(
    ("reply", "named"),
    [
        (
            completion(usage={"prompt_tokens": "ten", "completion_tokens": 5}),
            "usage.prompt_tokens is a string",
        ),
        (
            completion(usage={"prompt_tokens": "99999999999", "completion_tokens": 5}),
            "usage.prompt_tokens is a string",
        ),
        (
            completion(usage={"prompt_tokens": "-10", "completion_tokens": 5}),
            "usage.prompt_tokens is a string",
        ),
        (completion(usage={"prompt_tokens": -10, "completion_tokens": 5}), "usage.prompt_tokens is -10"),
        (completion(usage={"prompt_tokens": 10, "completion_tokens": 2**31}), "usage.completion_tokens is"),
        (completion(usage={"prompt_tokens": 10.5}), "usage.prompt_tokens is 10.5"),
        (
            completion(usage={"prompt_tokens": 1, "prompt_tokens_details": {"cached_tokens": [1]}}),
            "cached_tokens is a list",
        ),
        (completion(content={"facts": [{"fact": "Alice moved to Lisbon"}]}), "content is an object"),
        (completion(content=[{"type": "text", "text": 5}]), "content holds an object"),
        (completion(model={"name": "odd"}), "model is an object"),
    ],
)
def test_a_chat_reply_of_the_wrong_shape_is_a_provider_error_naming_the_field(sim, reply, named):
    sim.configure(raw_replies={"chat.completions": reply})
    with pytest.raises(LLMError) as caught:
        openai_client(sim).chat(REQUEST)
    assert not caught.value.retryable  # the same server answers the same way
    assert "not a chat completion" in str(caught.value) and named in str(caught.value)
    assert "Lisbon" not in str(caught.value)  # stored and logged: never what the model wrote


def test_token_counts_sent_as_digit_strings_are_read(sim):
    """Some gateways quote their usage counts; the reply is sound otherwise, and refusing it failed the
    segment for its bookkeeping alone."""
    usage = {"prompt_tokens": "10", "completion_tokens": "5", "prompt_tokens_details": {"cached_tokens": "4"}}
    sim.configure(raw_replies={"chat.completions": completion(usage=usage)})
    response = openai_client(sim).chat(REQUEST)
    assert (response.usage.input_tokens, response.usage.output_tokens) == (10, 5)
    assert response.usage.cache_read_tokens == 4 and response.text == FACTS


def test_content_sent_as_text_parts_is_read(sim):
    parts = [
        {"type": "text", "text": FACTS[:20]},
        {"type": "image_url"},
        {"type": "text", "text": FACTS[20:]},
    ]
    sim.configure(raw_replies={"chat.completions": completion(content=parts)})
    response = openai_client(sim).chat(REQUEST)
    assert response.text == FACTS and response.usage.input_tokens == 10 and response.model == "odd-1"


def test_an_embedding_holding_nan_or_too_few_vectors_is_a_provider_error(sim):
    nan = base64.b64encode(struct.pack("<3f", 0.1, float("nan"), 0.3)).decode()
    sim.configure(raw_replies={"embeddings": {"data": [{"index": 0, "embedding": nan}], "usage": {}}})
    with pytest.raises(LLMError, match="a NaN, an infinity"):
        openai_client(sim).embed(["one"])
    # Finite as JSON's float64, past the float4 pgvector stores: the store's error was a 500.
    past = {"data": [{"index": 0, "embedding": [0.1, 1e39, 0.3]}], "usage": {}}
    sim.configure(raw_replies={"embeddings": past})
    with pytest.raises(LLMError, match="past float32's range"):
        openai_client(sim).embed(["one"])
    one = base64.b64encode(struct.pack("<3f", 0.1, 0.2, 0.3)).decode()
    sim.configure(raw_replies={"embeddings": {"data": [{"index": 0, "embedding": one}], "usage": {}}})
    with pytest.raises(LLMError, match="1 embeddings came back for 2 texts"):
        openai_client(sim).embed(["one", "two"])
    sim.configure(raw_replies={"embeddings": {"data": [{"index": 0, "embedding": one}]}})
    assert openai_client(sim).embed(["one"]).vectors == [pytest.approx([0.1, 0.2, 0.3])]


def test_an_anthropic_reply_of_the_wrong_shape_is_a_provider_error(sim):
    message = {
        "id": "msg_odd",
        "type": "message",
        "role": "assistant",
        "model": "odd-1",
        "content": [{"type": "text", "text": FACTS}],
        "stop_reason": "end_turn",
        "usage": {"input_tokens": "ten", "output_tokens": 5},
    }
    sim.configure(raw_replies={"messages": message})
    client = AnthropicChatClient(model="odd-1", base_url=sim.url, provider="anthropic", api_key="x")
    with pytest.raises(LLMError, match=r"not a message \(usage.input_tokens is a string"):
        client.chat(REQUEST)
    sim.configure(raw_replies={"messages": {**message, "usage": {"input_tokens": 10, "output_tokens": 5}}})
    assert client.chat(REQUEST).text == FACTS


def test_an_extraction_records_the_odd_reply_and_goes_on(tx_factory: sessionmaker[Session], sim):
    """A count the database cannot hold failed the segment's transaction (and every retry of it) with a
    database error; now the segment's audit row and llm_calls row say what the provider sent."""
    with tx_factory.begin() as session:
        set_config(session, "facts.extraction_enabled", "true")
    put_page(tx_factory)
    sim.configure(raw_replies={"chat.completions": completion(usage={"prompt_tokens": 2**40})})
    counters = run_extract_conversation_facts(tx_factory, openai_client(sim), ExtractOptions())
    assert counters.facts_inserted == 0 and counters.segments_failed >= 1
    with tx_factory() as session:
        outcomes = set(session.scalars(select(ExtractionAudit.outcome)))
        errors = session.scalars(select(LLMCall.error)).all()
    assert outcomes == {"provider_error"}
    assert errors and all(
        "usage.prompt_tokens is 1099511627776, not a token count" in (e or "") for e in errors
    )


def test_a_reply_of_the_wrong_shape_is_still_billed_for_what_it_counted(
    tx_factory: sessionmaker[Session], sim
):
    """The provider answered (and billed) a reply whose content could not be used: the failure was
    recorded with no usage, so the call cost nothing in llm_calls and the budgets."""
    with tx_factory.begin() as session:
        set_config(session, "facts.extraction_enabled", "true")
        set_config(session, "llm.prices", '{"odd-1": {"input": 10, "output": 20}}')
    put_page(tx_factory)
    sim.configure(raw_replies={"chat.completions": completion(content={"not": "text"})})
    with pytest.raises(LLMError) as caught:
        openai_client(sim).chat(REQUEST)
    assert (caught.value.usage.input_tokens, caught.value.usage.output_tokens) == (10, 5)  # type: ignore[union-attr]
    counters = run_extract_conversation_facts(tx_factory, openai_client(sim), ExtractOptions())
    with tx_factory() as session:
        calls = session.execute(select(LLMCall.outcome, LLMCall.input_tokens, LLMCall.cost_usd)).all()
    assert calls and all(
        outcome == "provider_error" and tokens == 10 and cost > 0 for outcome, tokens, cost in calls
    ), calls
    assert counters.input_tokens == 10 * len(calls), "the run's totals count them as llm_calls does"


def test_each_retried_error_in_a_200_reply_is_billed_for_what_it_counted(
    tx_factory: sessionmaker[Session], sim
):
    """A gateway's 200 naming an upstream 502 (OpenRouter's shape), with the usage it billed: the tries
    the gateway retried were recorded with no usage (0 tokens, no cost), only the last one with it."""
    with tx_factory.begin() as session:
        set_config(session, "facts.extraction_enabled", "true")
        set_config(session, "llm.prices", '{"odd-1": {"input": 10, "output": 20}}')
    put_page(tx_factory)
    failed = {
        "error": {"code": 502, "message": "upstream said no"},
        "usage": {"prompt_tokens": 10, "completion_tokens": 5},
    }
    sim.configure(raw_replies={"chat.completions": failed})
    waits: list[float] = []

    def answered_from_the_third_try(seconds: float) -> None:
        waits.append(seconds)
        if len(waits) == 2:
            sim.configure(raw_replies={"chat.completions": completion()})

    client = RetryingClient(
        openai_client(sim), RetryPolicy(max_attempts=5), sleep=answered_from_the_third_try
    )
    assert run_extract_conversation_facts(tx_factory, client, ExtractOptions()).facts_inserted > 0
    with tx_factory() as session:
        calls = session.execute(select(LLMCall.outcome, LLMCall.input_tokens, LLMCall.cost_usd)).all()
    failed = [(tokens, cost) for outcome, tokens, cost in calls if outcome == "provider_error"]
    assert len(failed) == 2 and all(tokens == 10 and cost > 0 for tokens, cost in failed), calls


def test_a_billed_failure_counts_tokens_as_a_good_reply_does() -> None:
    """Anthropic's input_tokens leaves out the cached parts: a reply of the wrong shape is counted with
    them, as a good reply is (and OpenAI's cached tokens are broken out), or its cost is wrong."""
    from types import SimpleNamespace

    from worker.llm import anthropic_provider, openai_compat

    usage = SimpleNamespace(
        input_tokens=12, output_tokens=3, cache_read_input_tokens=5000, cache_creation_input_tokens=0
    )
    billed = anthropic_provider._billed(SimpleNamespace(usage=usage))
    assert billed is not None and (billed.input_tokens, billed.cache_read_tokens) == (5012, 5000)
    completion = {
        "usage": {
            "prompt_tokens": 100,
            "completion_tokens": 2,
            "prompt_tokens_details": {"cached_tokens": 80},
        }
    }
    openai_billed = openai_compat._billed(completion)
    assert openai_billed is not None and (openai_billed.input_tokens, openai_billed.cache_read_tokens) == (
        100,
        80,
    )
    assert anthropic_provider._billed(SimpleNamespace()) is None  # nothing readable: nothing billed


def test_a_call_at_the_largest_counts_and_price_is_costed_and_committed(tx_factory, sim):
    """2^31-1 tokens each way at the highest price llm.prices takes: $42.9 million, which llm_calls
    holds (its numeric(12, 6) did not: the segment's commit failed on every retry)."""
    top = 2**31 - 1
    with tx_factory.begin() as session:
        set_config(session, "facts.extraction_enabled", "true")
        set_config(session, "llm.prices", json.dumps({"odd-1": {"input": 10_000, "output": 10_000}}))
    put_page(tx_factory)
    usage = {"prompt_tokens": top, "completion_tokens": top}
    sim.configure(raw_replies={"chat.completions": completion(usage=usage)})
    counters = run_extract_conversation_facts(tx_factory, openai_client(sim), ExtractOptions())
    assert counters.segments_failed == 0 and counters.facts_inserted > 0
    with tx_factory() as session:
        costs = session.scalars(select(LLMCall.cost_usd)).all()
    assert costs and set(costs) == {Decimal(2 * top * 10_000) / 1_000_000}


def test_a_nul_from_the_model_or_the_provider_never_fails_a_commit(tx_factory, sim):
    """Postgres stores no NUL: a fact holding one (an escape in the model's JSON), or a provider error
    quoting one, failed the segment's transaction at commit on every retry. The fact is stored without
    it, the error recorded without it."""
    with tx_factory.begin() as session:
        set_config(session, "facts.extraction_enabled", "true")
    put_page(tx_factory)
    content = FACTS.replace("Lisbon", "Lisbon\\u0000")
    sim.configure(raw_replies={"chat.completions": completion(content=content)})
    counters = run_extract_conversation_facts(tx_factory, openai_client(sim), ExtractOptions())
    assert counters.segments_failed == 0 and counters.facts_inserted > 0
    with tx_factory() as session:
        assert set(session.scalars(select(Fact.fact).where(Fact.row_num >= 0))) == {"Alice moved to Lisbon"}

    put_page(tx_factory, slug="conversations/other")
    error = {"error": {"message": "bad\u0000 request", "type": "invalid_request_error"}}
    sim.configure(raw_replies={"chat.completions": error}, raw_status=400)
    failed = run_extract_conversation_facts(tx_factory, openai_client(sim), ExtractOptions())
    assert failed.segments_failed >= 1
    with tx_factory() as session:
        errors = set(session.scalars(select(LLMCall.error).where(LLMCall.error.is_not(None))))
    assert errors == {"HTTP 400: bad request"}


def test_a_fact_of_a_megabyte_is_clipped_and_committed(tx_factory, sim):
    """1.3 MB of distinct words in one fact made a search vector past Postgres's 1 MB tsvector limit:
    the segment's commit failed (ProgramLimitExceeded) on every retry."""
    with tx_factory.begin() as session:
        set_config(session, "facts.extraction_enabled", "true")
    put_page(tx_factory)
    huge = " ".join(f"word{n}" for n in range(130_000))
    content = json.dumps({"facts": [{"fact": huge, "kind": "fact", "entity": "Alice Example"}]})
    sim.configure(raw_replies={"chat.completions": completion(content=content)})
    counters = run_extract_conversation_facts(tx_factory, openai_client(sim), ExtractOptions())
    assert counters.segments_failed == 0 and counters.facts_inserted > 0
    with tx_factory() as session:
        stored = set(session.scalars(select(Fact.fact).where(Fact.row_num >= 0)))
    assert {len(fact) for fact in stored} == {2_000}


def test_a_provider_error_message_is_kept_to_a_thousand_characters(sim):
    """A server answering an error with a whole page (or echoing the request) put all of it in every
    llm_calls row, audit row, job error and log line of the call."""
    sim.configure(raw_replies={"chat.completions": {"error": {"message": "x" * 100_000}}}, raw_status=400)
    with pytest.raises(LLMError) as caught:
        openai_client(sim).chat(REQUEST)
    assert str(caught.value) == "HTTP 400: " + "x" * 999 + "…"
    assert not caught.value.retryable


@pytest.mark.parametrize(
    ("error", "retryable", "status"),
    [
        ({"code": 502, "message": "upstream overloaded"}, True, 502),
        ({"code": 429, "message": "rate limited upstream"}, True, 429),
        ({"code": 400, "message": "bad request upstream"}, False, 400),
        ({"code": "503", "message": "upstream down"}, True, 503),
        ({"code": "server_error", "message": "the model stopped"}, True, None),
        ({"code": "context_length_exceeded", "message": "too long"}, False, None),
        ({"message": "no code at all"}, False, None),
        ({"code": 402, "message": "insufficient credits"}, False, 402),
    ],
)
def test_an_error_answered_with_a_200_is_classified_as_its_code_says(sim, error, retryable, status):
    """OpenRouter (and other gateways) answer an error met once the model began with HTTP 200 and
    {"error": {...}}: it was "not a chat completion (KeyError: 'choices')", permanent, the provider's
    words lost, an upstream 502 or 429 never tried again. Its log line names no words (they may quote
    the request), and what the reply billed is kept."""
    body = {"error": error, "usage": {"prompt_tokens": 7, "completion_tokens": 3}}
    sim.configure(raw_replies={"chat.completions": body}, raw_status=200)
    with pytest.raises(LLMError) as caught:
        openai_client(sim).chat(REQUEST)
    assert caught.value.retryable is retryable and caught.value.status == status
    assert error["message"] in str(caught.value) and error["message"] not in caught.value.log_text
    assert caught.value.deployment_fault is (status == 402)
    assert caught.value.usage is not None and caught.value.usage.input_tokens == 7


def test_an_error_in_a_200_reply_with_no_usage_bills_nothing_and_embeddings_read_it_too(sim):
    """With no usage in the body, the reply billed zero tokens: read as a zero usage (not "unknown"), the
    shared tokens-per-minute limit kept each try's whole output cap charged. And an embeddings reply
    holding the error was "not an embeddings list": final, unretried, its words and status lost."""
    sim.configure(raw_replies={"chat.completions": {"error": {"code": 429, "message": "slow down"}}})
    with pytest.raises(LLMError) as caught:
        openai_client(sim).chat(REQUEST)
    assert caught.value.status == 429 and caught.value.usage is None
    sim.configure(raw_replies={"embeddings": {"error": {"code": 502, "message": "upstream said no"}}})
    with pytest.raises(LLMError) as embedding:
        openai_client(sim).embed(["x"])
    assert embedding.value.retryable and embedding.value.status == 502
    assert "upstream said no" in str(embedding.value) and embedding.value.answered_by is not None
    sim.configure(raw_replies={"embeddings": {"error": {"code": 401, "message": "bad key"}}})
    with pytest.raises(LLMError) as refused:
        openai_client(sim).embed(["x"])
    assert not refused.value.retryable and refused.value.status == 401


def test_a_call_answered_by_a_dated_snapshot_is_costed_at_its_models_price(tx_factory, sim):
    """OpenAI answers a call to gpt-4o-mini with model "gpt-4o-mini-2024-07-18" (Anthropic names the
    snapshot behind "-latest" the same way). Costed by that exact name, every real provider call cost 0,
    and no budget ever tripped; the simulator echoes the model asked for, so no test saw it."""
    with tx_factory.begin() as session:
        set_config(session, "facts.extraction_enabled", "true")
    put_page(tx_factory)
    usage = {"prompt_tokens": 1_000_000, "completion_tokens": 1_000_000}
    sim.configure(raw_replies={"chat.completions": completion(model="gpt-4o-mini-2024-07-18", usage=usage)})
    counters = run_extract_conversation_facts(tx_factory, openai_client(sim), ExtractOptions())
    assert counters.segments_failed == 0 and counters.facts_inserted > 0
    with tx_factory() as session:
        calls = session.execute(select(LLMCall.model, LLMCall.cost_usd)).all()
    # The list price of gpt-4o-mini: $0.15 a million input tokens, $0.60 a million output tokens.
    assert calls and set(calls) == {("gpt-4o-mini-2024-07-18", Decimal("0.75"))}


def test_a_snapshot_takes_its_own_price_else_its_models_else_the_latest_alias():
    from worker.accounting.prices import PRICES, Price, price_of

    own = Price(Decimal(1), Decimal(2), Decimal(0), Decimal(0))
    assert price_of("gpt-4o-2024-08-06") == PRICES["gpt-4o"]
    assert price_of("claude-3-5-haiku-20241022") == PRICES["claude-3-5-haiku-latest"]
    assert price_of("gpt-4o-2024-08-06", {**PRICES, "gpt-4o-2024-08-06": own}) == own
    assert price_of("unknown-2024-01-01") is None and price_of("gpt-4o-mini-turbo") is None
