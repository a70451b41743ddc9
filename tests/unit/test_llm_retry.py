"""The gateway's retry policy, error classification and rate limiters, alone (no network, no Redis)."""

from __future__ import annotations

import random
import threading
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from types import SimpleNamespace
from typing import Any

import anthropic
import httpx2
import openai
import pytest

from tests.clock import FakeClock
from worker.llm import deadline
from worker.llm.between_tries import CallDeadlineError
from worker.llm.errors import LLMError, classify, retry_after_seconds, to_llm_error
from worker.llm.ratelimit import (
    LocalRateLimiter,
    RateLimitedClient,
    RateLimits,
    build_rate_limiter,
    estimate_request_tokens,
    ratelimit_redis_url,
    redis_py_url,
)
from worker.llm.retry import AttemptRecord, RetryingClient, RetryPolicy
from worker.llm.types import ChatRequest, ChatResponse, EmbeddingResponse, Usage
from worker.settings import Settings

REQUEST = ChatRequest(purpose="test", system="s" * 400, messages=(("user", "u" * 200),), max_tokens=100)


def ok_response(text: str = "{}", tokens: tuple[int, int] = (150, 20)) -> ChatResponse:
    return ChatResponse(
        text=text,
        finish="end",
        usage=Usage(input_tokens=tokens[0], output_tokens=tokens[1]),
        provider="fake",
        model="fake-1",
        latency_ms=3,
    )


class ScriptedClient:
    """Answers each call with the next item of ``script``: an exception to raise or a response."""

    provider = "fake"
    model = "fake-1"

    def __init__(self, *script: Any) -> None:
        self.script = list(script)
        self.calls = 0

    def _next(self) -> Any:
        self.calls += 1
        item = self.script.pop(0) if len(self.script) > 1 else self.script[0]
        if isinstance(item, BaseException):
            raise item
        return item

    def chat(self, request: ChatRequest) -> ChatResponse:
        result: ChatResponse = self._next()
        return result

    def embed(self, texts: list[str], *, purpose: str = "embedding") -> EmbeddingResponse:
        self._next()
        return EmbeddingResponse([[1.0] for _ in texts], Usage(input_tokens=len(texts)), "fake", "e", 1)


def retryable(status: int | None = 500, retry_after: float | None = None) -> LLMError:
    return LLMError(f"HTTP {status}", retryable=True, status=status, retry_after=retry_after, latency_ms=7)


class Sleeps(list[float]):
    def __call__(self, seconds: float) -> None:
        self.append(seconds)


def client(inner: Any, policy: RetryPolicy, **kwargs: Any) -> tuple[RetryingClient, Sleeps]:
    sleeps = Sleeps()
    return RetryingClient(inner, policy, sleep=sleeps, rng=random.Random(1), **kwargs), sleeps


# --------------------------------------------------------------------------------------------------
# RetryPolicy
# --------------------------------------------------------------------------------------------------


def test_policy_defaults_and_settings() -> None:
    assert RetryPolicy() == RetryPolicy.from_settings(Settings())
    policy = RetryPolicy.from_settings(Settings(llm_max_attempts=2, llm_backoff_base_seconds=0.1))
    assert (policy.max_attempts, policy.backoff_base_seconds) == (2, 0.1)


