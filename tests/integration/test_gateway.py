"""The LLM gateway through the real openai and anthropic SDKs over HTTP against the simulator.

Faults are injected by the simulator (a forcing header or seeded rates), never by patching an SDK.
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from models import ExtractionAudit, Fact, LLMCall
from tests.service import SessionBroker
from worker.core.facts import extraction_system_prompt, facts_json_schema, segment_user_message
from worker.extraction import ExtractOptions, run_extract_conversation_facts
from worker.extraction.pages import PageIn, upsert_page
from worker.extraction.rows import SKIPPED
from worker.llm.anthropic_provider import AnthropicChatClient
from worker.llm.between_tries import CallDeadlineError
from worker.llm.deadline import call_deadline
from worker.llm.errors import LLMError
from worker.llm.gateway import open_llm_client
from worker.llm.openai_compat import OpenAIChatClient
from worker.llm.ratelimit import LocalRateLimiter, RateLimitedClient, RateLimits, RedisRateLimiter
from worker.llm.retry import AttemptRecord, RetryingClient, RetryPolicy
from worker.llm.types import ChatRequest, LLMClient
from worker.settings import Settings
from worker.simulator import Simulator, SimulatorConfig, embed_text

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
APIS = ["openai", "anthropic"]
SEGMENT = (
    "Page: imessage: Alice Example\n"
    "Conversation between Alice Example and Bob Demo from 2024-03-15T09:00:00Z to 2024-03-15T09:02:00Z\n"
    "---\n"
    "Alice Example (2024-03-15T09:00:00Z): Hi, I just signed the offer letter for Acme Corp.\n"
    "Bob Demo (2024-03-15T09:01:00Z): Congrats! What's the title?\n"
    "Alice Example (2024-03-15T09:02:00Z): Staff engineer. I will start on April 1st."
)
FAST = RetryPolicy(
    max_attempts=4, max_total_wait_seconds=10, backoff_base_seconds=0.01, backoff_max_seconds=0.05
)


def facts_request(segment: str = SEGMENT, max_tokens: int = 1024) -> ChatRequest:
    return ChatRequest(
        purpose="extraction",
        system=extraction_system_prompt(10),
        messages=(("user", segment_user_message(segment)),),
        max_tokens=max_tokens,
        json_schema=facts_json_schema(10),
        schema_name="facts",
        cache_key="factmill-extraction-v1-10",
    )


def provider(api: str, sim: Simulator, *, timeout: float = 10.0, fault: str | None = None) -> LLMClient:
    """A bare provider (no retries) speaking to ``sim`` through the SDK ``api`` names."""
    headers = {"x-simulator-fault": fault} if fault else None
    if api == "openai":
        return OpenAIChatClient(
            model="simulator-1",
            base_url=sim.base_url,
            timeout=timeout,
            provider="simulator",
            default_headers=headers,
            embedding_model="simulator-embedding-1",
        )
    return AnthropicChatClient(
        model="simulator-1",
        base_url=sim.anthropic_base_url,
        timeout=timeout,
        provider="simulator",
        default_headers=headers,
    )


def settled_stats(sim: Simulator, expected_requests: int, timeout: float = 5.0) -> dict[str, Any]:
    """Stats once ``expected_requests`` were recorded: a hung request is counted when the simulator
    notices the client hung up, a moment after the client raised."""
    deadline = time.monotonic() + timeout
    while True:
        stats = sim.stats()
        if stats["requests_total"] >= expected_requests or time.monotonic() > deadline:
            time.sleep(0.1)  # anything beyond the expectation would show up by now
            return sim.stats()
        time.sleep(0.02)


# --------------------------------------------------------------------------------------------------
# Each fault class through each SDK
# --------------------------------------------------------------------------------------------------

TRANSPORT_FAULTS = ["429", "500", "529", "timeout"]
EXPECTED_STATUS = {
    ("openai", "429"): 429,
    ("openai", "500"): 500,
    ("openai", "529"): 503,  # the OpenAI routes answer overload with 503
    ("anthropic", "429"): 429,
    ("anthropic", "500"): 500,
    ("anthropic", "529"): 529,
}


def answer_within(fault: str) -> float:
    """The client's timeout: short for the fault that hangs, long for those answered at once (a loaded
    two-core machine can take more than 0.3 s to answer them)."""
    return 0.3 if fault == "timeout" else 30.0


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("fault", TRANSPORT_FAULTS)
def test_transport_faults_are_retried_until_the_attempts_run_out(
    sim: Simulator, api: str, fault: str
) -> None:
    sim.configure(hang_seconds=2.0, retry_after_seconds=0.05)
    client = RetryingClient(provider(api, sim, timeout=answer_within(fault), fault=fault), FAST)
    with pytest.raises(LLMError) as caught:
        client.chat(facts_request())
    error = caught.value
    assert error.retryable
    assert error.status == EXPECTED_STATUS.get((api, fault))
    if fault == "timeout":
        assert "timed out" in str(error)
    assert [a.number for a in error.attempts] == [1, 2, 3, 4]
    assert all(a.error is not None for a in error.attempts)
    assert [a.retry_in_seconds is not None for a in error.attempts] == [True, True, True, False]
    stats = settled_stats(sim, 4)
    assert stats["by_outcome"] == {fault: 4}, stats["by_outcome"]


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("fault", TRANSPORT_FAULTS)
def test_the_sdks_own_retries_are_off(sim: Simulator, api: str, fault: str) -> None:
    sim.configure(hang_seconds=2.0, retry_after_seconds=0.05)
    client = RetryingClient(
        provider(api, sim, timeout=answer_within(fault), fault=fault), RetryPolicy(max_attempts=1)
    )
    with pytest.raises(LLMError) as caught:
        client.chat(facts_request())
    assert len(caught.value.attempts) == 1
    stats = settled_stats(sim, 1)
    assert stats["requests_total"] == 1 and stats["by_outcome"] == {fault: 1}


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("fault", TRANSPORT_FAULTS)
def test_a_transient_fault_is_retried_and_the_call_succeeds(sim: Simulator, api: str, fault: str) -> None:
    rate = {"429": "rate_429", "500": "rate_500", "529": "rate_529", "timeout": "rate_timeout"}[fault]
    sim.configure(hang_seconds=2.0, retry_after_seconds=0.05, **{rate: 1.0})
    seen: list[AttemptRecord] = []

    def heal(record: AttemptRecord) -> None:
        seen.append(record)
        sim.configure(**{rate: 0.0})  # the provider recovers after the first failure

    client = RetryingClient(provider(api, sim, timeout=answer_within(fault)), FAST, on_attempt=heal)
    traced = client.chat_traced(facts_request())
    assert traced.value.finish == "end" and json.loads(traced.value.text)["facts"]
    assert [a.ok for a in traced.attempts] == [False, True]
    assert [a.ok for a in seen] == [False, True]
    assert settled_stats(sim, 2)["by_outcome"] == {fault: 1, "ok": 1}


@pytest.mark.parametrize("api", APIS)
def test_retry_after_is_honoured(sim: Simulator, api: str) -> None:
    sim.configure(retry_after_seconds=0.4)  # sent as retry-after-ms: 400 (and Retry-After: 1)
    policy = RetryPolicy(max_attempts=3, max_total_wait_seconds=30, backoff_base_seconds=0.001)
    client = RetryingClient(provider(api, sim, fault="429"), policy)
    started = time.perf_counter()
    with pytest.raises(LLMError) as caught:
        client.chat(facts_request())
    elapsed = time.perf_counter() - started
    assert caught.value.status == 429 and caught.value.retry_after == pytest.approx(0.4)
    assert [a.retry_in_seconds for a in caught.value.attempts][:2] == [
        pytest.approx(0.4, abs=0.01),
        pytest.approx(0.4, abs=0.01),
    ]
    assert elapsed >= 0.8  # two waits of at least Retry-After each (no upper bound: CI machines vary)
    assert sim.stats()["by_outcome"] == {"429": 3}


@pytest.mark.parametrize("api", APIS)
def test_a_call_allowing_more_output_is_given_more_time_to_answer(sim: Simulator, api: str) -> None:
    """One timeout for every call: a reply arrives whole, so the truncation retry's 8,192 tokens (at
    60-100 a second) timed out at 60 s every time. FACTMILL_LLM_TIMEOUT_SECONDS holds for up to 2,048
    output tokens; a call allowing more gets proportionally more. Connecting has its own, short, limit."""
    from worker.llm.types import CONNECT_TIMEOUT_SECONDS, REPLY_TOKENS_PER_TIMEOUT

    sim.configure(latency_ms=1_500)
    client = provider(api, sim, timeout=1.0)
    with pytest.raises(LLMError, match="timed out"):
        client.chat(facts_request(max_tokens=REPLY_TOKENS_PER_TIMEOUT))  # 1 s for a 1.5 s answer
    answered = client.chat(facts_request(max_tokens=4 * REPLY_TOKENS_PER_TIMEOUT))  # 4 s
    assert answered.finish == "end"
    timeout = client.sdk.timeout  # type: ignore[attr-defined]
    assert (timeout.read, timeout.connect) == (1.0, 1.0)
    assert provider(api, sim, timeout=60.0).sdk.timeout.connect == CONNECT_TIMEOUT_SECONDS  # type: ignore[attr-defined]


@pytest.mark.parametrize("api", APIS)
def test_a_retry_after_past_the_remaining_total_wait_ends_the_tries(sim: Simulator, api: str) -> None:
    """Both SDKs' Retry-After reaches the policy: asked for 30 s with 0.3 s of budget, the call gives up
    at once (it slept the whole budget, then tried once more, 29.7 s before the provider said)."""
    sim.configure(retry_after_seconds=30)
    policy = RetryPolicy(max_attempts=5, max_total_wait_seconds=0.3, backoff_base_seconds=0.001)
    client = RetryingClient(provider(api, sim, fault="429"), policy)
    with pytest.raises(LLMError) as caught:
        client.chat(facts_request())
    assert caught.value.retry_after == pytest.approx(30)
    assert [a.retry_in_seconds for a in caught.value.attempts] == [None]
    assert sim.stats()["by_outcome"] == {"429": 1}


@pytest.mark.parametrize("api", APIS)
def test_client_errors_fail_fast_with_the_providers_message(sim: Simulator, api: str) -> None:
    client = RetryingClient(provider(api, sim, fault="teapot"), FAST)
    with pytest.raises(LLMError) as caught:
        client.chat(facts_request())
    error = caught.value
    assert not error.retryable and error.status == 400
    assert "x-simulator-fault must be one of" in str(error)  # the provider's words, not a stack trace
    assert len(error.attempts) == 1
    assert sim.stats()["by_outcome"] == {"invalid_request": 1}


@pytest.mark.parametrize("api", APIS)
def test_content_faults_are_answers_not_retries(sim: Simulator, api: str) -> None:
    """Malformed, truncated and refused replies come back as responses: extraction decides (repair,
    a bigger cap, or a recorded refusal), the transport retry layer never repeats them."""
    seen: list[AttemptRecord] = []
    for fault in ("malformed", "truncated", "refusal"):
        client = RetryingClient(provider(api, sim, fault=fault), FAST, on_attempt=seen.append)
        response = client.chat(facts_request())
        if fault == "malformed":
            assert response.finish == "end"
            if api == "anthropic":  # the tool's input is JSON; its facts are the prose, not a list
                assert isinstance(json.loads(response.text)["facts"], str)
            else:  # prose around cut-off JSON
                with pytest.raises(json.JSONDecodeError):
                    json.loads(response.text)
        elif fault == "truncated":
            assert response.finish == "truncated"
        else:
            assert response.finish == "refusal" and response.refusal
            assert response.text == ""
    assert [a.number for a in seen] == [1, 1, 1]
    assert sim.stats()["by_outcome"] == {"malformed": 1, "truncated": 1, "refusal": 1}


class _FixedReplies:
    """An OpenAI-compatible server that answers each POST with the next of ``replies`` (any route)."""

    def __init__(self, replies: list[Any]) -> None:
        replies = list(replies)

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", "0")))
                body = json.dumps(replies.pop(0)).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize(
    "reply",
    [{"id": "x", "object": "chat.completion"}, {"choices": []}, {"choices": [{"index": 0}]}, [1, 2]],
)
def test_a_reply_that_is_not_a_chat_completion_fails_clearly(reply: object) -> None:
    """A server speaking the format badly (an OpenAI-compatible one) answers 200 with JSON that is not a
    chat completion: a clear, non-retryable LLMError, never an AttributeError from deep in the client."""
    server = _FixedReplies([reply])
    try:
        client = OpenAIChatClient(model="m", provider="openai-compatible", base_url=server.base_url)
        with pytest.raises(LLMError, match="not a chat completion") as raised:
            client.chat(facts_request())
        assert not raised.value.retryable
    finally:
        server.close()


# --------------------------------------------------------------------------------------------------
# Providers: JSON, caching, usage, embeddings
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("api", APIS)
def test_structured_facts_and_prompt_caching(sim: Simulator, api: str) -> None:
    client = provider(api, sim)
    first = client.chat(facts_request())
    second = client.chat(facts_request(SEGMENT.replace("Acme Corp", "Globex")))
    facts = json.loads(second.text)["facts"]
    assert any("Globex" in fact["fact"] for fact in facts)
    assert (first.finish, second.finish) == ("end", "end")
    assert first.usage.cache_read_tokens == 0
    # The instructions come first and are the cached prefix on the second call.
    system_tokens = len(extraction_system_prompt(10)) // 4
    assert second.usage.cache_read_tokens >= system_tokens * 0.9
    assert second.usage.input_tokens > second.usage.cache_read_tokens
    if api == "anthropic":
        assert first.usage.cache_write_tokens >= system_tokens * 0.9
        assert second.usage.cache_write_tokens == 0
        assert sim.stats()["by_route"] == {"messages": 2}
    else:
        assert sim.stats()["by_route"] == {"chat.completions": 2}


@pytest.mark.parametrize("model", ["o4-mini", "gpt-5", "gpt-5-mini-2025-08-07"])
def test_a_reasoning_model_is_sent_the_output_cap_it_takes(sim: Simulator, model: str) -> None:
    """OpenAI's reasoning models refuse max_tokens (400 unsupported_parameter, a deployment fault: nothing
    was ever extracted); every OpenAI chat model takes max_completion_tokens. The simulator refuses as
    OpenAI does."""
    client = OpenAIChatClient(model=model, base_url=sim.base_url, timeout=10, provider="simulator")
    assert client.chat(facts_request()).finish == "end"
    compatible = OpenAIChatClient(
        model=model, base_url=sim.base_url, timeout=10, provider="openai-compatible"
    )
    with pytest.raises(LLMError, match="'max_tokens' is not supported with this model") as refused:
        compatible.chat(facts_request())
    assert refused.value.deployment_fault and not refused.value.retryable


def test_anthropic_embeddings_are_refused_clearly_without_an_embedding_provider(sim: Simulator) -> None:
    with pytest.raises(LLMError, match="Anthropic has no embeddings API") as caught:
        provider("anthropic", sim).embed(["hello"])
    assert not caught.value.retryable


def test_an_openai_compatible_server_embeds_only_with_a_model_named_for_it(sim: Simulator) -> None:
    """Its embeddings were asked of OpenAI's text-embedding-3-small, which such a server does not serve:
    a 404 for every page's follow-up and every vector line of a search, and no setting to change it."""
    from worker.llm.errors import NoEmbeddingsError
    from worker.llm.gateway import can_embed

    base = {"llm": "openai-compatible", "llm_base_url": sim.base_url, "llm_model": "local-chat", "llm_rpm": 0}
    unnamed = Settings(**base)
    assert not can_embed(unnamed)
    with open_llm_client(unnamed) as client:
        before = sim.stats()["requests_total"]
        with pytest.raises(NoEmbeddingsError, match="set FACTMILL_EMBEDDING_MODEL"):
            client.embed(["hello"])
        assert sim.stats()["requests_total"] == before  # no call made
    named = Settings(**base, embedding_model="local-embed")
    assert can_embed(named)
    with open_llm_client(named) as client:
        response = client.embed(["hello"])
    assert len(response.vectors) == 1 and len(response.vectors[0]) == 256
    assert response.model == "local-embed"  # the simulator answers as the model asked for


def test_openai_embeddings_decode_to_the_simulators_vectors(sim: Simulator) -> None:
    """Asked for as base64 float32 (the SDK's own default) and decoded here, not by the SDK's model."""
    texts = ["Alice loves hiking", "revenue grew"]
    response = provider("openai", sim).embed(texts)
    assert len(response.vectors) == 2 and response.usage.input_tokens > 0
    for vector, text in zip(response.vectors, texts, strict=True):
        assert vector == pytest.approx(embed_text(text), abs=1e-6)  # float32 of the simulator's floats


def test_embeddings_from_a_server_that_sends_float_lists_or_garbage() -> None:
    """A server that ignores encoding_format sends float lists: read as well. A reply that is not an
    embeddings list is a clear, non-retryable error, never a crash."""
    floats = {"data": [{"index": 1, "embedding": [0.0, 1]}, {"index": 0, "embedding": [0.5, -0.5]}]}
    garbage = [
        {"object": "list"},
        {"data": [{"index": 0, "embedding": "not base64!"}]},
        {"data": [{"index": 0, "embedding": ["x"]}]},
    ]
    server = _FixedReplies([floats, *garbage])
    try:
        client = OpenAIChatClient(model="m", base_url=server.base_url, embedding_model="e", timeout=5)
        response = client.embed(["a", "b"])
        assert response.vectors == [[0.5, -0.5], [0.0, 1.0]] and response.model == "e"
        assert response.usage.input_tokens == 0
        for _ in garbage:
            with pytest.raises(LLMError, match="not an embeddings list") as caught:
                client.embed(["a"])
            assert not caught.value.retryable
    finally:
        server.close()