@pytest.mark.parametrize(
    "bad",
    [
        {"max_attempts": 0},
        {"max_total_wait_seconds": -1},
        {"backoff_base_seconds": -0.1},
        {"jitter": 1.5},
    ],
)
def test_policy_refuses_nonsense(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        RetryPolicy(**bad)


def test_backoff_is_exponential_capped_and_jittered() -> None:
    policy = RetryPolicy(backoff_base_seconds=0.5, backoff_max_seconds=4, jitter=0.5)
    rng = random.Random(7)
    for retry in range(1, 10):
        ceiling = min(4.0, 0.5 * 2 ** (retry - 1))
        draws = [policy.backoff(retry, rng) for _ in range(200)]
        assert all(ceiling * 0.5 <= d <= ceiling for d in draws)
        assert max(draws) - min(draws) > ceiling * 0.3  # really jittered
    assert RetryPolicy(jitter=0).backoff(3) == 2.0
    assert RetryPolicy(backoff_max_seconds=20).backoff(10_000) <= 20  # no overflow for huge counts


def test_delay_honours_retry_after_within_the_remaining_budget() -> None:
    policy = RetryPolicy(max_total_wait_seconds=10, backoff_base_seconds=0.5, jitter=0.5)
    rng = random.Random(3)
    assert 3.0 <= policy.delay(1, 3.0, 0.0, rng) <= 3.25  # never sooner than asked, a little jitter on top
    assert policy.delay(1, 30.0, 4.0, rng) == 6.0  # capped by what is left of the total wait
    assert policy.delay(1, None, 10.0, rng) == 0.0
    assert policy.wait_budget_spent(10.0) and not policy.wait_budget_spent(9.9)
    # A Retry-After of 0 (some gateways send it) is no shorter than the backoff: the tries went out
    # within a second of each other.
    assert policy.delay(3, 0.0, 0.0, random.Random(3)) >= 1.0  # the third backoff: 2 s, less half jitter


def test_a_retry_after_date_with_an_impossible_offset_is_no_header() -> None:
    """parsedate_to_datetime raised OverflowError, out of the error's classification: the try went
    unrecorded and was not retried."""
    from worker.llm.errors import retry_after_seconds

    assert retry_after_seconds({"retry-after": "Wed, 21 Oct 2015 07:28:00 +99999999999999999999"}) is None


# --------------------------------------------------------------------------------------------------
# RetryingClient
# --------------------------------------------------------------------------------------------------


def test_retryable_errors_are_retried_until_success() -> None:
    inner = ScriptedClient(retryable(500), retryable(None), ok_response())
    retrying, sleeps = client(inner, RetryPolicy(backoff_base_seconds=1, jitter=0))
    traced = retrying.chat_traced(REQUEST)
    assert traced.value.text == "{}"
    assert inner.calls == 3 and sleeps == [1.0, 2.0]
    assert [(a.number, a.ok, a.retry_in_seconds) for a in traced.attempts] == [
        (1, False, 1.0),
        (2, False, 2.0),
        (3, True, None),
    ]
    assert [a.error.status for a in traced.failed_attempts if a.error] == [500, None]
    assert traced.attempts[0].latency_ms == 7
    # Each record says what a recorder needs: purpose, provider, model, and the response of the success.
    assert {(a.purpose, a.provider, a.model) for a in traced.attempts} == {("test", "fake", "fake-1")}
    assert traced.attempts[-1].response is traced.value and traced.attempts[0].response is None
    assert (retrying.provider, retrying.model) == ("fake", "fake-1")


def test_non_retryable_errors_are_raised_at_once() -> None:
    inner = ScriptedClient(LLMError("HTTP 400: bad schema", retryable=False, status=400), ok_response())
    retrying, sleeps = client(inner, RetryPolicy())
    with pytest.raises(LLMError, match="bad schema") as caught:
        retrying.chat(REQUEST)
    assert inner.calls == 1 and sleeps == []
    assert len(caught.value.attempts) == 1


def test_attempts_are_bounded_and_reported() -> None:
    inner = ScriptedClient(retryable(503))
    seen: list[AttemptRecord] = []
    retrying, sleeps = client(
        inner, RetryPolicy(max_attempts=4, backoff_base_seconds=0.1), on_attempt=seen.append
    )
    with pytest.raises(LLMError) as caught:
        retrying.chat(REQUEST)
    assert inner.calls == 4 and len(sleeps) == 3
    assert [a.number for a in caught.value.attempts] == [1, 2, 3, 4]
    assert caught.value.attempts[-1].retry_in_seconds is None
    assert seen == list(caught.value.attempts)


def test_total_wait_is_bounded() -> None:
    inner = ScriptedClient(retryable(429, retry_after=4.0))
    retrying, sleeps = client(inner, RetryPolicy(max_attempts=50, max_total_wait_seconds=10))
    with pytest.raises(LLMError):
        retrying.chat(REQUEST)
    assert sum(sleeps) <= 10.0
    assert all(s >= 4.0 for s in sleeps)  # Retry-After honoured, never shortened
    # After two waits of 4 s (and their jitter) less than 4 s is left: the third try is the last.
    assert inner.calls == len(sleeps) + 1 == 3


def test_a_retry_after_past_the_wait_left_ends_the_tries_at_once() -> None:
    inner = ScriptedClient(retryable(429, retry_after=3600.0), ok_response())
    retrying, sleeps = client(inner, RetryPolicy(max_total_wait_seconds=120))
    with pytest.raises(LLMError) as caught:
        retrying.chat(REQUEST)
    # Not a 120 s sleep and a second try an hour too soon: the error goes up (retryable, for the job).
    assert inner.calls == 1 and sleeps == []
    assert caught.value.retryable and caught.value.retry_after == 3600.0
    policy = RetryPolicy(max_total_wait_seconds=10)
    assert policy.wait_budget_spent(4.0, 6.5) and not policy.wait_budget_spent(4.0, 6.0)


def test_embeddings_are_retried_too() -> None:
    inner = ScriptedClient(retryable(502), ok_response())
    retrying, _ = client(inner, RetryPolicy(backoff_base_seconds=0))
    assert retrying.embed(["a", "b"]).vectors == [[1.0], [1.0]]
    assert inner.calls == 2


def test_bugs_are_not_retried_and_a_broken_listener_changes_nothing() -> None:
    inner = ScriptedClient(KeyError("oops"))
    retrying, sleeps = client(inner, RetryPolicy())
    with pytest.raises(KeyError):
        retrying.chat(REQUEST)
    assert inner.calls == 1 and sleeps == []

    def broken(record: AttemptRecord) -> None:
        raise RuntimeError("listener bug")

    retrying, _ = client(ScriptedClient(retryable(), ok_response()), RetryPolicy(), on_attempt=broken)
    assert retrying.chat(REQUEST).text == "{}"


class FailsFirstPerThread:
    """Fails each thread's first call (retryable), after every thread has made one, then answers."""

    provider = "fake"
    model = "fake-1"

    def __init__(self, threads: int) -> None:
        self.barrier = threading.Barrier(threads)
        self.seen: set[int] = set()

    def chat(self, request: ChatRequest) -> ChatResponse:
        me = threading.get_ident()
        if me not in self.seen:
            self.seen.add(me)
            self.barrier.wait(10)  # every thread is inside its first try together
            raise retryable(500 + len(self.seen) % 10)
        return ok_response(text=request.purpose)

    def embed(self, texts: list[str], *, purpose: str = "embedding") -> EmbeddingResponse:
        raise AssertionError("not used")


def test_one_client_shared_by_threads_keeps_each_calls_tries_apart() -> None:
    """The retry controller is shared by every call of a client; each call's tries stay its own."""
    inner = FailsFirstPerThread(8)
    retrying = RetryingClient(inner, RetryPolicy(backoff_base_seconds=0.01), rng=random.Random(1))
    traced: dict[str, Any] = {}

    def call(n: int) -> None:
        request = ChatRequest(purpose=f"call-{n}", system="s", messages=(("user", "u"),), max_tokens=5)
        traced[request.purpose] = retrying.chat_traced(request)

    threads = [threading.Thread(target=call, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert sorted(traced) == [f"call-{n}" for n in range(8)]
    for purpose, result in traced.items():
        assert result.value.text == purpose
        assert [(a.number, a.ok, a.purpose) for a in result.attempts] == [
            (1, False, purpose),
            (2, True, purpose),
        ]
        assert result.attempts[0].retry_in_seconds is not None


def test_each_retry_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    retrying, _ = client(ScriptedClient(retryable(529), ok_response()), RetryPolicy())
    with caplog.at_level("WARNING", logger="worker.llm.retry"):
        retrying.chat(REQUEST)
    assert "attempt 1 of 5" in caplog.text and "HTTP 529" in caplog.text


# --------------------------------------------------------------------------------------------------
# classify(): the one place exceptions are sorted
# --------------------------------------------------------------------------------------------------

HTTP_REQUEST = httpx2.Request("POST", "https://provider.example/v1/chat/completions")


def status_error(sdk: Any, status: int, headers: dict[str, str] | None = None) -> Exception:
    response = httpx2.Response(status, headers=headers or {}, request=HTTP_REQUEST)
    body = {"error": {"message": f"provider says {status}", "type": "x"}}
    error: Exception = sdk.APIStatusError(f"Error code: {status}", response=response, body=body)
    return error


@pytest.mark.parametrize("sdk", [openai, anthropic])
@pytest.mark.parametrize("status", [408, 409, 429, 500, 502, 503, 504, 529])
def test_throttling_and_server_errors_retry(sdk: Any, status: int) -> None:
    c = classify(status_error(sdk, status))
    assert c.retryable and c.status == status
    assert f"provider says {status}" in c.message


@pytest.mark.parametrize("sdk", [openai, anthropic])
@pytest.mark.parametrize("status", [400, 401, 403, 404, 413, 422])
def test_other_client_errors_fail_fast_with_the_providers_message(sdk: Any, status: int) -> None:
    c = classify(status_error(sdk, status))
    assert not c.retryable
    assert c.message == f"HTTP {status}: provider says {status}"


@pytest.mark.parametrize("sdk", [openai, anthropic])
def test_the_providers_x_should_retry_is_obeyed_over_the_status(sdk: Any) -> None:
    """Both SDKs obey x-should-retry (their own retries are off here): a 400 the provider says to try
    again failed the segment, and a 500 it says not to was tried five times."""
    assert classify(status_error(sdk, 400, {"x-should-retry": "true"})).retryable
    assert not classify(status_error(sdk, 500, {"x-should-retry": "false"})).retryable
    assert classify(status_error(sdk, 500, {"x-should-retry": "maybe"})).retryable
    # Whose fault it is stays the status's: a 400 tried again is the request's, a 503 not tried an outage.
    from worker.llm.errors import provider_cannot_serve

    assert not provider_cannot_serve(to_llm_error(status_error(sdk, 400, {"x-should-retry": "true"})))
    assert provider_cannot_serve(to_llm_error(status_error(sdk, 503, {"x-should-retry": "false"})))


@pytest.mark.parametrize(
    ("sdk", "status", "error", "blamed"),
    [
        # Anthropic's answer to a spent credit balance: a plain invalid_request_error 400.
        (
            anthropic,
            400,
            {"type": "invalid_request_error", "message": "Your credit balance is too low to access the API."},
            True,
        ),
        (anthropic, 402, {"type": "billing_error", "message": "payment method declined"}, True),
        # Anthropic names the organization's, the key's and the workspace's troubles in
        # error.details.error_code under a plain invalid_request_error: read as the segment's own.
        *(
            (
                anthropic,
                400,
                {"type": "invalid_request_error", "message": "denied", "details": {"error_code": code}},
                True,
            )
            for code in ("organization_on_hold", "cmek_key_disabled", "workspace_policy_violation")
        ),
        (
            anthropic,
            403,
            {
                "type": "permission_error",
                "message": "no",
                "details": {"error_code": "user_profile_not_billable"},
            },
            True,
        ),
        (anthropic, 402, {"type": "error", "message": "payment required"}, True),
        # FACTMILL_LLM_MAX_OUTPUT_TOKENS over the model's output limit: every request is refused alike,
        # and counted against each segment, every segment of the corpus was skipped after three runs.
        (
            openai,
            400,
            {
                "message": "max_tokens is too large: 32768. This model supports at most 16384 completion "
                "tokens, whereas you provided 32768.",
                "type": "invalid_request_error",
                "code": None,
                "param": "max_tokens",
            },
            True,
        ),
        (
            anthropic,
            400,
            {
                "type": "invalid_request_error",
                "message": "max_tokens: 32768 > 8192, which is the maximum allowed number of output tokens "
                "for claude-haiku-4-5",
            },
            True,
        ),
        # vLLM's answer to a request too long for the context names max_tokens too: the request's own.
        (
            openai,
            400,
            {
                "message": "'max_tokens' or 'max_completion_tokens' is too large: 1024. This model's maximum "
                "context length is 8192 tokens and your request has 7500 input tokens",
                "type": "BadRequestError",
                "param": "max_tokens",
            },
            False,
        ),
        # An OpenAI reasoning model given max_tokens.
        (
            openai,
            400,
            {
                "message": "Unsupported parameter: 'max_tokens'",
                "type": "invalid_request_error",
                "code": "unsupported_parameter",
                "param": "max_tokens",
            },
            True,
        ),
        (
            openai,
            429,
            {
                "message": "You exceeded your current quota",
                "type": "insufficient_quota",
                "code": "insufficient_quota",
            },
            True,
        ),
        # A wrong key or a region refused, in a vocabulary neither SDK's provider uses (vLLM's
        # --api-key, LiteLLM, a proxy): the deployment's (each compaction in flight failed for good).
        (openai, 401, {"message": "Unauthorized"}, True),
        (openai, 401, {"message": "Authentication Error", "type": "auth_error"}, True),
        (
            openai,
            403,
            {
                "message": "Country, region, or territory not supported",
                "code": "unsupported_country_region_territory",
            },
            True,
        ),
        # The request's own content: the segment's fault.
        (
            openai,
            400,
            {
                "message": "maximum context length is 128000 tokens",
                "type": "invalid_request_error",
                "code": "context_length_exceeded",
                "param": "messages",
            },
            False,
        ),
        (anthropic, 413, {"type": "request_too_large", "message": "Request exceeds the maximum size"}, False),
        # An odd server's error whose type or code is no string: classified, never a TypeError.
        (openai, 400, {"message": "bad", "type": ["a"], "code": {"b": 1}}, False),
    ],
)
def test_errors_that_blame_the_account_or_settings_never_count_against_a_segment(
    sdk: Any, status: int, error: dict[str, str], blamed: bool
) -> None:
    """A billing outage answered every segment with a 400: each counted as the segment's own permanent
    failure, and after three retries of a page one segment was skipped for good (its facts lost)."""
    from worker.extraction.segments import rejected_request

    response = httpx2.Response(status, request=HTTP_REQUEST)
    exc = sdk.APIStatusError(
        f"Error code: {status}", response=response, body={"type": "error", "error": error}
    )
    llm_error = to_llm_error(exc)
    assert llm_error.deployment_fault is blamed
    assert rejected_request(llm_error) is (not blamed and status in {400, 413})
    assert classify(llm_error).deployment_fault is blamed  # an LLMError keeps its classification
    if blamed:  # waiting does not refill a quota: an insufficient_quota 429 is not throttling
        assert not llm_error.retryable


@pytest.mark.parametrize(
    ("message", "too_large"),
    [
        (
            "Request too large for gpt-4o in organization org-x on tokens per min (TPM): Limit 30000, "
            "Requested 96000. The input or output tokens must be reduced in order to run successfully.",
            True,
        ),
        (
            "Rate limit reached for gpt-4o in organization org-x on tokens per min (TPM): Limit 30000, "
            "Used 29000, Requested 2000. Please try again in 2s.",
            False,
        ),
    ],
)
def test_a_request_over_the_whole_per_minute_limit_is_the_requests_fault_not_an_outage(
    message: str, too_large: bool
) -> None:
    """OpenAI's 429 for one request larger than the per-minute token limit was throttling: five tries,
    then the job waited out the outage patience (a day), sending it again each run. A plain 429 is
    still throttling."""
    from worker.extraction.segments import rejected_request
    from worker.llm.errors import provider_unavailable

    body = {"error": {"message": message, "type": "tokens", "code": "rate_limit_exceeded"}}
    exc = openai.APIStatusError(
        "Error code: 429", response=httpx2.Response(429, request=HTTP_REQUEST), body=body
    )
    error = to_llm_error(exc)
    assert error.status == 429 and not error.deployment_fault
    assert (error.retryable, provider_unavailable(error)) == (not too_large, not too_large)
    assert rejected_request(error) is too_large
    assert classify(error).too_large is too_large  # an LLMError keeps its classification


def _anthropic_error(kind: str, code: str | None = None) -> dict[str, Any]:
    return {"type": kind, "message": "said"} | ({"details": {"error_code": code}} if code else {})


@pytest.mark.parametrize(
    ("status", "error", "code"),
    [
        (
            429,
            _anthropic_error("rate_limit_error", "enforced_spend_limit_reached"),
            "enforced_spend_limit_reached",
        ),
        (
            429,
            _anthropic_error("rate_limit_error", "contract_spend_limit_reached"),
            "contract_spend_limit_reached",
        ),
        (
            402,
            _anthropic_error("error", "linked_organization_spend_limit_reached"),
            "linked_organization_spend_limit_reached",
        ),
        (402, _anthropic_error("error"), "error"),  # a 402 is the account's money whatever it names
        (400, _anthropic_error("billing_error", "something_newer"), "billing_error"),  # the blaming name
    ],
)
def test_an_anthropic_spend_limit_is_the_accounts_money_not_throttling(
    status: int, error: dict[str, Any], code: str
) -> None:
    """A spend limit reached came as a 429 rate_limit_error with the reason in details.error_code: tried
    five times a call against a closed account, and compact --now said "try again later", not "top up"."""
    from worker.llm.errors import account_exhausted, provider_cannot_serve

    response = httpx2.Response(status, request=HTTP_REQUEST)
    exc = anthropic.APIStatusError("Error", response=response, body={"type": "error", "error": error})
    llm_error = to_llm_error(exc)
    assert llm_error.deployment_fault and not llm_error.retryable
    assert account_exhausted(llm_error) and provider_cannot_serve(llm_error)
    assert llm_error.code == code


def test_an_anthropic_rate_limit_without_a_spend_code_is_still_throttling() -> None:
    from worker.llm.errors import account_exhausted

    response = httpx2.Response(429, request=HTTP_REQUEST)
    body = {"type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}}
    llm_error = to_llm_error(anthropic.APIStatusError("Error", response=response, body=body))
    assert llm_error.retryable and not llm_error.deployment_fault and not account_exhausted(llm_error)
    assert llm_error.code == "rate_limit_error"


def test_an_anthropic_batch_error_read_by_its_details_code_blames_the_account() -> None:
    from worker.llm.anthropic_provider import AnthropicChatClient
    from worker.llm.batches import AnthropicBatchClient

    chat = AnthropicChatClient(model="claude-sonnet-4-5", base_url="http://127.0.0.1:9")
    error = {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "on hold",
            "details": {"error_code": "organization_on_hold"},
        },
    }
    item = AnthropicBatchClient(chat)._item({"type": "errored", "error": error}, REQUEST)
    assert item is not None and item.deployment_fault and item.status == 400


@pytest.mark.parametrize(
    "exc",
    [
        openai.APITimeoutError(request=HTTP_REQUEST),
        anthropic.APITimeoutError(request=HTTP_REQUEST),
        openai.APIConnectionError(request=HTTP_REQUEST),
        anthropic.APIConnectionError(request=HTTP_REQUEST),
        httpx2.ConnectError("refused"),
        httpx2.ReadTimeout("slow"),
    ],
)
def test_timeouts_and_connection_errors_retry(exc: Exception) -> None:
    assert classify(exc).retryable


def wrapped(exc: Exception, cause: Exception) -> Exception:
    """``exc`` raised from ``cause``, as the SDKs raise their timeout error from the HTTP library's."""
    exc.__cause__ = cause
    return exc


@pytest.mark.parametrize(
    ("exc", "away"),
    [
        (openai.APIConnectionError(request=HTTP_REQUEST), True),
        (anthropic.APIConnectionError(request=HTTP_REQUEST), True),
        (httpx2.ConnectError("refused"), True),
        (openai.APITimeoutError(request=HTTP_REQUEST), False),
        (httpx2.ReadTimeout("slow"), False),
        # A host that drops connections: the connect times out, no request reached it (each job spent
        # its attempts, a compaction failed at once, where a refused connect waited out the outage).
        (httpx2.ConnectTimeout("dropped"), True),
        (wrapped(openai.APITimeoutError(request=HTTP_REQUEST), httpx2.ConnectTimeout("dropped")), True),
        (wrapped(anthropic.APITimeoutError(request=HTTP_REQUEST), httpx2.ConnectTimeout("dropped")), True),
        (wrapped(openai.APITimeoutError(request=HTTP_REQUEST), httpx2.ReadTimeout("slow")), False),
    ],
)
def test_an_unreachable_provider_is_an_outage_and_a_timeout_is_the_calls_own(
    exc: Exception, away: bool
) -> None:
    """Connection resets and DNS failures (a network outage) were the job's own failures: a two-minute
    blip spent every job in flight's five attempts, the harm the 5xx rule (requeued) was made against. A
    timeout stays the call's own: a request too large to finish fails so on every try."""
    from worker.llm.errors import provider_cannot_serve

    assert provider_cannot_serve(to_llm_error(exc)) is away


def test_anything_else_fails() -> None:
    assert not classify(ValueError("bad")).retryable
    error = to_llm_error(status_error(openai, 429, {"retry-after": "3"}), latency_ms=12)
    assert (error.retryable, error.status, error.retry_after, error.latency_ms) == (True, 429, 3.0, 12)
    assert classify(error).retry_after == 3.0  # an LLMError keeps its own classification


def test_retry_after_headers() -> None:
    assert retry_after_seconds({"retry-after-ms": "250", "retry-after": "1"}) == 0.25
    assert retry_after_seconds({"retry-after": "2.5"}) == 2.5
    assert retry_after_seconds({"retry-after": "-4"}) == 0.0
    assert retry_after_seconds({"retry-after": "soon"}) is None
    assert retry_after_seconds({}) is None and retry_after_seconds(None) is None
    now = datetime(2024, 3, 15, 9, 0, tzinfo=UTC)
    later = format_datetime(now + timedelta(seconds=30), usegmt=True)
    assert retry_after_seconds({"retry-after": later}, now=now.timestamp()) == pytest.approx(30)


# --------------------------------------------------------------------------------------------------
# Rate limits (in-process; the Redis limiter across processes is in tests/integration/test_gateway.py)
# --------------------------------------------------------------------------------------------------


def test_local_limiter_spaces_requests_at_the_rpm() -> None:
    clock = FakeClock()
    limiter = LocalRateLimiter(
        RateLimits(requests_per_minute=120, burst_seconds=0), clock=clock, sleep=clock.sleep
    )
    start = clock.now
    for _ in range(61):
        limiter.acquire("p:m", 0)
    assert clock.now - start == pytest.approx(30.0)  # 60 intervals of 0.5 s
    other = LocalRateLimiter(
        RateLimits(requests_per_minute=120, burst_seconds=0), clock=clock, sleep=clock.sleep
    )
    assert other.acquire("p:m", 0) == 0.0  # keys and limiters are independent


def test_local_limiter_allows_a_burst_then_holds_the_rate() -> None:
    clock = FakeClock()
    limiter = LocalRateLimiter(
        RateLimits(requests_per_minute=600, burst_seconds=1), clock=clock, sleep=clock.sleep
    )
    waits = [limiter.acquire("p:m", 0) for _ in range(30)]
    assert waits[:10] == [0.0] * 10  # one second's worth at once
    assert sum(waits) == pytest.approx(2.0)  # then 10 a second


def test_local_limiter_holds_tokens_per_minute_and_lets_big_calls_through() -> None:
    clock = FakeClock()
    limiter = LocalRateLimiter(RateLimits(tokens_per_minute=6000), clock=clock, sleep=clock.sleep)  # 100/s
    start = clock.now
    for _ in range(10):
        limiter.acquire("p:m", 50)
    assert clock.now - start == pytest.approx(4.0)  # 500 tokens at 100/s, the first second's 100 at once
    # A call bigger than the burst still goes once the bucket is empty, and runs it into debt.
    assert limiter.acquire("p:m", 1000) == pytest.approx(1.0)  # the burst allowance drains first
    assert limiter.acquire("p:m", 1) == pytest.approx(9.01)  # 10 s of debt, less the 1 s burst


def test_reconcile_gives_back_unused_tokens() -> None:
    clock = FakeClock()
    limiter = LocalRateLimiter(
        RateLimits(tokens_per_minute=6000, burst_seconds=0), clock=clock, sleep=clock.sleep
    )
    limiter.acquire("p:m", 500)  # 5 s of budget
    limiter.reconcile("p:m", estimated=500, actual=100)
    assert limiter.acquire("p:m", 100) == pytest.approx(1.0)  # only the 100 really used were held
    limiter.reconcile("p:m", estimated=100, actual=300)  # used more than estimated: charged later
    assert limiter.acquire("p:m", 1) == pytest.approx(3.0, abs=0.02)


class RecordingLimiter:
    def __init__(self) -> None:
        self.limits = RateLimits(requests_per_minute=1)
        self.calls: list[tuple[Any, ...]] = []

    def acquire(self, key: str, tokens: int) -> float:
        self.calls.append(("acquire", key, tokens))
        return 0.0

    def reconcile(self, key: str, estimated: int, actual: int) -> None:
        self.calls.append(("reconcile", key, estimated, actual))


def test_a_call_larger_than_the_burst_keeps_its_place_behind_smaller_ones() -> None:
    """A call larger than the burst went only when the bucket was empty; asking again after each wait,
    it never saw it empty while smaller calls kept asking (a compaction behind 64 extraction calls
    waited for good). A call books its place when it asks: the ones asking after it wait behind it."""
    clock = FakeClock()
    big_sleeps: list[float] = []
    small_waits: list[float] = []  # what each smaller call was told to wait (its place is booked)
    in_small = False

    def sleep(seconds: float) -> None:
        nonlocal in_small
        if in_small:  # a smaller call's thread sleeps its turn out apart from this one: not modelled
            return
        big_sleeps.append(seconds)
        assert len(big_sleeps) < 20, "the large call never went"
        end = clock.now + seconds
        while clock.now < end - 1e-9:  # meanwhile other threads ask for 30 tokens every 0.25 s
            clock.now = min(end, clock.now + 0.25)
            in_small = True
            try:
                small_waits.append(limiter.acquire("p:m", 30))
            finally:
                in_small = False

    limiter = LocalRateLimiter(RateLimits(tokens_per_minute=6000), clock=clock, sleep=sleep)  # 100/s
    start = clock.now
    assert limiter.acquire("p:m", 100) == 0.0  # the burst's worth: the bucket is full
    waited = limiter.acquire("p:m", 1000)
    assert big_sleeps == [pytest.approx(1.0)] and waited == pytest.approx(1.0)  # the full bucket drained
    assert clock.now - start == pytest.approx(1.0)
    # The four that asked while it waited are booked behind it, each after the one before.
    assert small_waits == pytest.approx([10.05, 10.1, 10.15, 10.2])


def test_a_long_wait_for_a_place_says_now_and_then_that_it_is_a_wait() -> None:
    """At a tight limit behind a long queue a call may wait its turn for longer than the job's stall
    limit: one sleep said nothing meanwhile, and the job's heartbeat let the lease lapse under a run
    that was only waiting (the sweeper counted a worker loss, again and again)."""
    from worker.core import progress

    clock, sleeps, marks = FakeClock(), [], []

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        clock.now += seconds

    limiter = LocalRateLimiter(RateLimits(tokens_per_minute=60), clock=clock, sleep=sleep)  # 1 a second
    assert limiter.acquire("p:m", 60) == 0.0
    progress.listen(lambda: marks.append(clock.now))
    try:
        waited = limiter.acquire("p:m", 45)
    finally:
        progress.listen(None)
    assert (
        waited >= 45 and sum(sleeps) == pytest.approx(waited) and max(sleeps) <= progress.MARK_EVERY_SECONDS
    )
    assert len(marks) == len(sleeps) >= 5  # one after each slice of the wait


def test_rate_limited_client_estimates_then_reconciles() -> None:
    limiter = RecordingLimiter()
    limited = RateLimitedClient(ScriptedClient(ok_response(tokens=(150, 20))), limiter)
    assert (limited.provider, limited.model) == ("fake", "fake-1")
    limited.chat(REQUEST)
    estimate = estimate_request_tokens(REQUEST)
    assert estimate == 600 // 4 + 100
    assert limiter.calls == [
        ("acquire", "fake:fake-1", estimate),
        ("reconcile", "fake:fake-1", estimate, 170),
    ]


def test_embeddings_are_limited_where_they_go_not_under_the_chat_models_limits() -> None:
    """Anthropic has no embeddings API: its client hands embed() to an OpenAI client. The limiter keyed
    those calls under the Anthropic chat model, so every embedding took one of its requests a minute
    (slowing extraction) and OpenAI's embeddings endpoint had no limit at all."""
    from worker.llm.anthropic_provider import AnthropicChatClient
    from worker.llm.openai_compat import OpenAIChatClient

    embeddings = OpenAIChatClient(model="gpt-4o-mini", base_url="http://127.0.0.1:9/v1")
    chat = AnthropicChatClient(
        model="claude-sonnet-4-5", base_url="http://127.0.0.1:9", embeddings=embeddings
    )
    limiter = RecordingLimiter()
    limited = RateLimitedClient(chat, limiter)
    assert limited._chat_key == "anthropic:claude-sonnet-4-5"
    assert limited._embed_key == "openai:text-embedding-3-small"
    assert RateLimitedClient(embeddings, limiter)._embed_key == "openai:text-embedding-3-small"
    assert RateLimitedClient(ScriptedClient(), limiter)._embed_key == "fake:fake-1"


def test_a_failed_try_gives_its_output_cap_back_and_a_reply_without_usage_keeps_its_estimate() -> None:
    """Only successes were reconciled: every try of a 429 storm kept its whole estimate (prompt and
    output cap), pushing the limiter further ahead. And a server that reports no usage had its whole
    estimate refunded, so tokens a minute held nothing for it."""
    limiter = RecordingLimiter()
    limited = RateLimitedClient(ScriptedClient(retryable(429), ok_response(tokens=(0, 0))), limiter)
    estimate = estimate_request_tokens(REQUEST)
    with pytest.raises(LLMError):
        limited.chat(REQUEST)
    limited.chat(REQUEST)
    assert limiter.calls == [
        ("acquire", "fake:fake-1", estimate),
        ("reconcile", "fake:fake-1", estimate, estimate - REQUEST.max_tokens),
        ("acquire", "fake:fake-1", estimate),
        ("reconcile", "fake:fake-1", estimate, estimate),
    ]


def test_a_reply_that_could_not_be_used_is_charged_what_it_billed() -> None:
    """A 200 of the wrong shape was billed (LLMError.usage) but refunded its output cap like a refused
    try: the limiter ran ahead of what the provider counted against the key."""
    limiter = RecordingLimiter()
    billed = LLMError("not JSON", retryable=False, usage=Usage(input_tokens=140, output_tokens=90))
    limited = RateLimitedClient(ScriptedClient(billed), limiter)
    with pytest.raises(LLMError):
        limited.chat(REQUEST)
    estimate = estimate_request_tokens(REQUEST)
    assert limiter.calls[-1] == ("reconcile", "fake:fake-1", estimate, 230)


def test_a_call_reporting_billions_of_tokens_is_charged_what_its_prompt_could_come_to() -> None:
    """An odd OpenAI-compatible server reported two billion tokens for one call: at 100k tokens a
    minute the limiter (shared by every worker, through Redis) moved two weeks ahead, and every call
    waited for it. A call is charged at most a token a prompt character, plus its output cap."""
    now = [0.0]
    limiter = LocalRateLimiter(
        RateLimits(tokens_per_minute=100_000),
        clock=lambda: now[0],
        sleep=lambda seconds: now.__setitem__(0, now[0] + seconds),
    )
    limited = RateLimitedClient(ScriptedClient(ok_response(tokens=(2_000_000_000, 0))), limiter)
    limited.chat(REQUEST)
    estimate = estimate_request_tokens(REQUEST)
    waited = limiter.acquire("fake:fake-1", estimate)
    assert waited <= 4 * estimate / 100_000 * 60  # seconds: it was 1.2 million (two weeks)


def test_one_process_has_one_in_process_limiter_for_its_limits() -> None:
    """The runtime builds its work client and its search client apart; each built its own in-process
    limiter, so one process went at twice the rate it was given."""
    settings = Settings(broker_url=None, ratelimit_redis_url=None, llm_tpm=123_457)
    first, second = build_rate_limiter(settings), build_rate_limiter(settings)
    assert isinstance(first, LocalRateLimiter) and first is second
    other = build_rate_limiter(Settings(broker_url=None, ratelimit_redis_url=None, llm_tpm=7_654_321))
    assert other is not first and other is not None and other.limits.tokens_per_minute == 7_654_321


def test_limiter_redis_url_resolution() -> None:
    assert ratelimit_redis_url(Settings(broker_url=None, ratelimit_redis_url=None)) is None
    assert ratelimit_redis_url(Settings(broker_url="redis://h:6379/0")) == "redis://h:6379/0"
    assert ratelimit_redis_url(Settings(broker_url="amqp://h//")) is None
    explicit = Settings(broker_url="amqp://h//", ratelimit_redis_url="redis://r/1")
    assert ratelimit_redis_url(explicit) == "redis://r/1"
    assert redis_py_url("redis+socket:///tmp/r.sock") == "unix:///tmp/r.sock"
    assert redis_py_url("redis://h") == "redis://h"


@pytest.mark.parametrize("sdk", [openai, anthropic])
def test_a_body_that_is_no_json_error_is_described_never_quoted(sdk: Any) -> None:
    """The SDKs' message for a body that is not JSON is the body itself: a proxy's page, or a server
    echoing the request (the page's text), went into the logs, llm_calls, the audit and the job."""
    echoed = "Segment: Alice told Bob her diagnosis"
    response = httpx2.Response(
        502,
        headers={"content-type": "text/html"},
        content=f"<html>{echoed}</html>".encode(),
        request=HTTP_REQUEST,
    )
    error = sdk.APIStatusError(f"<html>{echoed}</html>", response=response, body=f"<html>{echoed}</html>")
    c = classify(error)
    assert c.retryable and "diagnosis" not in c.message
    assert c.message == "HTTP 502: a reply that is not a JSON error (50 bytes, text/html; not kept)"


def test_a_bodys_own_message_is_kept_clipped_and_only_a_body_without_one_is_described() -> None:
    """The description reads the response (its size: a large body's length); asked of every error
    it cost a read per retry, so it is asked only of a body that has no message of its own."""
    from worker.llm.errors import MAX_PROVIDER_MESSAGE_CHARS, body_message

    def never() -> str:
        raise AssertionError("a body with a message of its own was described")

    assert body_message({"error": {"message": "model not found"}}, never) == "model not found"
    assert body_message({"message": "overloaded", "type": "error"}, never) == "overloaded"
    clipped = body_message({"error": {"message": "x" * 10_000}}, never)
    assert len(clipped) == MAX_PROVIDER_MESSAGE_CHARS and clipped.endswith("…")
    calls: list[int] = []
    described = body_message({"error": {"message": 42}}, lambda: calls.append(1) or "7 bytes, text/plain")
    assert described == "a reply that is not a JSON error (7 bytes, text/plain; not kept)" and calls == [1]
    assert body_message(None, "no body") == "a reply that is not a JSON error (no body; not kept)"


@pytest.mark.parametrize(
    ("said", "kept"),
    [
        (
            "Rate limit reached for gpt-4o in organization org-AbC123xyzAbC123xyzAbC12 on tokens per min",
            "Rate limit reached for gpt-4o in organization [account id] on tokens per min",
        ),
        ("Incorrect API key provided: sk-proj-********wxyz.", "Incorrect API key provided: [account id]."),
        (
            "would exceed your organization's (5f1c2a3b-1234-4cde-8f00-123456789abc) rate limit",
            "would exceed your organization's ([account id]) rate limit",
        ),
        (
            "model gpt-4o-mini-2024 not found; see the org-chart",
            "model gpt-4o-mini-2024 not found; see the org-chart",
        ),
        # What operators need stays: a request id, and words that only look like an id's start.
        (
            "Please include the request ID 5f1c2a3b-1234-4cde-8f00-123456789abc in your message.",
            "Please include the request ID 5f1c2a3b-1234-4cde-8f00-123456789abc in your message.",
        ),
        (
            "user-provided content; user_location must be an object",
            "user-provided content; user_location must be an object",
        ),
    ],
)
def test_a_provider_message_keeps_no_id_of_the_deployments_account(said: str, kept: str) -> None:
    """The words reach a job's note, which any read key reads, a tenant's too: the organization, the
    project and the tail of the API key are the deployment's, not the job's."""
    from worker.llm.errors import body_message

    assert body_message({"error": {"message": said}}, "no body") == kept


def test_a_call_that_waited_for_the_rate_limit_asks_the_callers_check_before_it_goes() -> None:
    """A rate limit's wait can be long: a kill switch turned off meanwhile let the call go all the same.
    The caller's check (worker.llm.between_tries) is asked after a wait; what it raises ends the call,
    and the tokens charged for it are given back."""
    from worker.llm.between_tries import checked_between_tries

    class Stopped(Exception):
        pass

    class Waits(RecordingLimiter):
        def acquire(self, key: str, tokens: int) -> float:
            super().acquire(key, tokens)
            return 2.5

    def switched_off() -> None:
        raise Stopped("the kill switch is off")

    inner = ScriptedClient(ok_response())
    limiter = Waits()
    with checked_between_tries(switched_off), pytest.raises(Stopped):
        RateLimitedClient(inner, limiter).chat(REQUEST)
    estimate = estimate_request_tokens(REQUEST)
    assert inner.calls == 0
    assert limiter.calls == [("acquire", "fake:fake-1", estimate), ("reconcile", "fake:fake-1", estimate, 0)]
    # No wait: no check asked (it was asked before the call, by the caller).
    RateLimitedClient(inner, RecordingLimiter()).chat(REQUEST)
    assert inner.calls == 1


def test_the_callers_check_is_asked_before_each_retry_and_the_tries_before_it_are_kept() -> None:
    from worker.llm.between_tries import checked_between_tries, tries_before_stop

    class Stopped(Exception):
        pass

    asked: list[int] = []

    def off_at_the_second_retry() -> None:
        asked.append(1)
        if len(asked) == 2:
            raise Stopped("off")

    inner = ScriptedClient(retryable(), retryable(), retryable(), ok_response())
    client = RetryingClient(inner, RetryPolicy(max_attempts=5), sleep=Sleeps())
    with checked_between_tries(off_at_the_second_retry), pytest.raises(Stopped) as stopped:
        client.chat(REQUEST)
    assert inner.calls == 2 and len(asked) == 2  # not before the first try: the caller asked then
    assert [record.number for record in tries_before_stop(stopped.value)] == [1, 2]
    assert client.chat(REQUEST) is not None  # outside the block, no check is asked


def test_a_budget_that_refuses_a_retry_is_no_try_of_the_call() -> None:
    """The budget is asked again after a rate limit's wait (worker.llm.between_tries): refused there, it
    was recorded as a failed try, and extraction wrote a provider error for a request never sent."""
    from decimal import Decimal

    from worker.llm.errors import BudgetExhaustedError

    spent = BudgetExhaustedError("day", Decimal("1"), Decimal("1.2"), key="llm.budget_daily_usd")
    inner = ScriptedClient(retryable(), spent)
    seen: list[AttemptRecord] = []
    client = RetryingClient(inner, RetryPolicy(max_attempts=5), sleep=Sleeps(), on_attempt=seen.append)
    with pytest.raises(BudgetExhaustedError) as refused:
        client.chat(REQUEST)
    assert inner.calls == 2 and [record.number for record in refused.value.attempts] == [1]
    assert refused.value.attempts[0].error is not spent
    assert [record.number for record in seen] == [1]  # told once (it was told twice: a listener's row each)


def test_a_sigterm_between_tries_keeps_the_tries_made_before_it() -> None:
    """A SIGTERM is raised as SystemExit, no Exception: the tries made before it were not attached, and
    the callers' stop branches (Exception only) never recorded them."""
    from worker.llm.between_tries import checked_between_tries, tries_before_stop

    def terminated() -> None:
        raise SystemExit(143)

    client = RetryingClient(
        ScriptedClient(retryable(), ok_response()), RetryPolicy(max_attempts=5), sleep=Sleeps()
    )
    with checked_between_tries(terminated), pytest.raises(SystemExit) as stopped:
        client.chat(REQUEST)
    assert [record.number for record in tries_before_stop(stopped.value)] == [1]


def test_an_anthropic_tool_answer_cut_in_a_surrogate_pair_is_storable_text() -> None:
    """Cut off at max_tokens inside an escaped emoji, the forced tool's input held a lone surrogate: every
    other reply is cleaned, this one was not, and the audit row quoting it failed the page's commit."""
    from anthropic.types import Message

    from worker.llm.anthropic_provider import AnthropicChatClient

    chat = AnthropicChatClient(model="claude-sonnet-4-5", base_url="http://127.0.0.1:9")
    message = Message.model_validate(
        {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "model": "claude-sonnet-4-5",
            "stop_reason": "max_tokens",
            "usage": {"input_tokens": 10, "output_tokens": 5},
            "content": [
                {
                    "type": "tool_use",
                    "id": "t1",
                    "name": REQUEST.schema_name,
                    "input": {"facts": [{"fact": "\ud83d"}]},
                }
            ],
        }
    )
    response = chat._read(message, REQUEST, 5)
    assert response.finish == "truncated" and response.text.encode("utf-8")


# A Messages API reply as the wire carries it, less its stop reason, usage and content.
ANTHROPIC_MESSAGE = {"id": "msg_1", "type": "message", "role": "assistant", "model": "claude-sonnet-4-5"}


def test_an_anthropic_batch_reply_the_sdk_cannot_read_keeps_its_billed_usage() -> None:
    """A content block newer than the installed SDK knows: the result was "not a message" at $0,
    though the provider billed it, so budgets undercounted."""
    from worker.llm.anthropic_provider import AnthropicChatClient
    from worker.llm.batches import AnthropicBatchClient

    chat = AnthropicChatClient(model="claude-sonnet-4-5", base_url="http://127.0.0.1:9")
    message = {
        **ANTHROPIC_MESSAGE,
        "stop_reason": "end_turn",
        # A usage field newer than the SDK knows too (its Usage refuses "flex"): the counts are read.
        "usage": {"input_tokens": 1200, "output_tokens": 300, "service_tier": "flex"},
        "content": {"not": "a list"},  # what no SDK reads as a message
    }
    item = AnthropicBatchClient(chat)._item({"type": "succeeded", "message": message}, REQUEST)
    assert item is not None and item.response is None and "not a message" in (item.error or "")
    assert item.usage is not None and (item.usage.input_tokens, item.usage.output_tokens) == (1200, 300)


def test_an_anthropic_batch_reply_with_values_newer_than_the_sdk_is_read_as_online() -> None:
    """Validated strictly (the online path and the SDK's own batch reader build replies unchecked), a
    sound, paid reply with a usage value, a stop reason or a block type the installed SDK does not know
    was "not a message": its facts dropped, the segment sent and paid for again on every pass."""
    from worker.llm.anthropic_provider import AnthropicChatClient
    from worker.llm.batches import AnthropicBatchClient

    chat = AnthropicChatClient(model="claude-sonnet-4-5", base_url="http://127.0.0.1:9")
    message = {
        **ANTHROPIC_MESSAGE,
        "stop_reason": "end_turn",
        "stop_details": {"category": "something_newer"},
        "usage": {"input_tokens": 1200, "output_tokens": 300, "speed": "turbo", "service_tier": "flex"},
        "content": [
            {"type": "thinking_summary_v9", "summary": "a block type newer than the SDK"},
            {"type": "text", "text": '{"facts": []}'},
        ],
    }
    item = AnthropicBatchClient(chat)._item({"type": "succeeded", "message": message}, REQUEST)
    assert item is not None and item.error is None and item.response is not None
    assert item.response.text == '{"facts": []}' and item.response.finish == "end"
    assert (item.response.usage.input_tokens, item.response.usage.output_tokens) == (1200, 300)
    newer_stop = message | {"stop_reason": "a_reason_newer_than_the_sdk"}
    later = AnthropicBatchClient(chat)._item({"type": "succeeded", "message": newer_stop}, REQUEST)
    assert later is not None and later.response is not None  # read as online reads it


def test_a_batch_request_the_provider_rejects_is_a_permanent_failure_told_in_few_words() -> None:
    """A batch's 400 kept only a string: it never counted towards skipping the segment (the page failed
    on every pass), and an error without a message stored the provider's whole body, page text and all."""
    import json

    from worker.extraction.batch import batch_segment_result
    from worker.llm.anthropic_provider import AnthropicChatClient
    from worker.llm.batches import AnthropicBatchClient, OpenAIBatchClient
    from worker.llm.openai_compat import OpenAIChatClient

    openai_batches = OpenAIBatchClient(
        OpenAIChatClient(model="gpt-4o-mini", base_url="http://127.0.0.1:9/v1")
    )
    items: dict[str, Any] = {}
    echoed = {"status_code": 400, "body": {"echo": "Alice's private diagnosis " * 200}}
    refused = {
        "status_code": 400,
        "body": {"error": {"message": "context too long", "type": "invalid_request_error"}},
    }
    broke = {"status_code": 400, "body": {"error": {"message": "no credit", "code": "insufficient_quota"}}}
    for custom_id, response in (("a", echoed), ("b", refused), ("c", broke)):
        line = json.dumps({"custom_id": custom_id, "response": response})
        openai_batches._read_line("batch_1", 1, line, {"a": REQUEST, "b": REQUEST, "c": REQUEST}, items)
    assert "Alice" not in (items["a"].error or "") and "not kept" in (items["a"].error or "")
    assert items["b"].error == "HTTP 400: context too long"
    results = {key: batch_segment_result(item, openai_batches, 10, 100) for key, item in items.items()}
    assert results["a"].permanent and results["b"].permanent and results["b"].attempts[0].rejected
    assert not results["c"].permanent  # the account's fault, not the segment's
    anthropic_batches = AnthropicBatchClient(
        AnthropicChatClient(model="claude-sonnet-4-5", base_url="http://127.0.0.1:9")
    )
    errored = {
        "type": "errored",
        "error": {"type": "error", "error": {"type": "invalid_request_error", "message": "too long"}},
    }
    item = anthropic_batches._item(errored, REQUEST)
    assert (
        item is not None
        and item.status == 400
        and batch_segment_result(item, anthropic_batches, 10, 100).permanent
    )


# --------------------------------------------------------------------------------------------------
# A caller's deadline (worker.llm.deadline)
# --------------------------------------------------------------------------------------------------


def test_a_deadlines_clock_starts_at_the_first_call_and_ends_tries_and_waits(monkeypatch) -> None:
    """A search's database reads before its first LLM call are not the calls' time; past it, a retry's
    wait ends with the deadline, and neither a retry nor a new call's first try goes out."""
    clock = FakeClock()
    monkeypatch.setattr(deadline, "time", SimpleNamespace(monotonic=clock))
    inner = ScriptedClient(retryable(), ok_response())
    sleeps: list[float] = []

    def sleep(seconds: float) -> None:  # the wait passes on the fake clock
        sleeps.append(seconds)
        clock.now += seconds

    policy = RetryPolicy(max_attempts=5, backoff_base_seconds=4, max_total_wait_seconds=60)
    retrying = RetryingClient(inner, policy, sleep=sleep, rng=random.Random(1))
    with deadline.call_deadline(3.0):
        clock.now += 100  # the reads before the first call
        assert deadline.time_left() == 3.0
        clock.now += 1
        with pytest.raises(CallDeadlineError) as stopped:
            retrying.chat(REQUEST)
        assert sleeps == [2.0]  # the wait (2 to 4 s) cut to the time left
        assert inner.calls == 1 and [a.number for a in stopped.value.attempts] == [1]
        with pytest.raises(CallDeadlineError):
            retrying.embed(["x"])  # begun past the deadline: no first try
        assert inner.calls == 1
    assert deadline.time_left() is None


def test_a_retry_after_past_the_deadline_ends_the_call_at_once_with_the_providers_answer(monkeypatch) -> None:
    """A 429 saying "after 30 s" under a search's 10 s deadline: the wait was cut to the 10 s left and
    slept out, the next try refused, and the caller told the LLM was slow (the 429 lost). It ends now."""
    clock = FakeClock()
    monkeypatch.setattr(deadline, "time", SimpleNamespace(monotonic=clock))
    inner = ScriptedClient(retryable(429, retry_after=30), ok_response())
    sleeps = Sleeps()
    retrying = RetryingClient(inner, RetryPolicy(max_attempts=5, max_total_wait_seconds=60), sleep=sleeps)
    with deadline.call_deadline(10.0), pytest.raises(LLMError) as refused:
        retrying.chat(REQUEST)
    assert not isinstance(refused.value, CallDeadlineError) and refused.value.status == 429
    assert sleeps == [] and inner.calls == 1


def test_a_rate_limits_wait_past_the_deadline_ends_the_call_at_once(monkeypatch) -> None:
    """A search whose key's limit was 30 s ahead slept the 30 s out, then was refused (10 s of calls):
    the client had given up long before. A wait that ends past the deadline ends the call now, charged
    nothing; one that ends within it is waited."""
    clock = FakeClock()
    monkeypatch.setattr(deadline, "time", SimpleNamespace(monotonic=clock))
    limiter = LocalRateLimiter(
        RateLimits(requests_per_minute=2, burst_seconds=0), clock=clock, sleep=clock.sleep
    )
    inner = ScriptedClient(ok_response(), ok_response())
    limited = RateLimitedClient(inner, limiter)
    limited.chat(REQUEST)  # the next may go 30 s later
    with deadline.call_deadline(10.0), pytest.raises(CallDeadlineError):
        limited.chat(REQUEST)
    assert inner.calls == 1 and clock.now == 1000.0  # no wait slept, no try sent
    clock.now += 25
    with deadline.call_deadline(10.0):  # 5 s to wait: within it
        limited.chat(REQUEST)
    assert inner.calls == 2 and clock.now == pytest.approx(1030.0)


def test_a_deadline_that_refuses_a_try_inside_the_client_is_no_try() -> None:
    """A rate limit's wait ended by the deadline raised inside the try: it was recorded as a failed call
    (a row in llm_calls, the listener told) though no request was sent."""
    heard: list[AttemptRecord] = []
    retrying, _ = client(
        ScriptedClient(CallDeadlineError()), RetryPolicy(max_attempts=3), on_attempt=heard.append
    )
    with pytest.raises(CallDeadlineError) as stopped:
        retrying.chat(REQUEST)
    assert stopped.value.attempts == () and heard == []


def anthropic_cut_reply(model: str, stop_reason: str, usage: dict[str, int]) -> ChatResponse:
    """An Anthropic reply cut off mid-JSON (its stop reason ``stop_reason``), in the gateway's terms."""
    from anthropic._models import construct_type_unchecked
    from anthropic.types import Message

    from worker.llm.anthropic_provider import AnthropicChatClient

    chat = AnthropicChatClient(model=model, base_url="http://127.0.0.1:9")
    raw = {
        **ANTHROPIC_MESSAGE,
        "stop_reason": stop_reason,
        "usage": usage,
        "content": [{"type": "text", "text": '{"facts": [{"fact": "cut'}],
    }
    return chat.response_from(construct_type_unchecked(value=raw, type_=Message), REQUEST, 5)


def test_a_truncated_segment_whose_raised_cap_is_refused_is_given_up() -> None:
    """FACTMILL_LLM_MAX_OUTPUT_TOKENS over half the model's output limit: a truncated reply's retry asked
    for more than the limit, a 400 that blames the settings (not the segment), so the segment was never
    given up: the page failed at it on every run, paying for its first call again."""
    from worker.extraction.segments import extract_segment

    capped = anthropic_cut_reply(
        "claude-haiku-4-5", "max_tokens", {"input_tokens": 900, "output_tokens": 4096}
    )
    refused = to_llm_error(
        anthropic.BadRequestError(
            "Error code: 400",
            response=httpx2.Response(400, request=HTTP_REQUEST),
            body={
                "type": "error",
                "error": {
                    "type": "invalid_request_error",
                    "message": "max_tokens: 8192 > 4096, which is the maximum allowed number of output "
                    "tokens",
                },
            },
        )
    )
    assert refused.deployment_fault

    class TruncatedThenRefused:
        provider, model = "anthropic", "claude-haiku-4-5"

        def chat(self, request: ChatRequest) -> ChatResponse:
            if request.max_tokens > 4096:
                raise refused
            return capped

    result = extract_segment(TruncatedThenRefused(), "**A** (2024-01-01 9:00 AM): hi", 10, 4096)  # type: ignore[arg-type]
    assert [a.outcome for a in result.attempts] == ["truncated_output", "provider_error"]
    assert result.permanent


def test_a_reply_cut_off_by_the_context_window_is_not_asked_again_with_a_larger_cap() -> None:
    """Anthropic's model_context_window_exceeded was read as a reply over its cap: the segment was asked
    again with twice the cap, which stopped at the same window (a paid call lost per segment)."""
    from worker.extraction.segments import extract_segment

    usage = {"input_tokens": 199_000, "output_tokens": 1000}
    cut = anthropic_cut_reply("claude-sonnet-4-5", "model_context_window_exceeded", usage)
    assert cut.finish == "truncated" and cut.window_full
    capped = anthropic_cut_reply("claude-sonnet-4-5", "max_tokens", usage)
    assert capped.finish == "truncated" and not capped.window_full

    class Replying:
        provider, model = "anthropic", "claude-sonnet-4-5"

        def __init__(self, response: ChatResponse) -> None:
            self.response, self.caps = response, []  # type: list[int]

        def chat(self, request: ChatRequest) -> ChatResponse:
            self.caps.append(request.max_tokens)
            return self.response

    window = Replying(cut)
    result = extract_segment(window, "**A** (2024-01-01 9:00 AM): hi", 10, 1024)  # type: ignore[arg-type]
    assert window.caps == [1024] and [a.outcome for a in result.attempts] == ["truncated_output"]
    assert "context window" in (result.attempts[0].error or "")
    over_cap = Replying(capped)  # a reply over its cap is still asked again, with twice the cap
    extract_segment(over_cap, "**A** (2024-01-01 9:00 AM): hi", 10, 1024)  # type: ignore[arg-type]
    assert over_cap.caps == [1024, 2048]
    # A batch's (a backfill's) repeats on every pass at the same cap: permanent, as a refusal is.
    from worker.extraction.batch import batch_segment_result
    from worker.llm.anthropic_provider import AnthropicChatClient
    from worker.llm.batch_api import BatchItem
    from worker.llm.batches import AnthropicBatchClient

    batches = AnthropicBatchClient(
        AnthropicChatClient(model="claude-sonnet-4-5", base_url="http://127.0.0.1:9")
    )
    assert batch_segment_result(BatchItem(cut), batches, 10, 1024).permanent
    assert not batch_segment_result(BatchItem(capped), batches, 10, 1024).permanent


def test_compact_now_says_what_to_do_by_whose_fault_a_failed_call_was() -> None:
    """An organization on hold or a workspace's policy (deployment faults since Anthropic's details codes
    are read) was told to fix the key, model or URL, which none of them is."""
    from worker.cli.compaction import _what_to_do

    def error(status: int, error: dict[str, Any]) -> LLMError:
        response = httpx2.Response(status, request=HTTP_REQUEST)
        return to_llm_error(
            anthropic.APIStatusError("Error", response=response, body={"type": "error", "error": error})
        )

    on_hold = error(
        400,
        {"type": "invalid_request_error", "message": "x", "details": {"error_code": "organization_on_hold"}},
    )
    assert "refuses this account's or settings' requests" in _what_to_do(on_hold)
    assert "fix the provider's key" in _what_to_do(
        error(401, {"type": "authentication_error", "message": "bad key"})
    )
    assert "top it up" in _what_to_do(
        error(
            429,
            {
                "type": "rate_limit_error",
                "message": "x",
                "details": {"error_code": "enforced_spend_limit_reached"},
            },
        )
    )
    assert _what_to_do(error(529, {"type": "overloaded_error", "message": "busy"})) == "try again later"