@pytest.mark.parametrize("api", APIS)
def test_gateway_from_settings(sim: Simulator, api: str) -> None:
    settings = Settings(
        llm="simulator",
        simulator_url=sim.base_url,
        simulator_api=api,  # type: ignore[arg-type]
        llm_rpm=6000,
        broker_url=None,  # in-process limits here; the Redis limiter is tested below
        ratelimit_redis_url=None,
        llm_max_attempts=3,
        llm_backoff_base_seconds=0.01,
    )
    with open_llm_client(settings) as client:
        assert isinstance(client, RetryingClient) and isinstance(client.inner, RateLimitedClient)
        assert (client.provider, client.model) == ("simulator", "simulator-1")
        assert client.policy.max_attempts == 3
        assert json.loads(client.chat(facts_request()).text)["facts"]
        vectors = client.embed(["Alice loves hiking", "revenue grew"]).vectors
        assert len(vectors) == 2 and len(vectors[0]) == 256
    route = "messages" if api == "anthropic" else "chat.completions"
    assert sim.stats()["by_route"] == {route: 1, "embeddings": 1}


def test_gateway_without_limits_has_no_limiter_and_starts_its_own_simulator() -> None:
    settings = Settings(llm="simulator", simulator_url=None, simulator_api="anthropic", llm_rpm=0, llm_tpm=0)
    with open_llm_client(settings) as client:
        assert isinstance(client, RetryingClient)
        assert isinstance(client.inner, AnthropicChatClient)
        assert json.loads(client.chat(facts_request()).text)["facts"]


# --------------------------------------------------------------------------------------------------
# Extraction with 30% injected faults across every class
# --------------------------------------------------------------------------------------------------

PAGES = 10
SEGMENTS_PER_PAGE = 8


def conversation(page: int) -> str:
    """A page of SEGMENTS_PER_PAGE segments (messages a minute apart, segments two hours apart)."""
    lines = []
    for s in range(SEGMENTS_PER_PAGE):
        for m in range(3):
            who = ("Alice Example", "Bob Demo")[(s + m) % 2]
            lines.append(
                f"**{who}** (2024-05-{page + 1:02d} {8 + 2 * s:02d}:{m:02d}): I moved to Lisbon in "
                f"{2000 + page} and I run {5 + s} km on Sundays; I will call Acme Corp about order {s}-{m}."
            )
    return "\n".join(lines)


def audit_outcomes(factory: sessionmaker[Session]) -> tuple[Counter[str], Counter[str]]:
    """Attempts by outcome as extraction_audit and llm_calls each count them. A segment skipped after its
    permanent failures gets a marker row that is no attempt (no call: rows.skip_row); at 30% faults one
    is rare but comes (a fresh-clone run met one), so the markers are left out here."""
    with factory() as session:
        audit = Counter(
            dict(
                session.execute(
                    select(ExtractionAudit.outcome, func.count())
                    .where(ExtractionAudit.outcome != SKIPPED)
                    .group_by(ExtractionAudit.outcome)
                ).all()
            )
        )
        calls = Counter(
            dict(session.execute(select(LLMCall.outcome, func.count()).group_by(LLMCall.outcome)).all())
        )
    return audit, calls


def transport_kind(record: AttemptRecord, api: str) -> str:
    assert record.error is not None
    status = record.error.status
    if status is None:
        assert "timed out" in str(record.error), record.error
        return "timeout"
    overloaded = 529 if api == "anthropic" else 503
    return {429: "429", 500: "500", overloaded: "529"}[status]


# Truncation: segment_concurrency=4 (threads share the factory).
@pytest.mark.parametrize("api", APIS)
def test_thirty_percent_faults_still_extract_every_page(factory: sessionmaker[Session], api: str) -> None:
    config = SimulatorConfig.with_error_rate(0.3, seed=20240515, hang_seconds=3.0, retry_after_seconds=0.05)
    with factory.begin() as session:
        for page in range(PAGES):
            upsert_page(
                session,
                PageIn(
                    slug=f"conversations/p{page:02d}", type="conversation", compiled_truth=conversation(page)
                ),
            )
    records: list[AttemptRecord] = []
    lock = threading.Lock()

    def record(attempt: AttemptRecord) -> None:
        with lock:
            records.append(attempt)

    policy = RetryPolicy(
        max_attempts=6, max_total_wait_seconds=10, backoff_base_seconds=0.01, backoff_max_seconds=0.1
    )
    runs = []
    with Simulator(config) as sim:
        # 2 s: well under the 3 s hang, well over a loaded machine's slowest ordinary answer (at 1 s a
        # full CI run once saw 4 answers arrive late, past the slack below).
        client = RetryingClient(provider(api, sim, timeout=2.0), policy, on_attempt=record)
        options = ExtractOptions(override_disabled=True, segment_concurrency=4)
        for _ in range(12):  # a refused or twice-malformed segment fails its page; the next run resumes it
            counters = run_extract_conversation_facts(factory, client, options)
            runs.append(counters)
            if counters.pages_failed == 0:
                break
        stats = settled_stats(sim, len(records))

    assert runs[-1].pages_failed == 0, [r.as_dict(with_pages=False) for r in runs]
    assert sum(r.pages_failed for r in runs) > 0, "30% faults should have failed some page on the way"
    with factory() as session:
        per_page = dict(
            session.execute(
                select(Fact.source_markdown_slug, func.count())
                .where(Fact.is_audit.is_(False))
                .group_by(Fact.source_markdown_slug)
            ).all()
        )
        terminal = session.scalar(select(func.count()).select_from(Fact).where(Fact.is_audit.is_(True)))
    assert len(per_page) == PAGES and all(count > 0 for count in per_page.values()), per_page
    assert terminal == PAGES

    faults = stats["by_outcome"]
    assert (
        sum(count for outcome, count in faults.items() if outcome != "ok") >= 0.15 * stats["requests_total"]
    )
    # Every fault the simulator served is seen by the client: a transport fault as a failed attempt (its
    # listener saw it, the gateway retried it, both tables hold a provider_error row: each one cost a
    # request), a content fault as an attempt with that outcome in extraction_audit and llm_calls. On a
    # loaded machine the simulator can answer after the client's 2 s timeout: the client then counts a
    # timeout where the simulator counts what it served. Those late answers are the only slack allowed.
    failed = [r for r in records if r.error is not None]
    kinds = Counter(transport_kind(r, api) for r in failed)
    audit, calls = audit_outcomes(factory)
    assert audit == calls
    assert audit["provider_error"] == len(failed)
    late = kinds["timeout"] - faults.get("timeout", 0)
    assert 0 <= late <= 3, (kinds, faults)
    seen = {
        **{fault: kinds[fault] for fault in TRANSPORT_FAULTS if fault != "timeout"},
        "timeout": kinds["timeout"] - late,
        "malformed": audit["malformed_output"],
        "truncated": audit["truncated_output"],
        "refusal": audit["refusal"],
        "ok": audit["ok"],
    }
    for fault, count in seen.items():
        assert faults.get(fault, 0) > 0, faults
        assert faults[fault] - late <= count <= faults[fault], (fault, seen, faults)
    assert sum(faults[fault] - count for fault, count in seen.items()) == late, (seen, faults)
    assert set(faults) <= set(seen), faults
    assert audit["ok"] >= PAGES * SEGMENTS_PER_PAGE


# --------------------------------------------------------------------------------------------------
# The shared rate limiter across processes
# --------------------------------------------------------------------------------------------------


LIMITED_CHILD = textwrap.dedent(
    """
    import json, sys, time
    from worker.llm.ratelimit import RateLimits, RedisRateLimiter

    url, prefix, calls, rpm, tpm, tokens, start_at = sys.argv[1:8]
    limits = RateLimits(requests_per_minute=int(rpm), tokens_per_minute=int(tpm), burst_seconds=0)
    limiter = RedisRateLimiter.from_url(url, limits, prefix=prefix)
    time.sleep(max(0.0, float(start_at) - time.time()))
    stamps = []
    for _ in range(int(calls)):
        limiter.acquire("simulator:simulator-1", int(tokens))
        stamps.append(time.time())
    print(json.dumps(stamps))
    """
)


def run_limited_processes(
    broker: SessionBroker, processes: int, calls: int, *, rpm: int = 0, tpm: int = 0, tokens: int = 0
) -> list[list[float]]:
    prefix = f"factmill-test-{uuid.uuid4().hex[:8]}:"
    start_at = time.time() + 3.0  # every child has imported and connected by then
    children = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                LIMITED_CHILD,
                broker.url,
                prefix,
                str(calls),
                str(rpm),
                str(tpm),
                str(tokens),
                str(start_at),
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(processes)
    ]
    results = []
    for child in children:
        out, err = child.communicate(timeout=120)
        assert child.returncode == 0, err
        results.append(json.loads(out))
    with broker.client() as client:
        for key in client.scan_iter(f"{prefix}*"):
            client.delete(key)
    return results


def achieved_rate(stamps: list[float]) -> float:
    stamps = sorted(stamps)
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def test_shared_rpm_limit_holds_across_two_processes(broker: SessionBroker) -> None:
    rpm = 1200  # 20 requests a second, shared
    per_process = 30
    first, second = run_limited_processes(broker, 2, per_process, rpm=rpm)
    limit = rpm / 60
    rate = achieved_rate(first + second)
    assert rate <= limit * 1.1, f"{rate:.1f}/s against a limit of {limit:.0f}/s"
    # The lower bound only says the limiter does not starve them: a loaded machine delays the stamps,
    # and at 0.7 a second of scheduling delay in a 3-second run would have failed it.
    assert rate >= limit * 0.5, f"{rate:.1f}/s against a limit of {limit:.0f}/s"
    # Both processes ran at the same time and shared the budget while they did (one may start a little
    # later and have it to itself at first, so only the overlap is compared). Two processes that each
    # kept a limit of their own would run at twice the limit there. How the shared budget splits between
    # them is not the limiter's promise (a process the machine runs less often wins fewer slots: 8 of 38
    # was seen in CI on a loaded host), so the split is only checked to be real on both sides.
    start, end = max(first[0], second[0]), min(first[-1], second[-1])
    assert start < end
    overlap = [t for t in first + second if start <= t <= end]
    assert len(overlap) >= 4 and achieved_rate(overlap) <= limit * 1.15
    for stamps in (first, second):  # on a loaded host one may win a single slot of the overlap
        assert sum(start <= t <= end for t in stamps) >= 1


def test_shared_tpm_limit_holds_across_two_processes(broker: SessionBroker) -> None:
    tpm = 120_000  # 2,000 tokens a second, shared
    tokens = 100
    first, second = run_limited_processes(broker, 2, 30, tpm=tpm, tokens=tokens)
    limit = tpm / 60
    rate = achieved_rate(first + second) * tokens
    assert limit * 0.5 <= rate <= limit * 1.1, f"{rate:.0f} tokens/s against {limit:.0f}"  # (as above)


def test_in_process_limiter_holds_its_rate_across_threads() -> None:
    """Eight threads share one process's limiter: together they never pass its rate (a race in its
    bucket would let two take one slot). Real time, so here and not among the unit tests; the lower
    bound only says the limiter does not starve them (a loaded machine delays the stamps)."""
    limiter = LocalRateLimiter(RateLimits(requests_per_minute=1200, burst_seconds=0))  # 20/s
    stamps: list[float] = []
    lock = threading.Lock()

    def worker() -> None:
        for _ in range(6):
            limiter.acquire("p:m", 0)
            with lock:
                stamps.append(time.monotonic())

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    stamps.sort()
    rate = (len(stamps) - 1) / (stamps[-1] - stamps[0])
    assert 20 * 0.3 <= rate <= 20 * 1.1, rate


def test_rate_limited_client_reconciles_tokens_with_actual_usage(
    sim: Simulator, broker: SessionBroker
) -> None:
    prefix = f"factmill-test-{uuid.uuid4().hex[:8]}:"
    client = broker.client()
    limiter = RedisRateLimiter(client, RateLimits(tokens_per_minute=600_000), prefix=prefix)
    limited = RateLimitedClient(provider("openai", sim), limiter)
    key = f"{prefix}factmill:llm-ratelimit:simulator:simulator-1:tpm"
    try:
        request = facts_request(max_tokens=4000)  # the estimate counts the whole output cap
        response = limited.chat(request)
        # The key holds the bucket's end: now + the tokens charged. After reconciling with the real
        # usage it is far less than the estimate (4,000 output tokens were never used).
        seconds, micros = client.time()
        ahead = (int(client.get(key) or 0) - (seconds * 1_000_000 + micros)) / 1_000_000
        used = response.usage.input_tokens + response.usage.output_tokens
        assert ahead <= used * 60 / 600_000 + 0.05
    finally:
        for stale in client.scan_iter(f"{prefix}*"):
            client.delete(stale)


def test_the_shared_limiters_wait_past_a_deadline_ends_at_once(broker: SessionBroker) -> None:
    """As the in-process limiter: a wait that would end past the calls' deadline is not slept out."""
    prefix = f"factmill-test-{uuid.uuid4().hex[:8]}:"
    client = broker.client()
    slept: list[float] = []
    limiter = RedisRateLimiter(
        client, RateLimits(requests_per_minute=2, burst_seconds=0), prefix=prefix, sleep=slept.append
    )
    try:
        assert limiter.acquire("p:m", 0) == 0.0  # the next may go 30 s later
        with call_deadline(10.0), pytest.raises(CallDeadlineError):
            limiter.acquire("p:m", 0)
        assert slept == []
    finally:
        for stale in client.scan_iter(f"{prefix}*"):
            client.delete(stale)


def test_the_shared_limiter_books_a_large_calls_place(broker: SessionBroker) -> None:
    """As the in-process limiter: a call larger than the burst books its place, so a smaller one that
    asks after it waits behind it (it went first, and the large one waited while any asked)."""
    prefix = f"factmill-test-{uuid.uuid4().hex[:8]}:"
    client = broker.client()
    limits = RateLimits(tokens_per_minute=600_000)  # 10,000 a second, the burst a second's worth
    waits: dict[str, list[float]] = {"large": [], "small": []}

    def limiter(name: str) -> RedisRateLimiter:  # one per process: they share the Redis key
        return RedisRateLimiter(client, limits, prefix=prefix, sleep=waits.setdefault(name, []).append)

    try:
        assert limiter("filler").acquire("p:m", 10_000) == 0.0  # the bucket is full
        large = limiter("large").acquire("p:m", 30_000)
        small = limiter("small").acquire("p:m", 100)
        assert 0.5 < large <= 1.0 and waits["large"] == [large]  # the full bucket drains first
        assert small > large + 2.0 and waits["small"] == [small]  # then the large call's 3 s
    finally:
        for stale in client.scan_iter(f"{prefix}*"):
            client.delete(stale)


def test_a_redis_that_never_answers_holds_no_call_for_long() -> None:
    """A limiter's Redis that accepts and never answers (paused, a partition) held every LLM call in
    every worker: no socket timeout, and the fail-open path waited for an error. Now a command gives
    up, and the calls after it skip Redis for a while instead of each waiting out the timeout."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:  # takes connections, reads nothing, answers nothing
        listener.settimeout(0.2)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError, OSError):  # OSError: closed as the test ends
                accepted.append(listener.accept()[0])

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    url = f"redis://127.0.0.1:{listener.getsockname()[1]}/0"
    limiter = RedisRateLimiter.from_url(url, RateLimits(requests_per_minute=60, tokens_per_minute=600_000))
    done: list[float] = []
    try:
        caller = threading.Thread(
            target=lambda: done.extend(limiter.acquire("k", 10) for _ in range(50)), daemon=True
        )
        caller.start()
        caller.join(timeout=20)  # fifty calls; before, the first one never came back
        assert not caller.is_alive(), "a call is still waiting on a Redis that never answers"
        assert done == [0.0] * 50  # unthrottled while Redis is away (fail open), as on any Redis error
        assert len(accepted) == 1  # the calls after the first failure did not ask it again
        limiter.reconcile("k", 10, 500)  # nor does reconciling, while it is away
        assert len(accepted) == 1
    finally:
        stop.set()
        acceptor.join(timeout=5)
        for connection in accepted:
            connection.close()
        listener.close()
