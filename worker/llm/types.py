"""The gateway's small vocabulary: a chat request, its response, its usage."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypedDict

from worker.llm.deadline import time_left

Finish = Literal["end", "truncated", "refusal"]


@dataclass(frozen=True)
class ChatRequest:
    purpose: str
    system: str
    # (role, content) turns after the system prompt; roles are "user" and "assistant".
    messages: tuple[tuple[str, str], ...]
    max_tokens: int
    json_schema: dict[str, Any] | None = None
    schema_name: str = "response"
    # Stable key for provider-side prompt caching (OpenAI prompt_cache_key).
    cache_key: str | None = None


@dataclass(frozen=True)
class Usage:
    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0


# The stop reason of a reply cut off by the model's context window (prompt and reply together).
CONTEXT_WINDOW_FULL = "model_context_window_exceeded"


@dataclass(frozen=True)
class ChatResponse:
    text: str
    finish: Finish
    usage: Usage
    provider: str
    model: str
    latency_ms: int
    refusal: str | None = None
    raw_finish_reason: str | None = field(default=None, compare=False)

    @property
    def window_full(self) -> bool:
        """Cut off by the model's context window, not the reply's cap (Anthropic's
        model_context_window_exceeded): a larger cap cannot help; a shorter prompt can."""
        return self.finish == "truncated" and self.raw_finish_reason == CONTEXT_WINDOW_FULL


class LLMClient(Protocol):
    """What the rest of Factmill calls; providers implement it."""

    provider: str
    model: str

    def chat(self, request: ChatRequest) -> ChatResponse: ...

    def embed(self, texts: list[str], *, purpose: str = "embedding") -> EmbeddingResponse: ...


@dataclass(frozen=True)
class EmbeddingResponse:
    vectors: list[list[float]]
    usage: Usage
    provider: str
    model: str
    latency_ms: int


class SdkConnection(TypedDict, total=False):
    """Where and how an SDK client reaches its server: the keywords both chat clients take."""

    base_url: str | None
    api_key: str | None
    timeout: float
    default_headers: dict[str, str] | None


# A connection is made (or refused) within this, whatever the reply's time: a host that drops packets
# cost the whole reply timeout (60 s), times every try.
CONNECT_TIMEOUT_SECONDS = 10.0
# FACTMILL_LLM_TIMEOUT_SECONDS is the time a reply of up to this many output tokens may take; a call that
# allows more output gets proportionally more (a non-streamed reply arrives whole, so the read timeout
# bounds its generation: the truncation retry's 8,192 tokens at 60-100 a second timed out every time).
REPLY_TOKENS_PER_TIMEOUT = 2048


def sdk_options(
    sdk: Any,
    *,
    base_url: str | None = None,
    api_key: str | None = None,
    timeout: float = 60.0,
    default_headers: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Constructor options shared by both SDK clients (``sdk`` is the ``openai`` or ``anthropic``
    package): our one retry layer, so the SDK's own is off; the connect timeout apart from the reply's."""
    return {
        "base_url": base_url,
        "api_key": api_key or "not-needed",  # local servers and the simulator need no key
        "timeout": reply_timeout(sdk, timeout),
        "max_retries": 0,
        "default_headers": default_headers,
    }


def longest_try_seconds(seconds: float, max_tokens: int) -> float:
    """How long one try of a call that may write ``max_tokens`` may wait for its reply and connection
    (``reply_timeout``'s two parts, before any caller's deadline cuts them)."""
    return seconds * max(1.0, max_tokens / REPLY_TOKENS_PER_TIMEOUT) + min(seconds, CONNECT_TIMEOUT_SECONDS)


def reply_timeout(sdk: Any, seconds: float, max_tokens: int = 0) -> Any:
    """The SDK's Timeout for a call that may write ``max_tokens`` (see REPLY_TOKENS_PER_TIMEOUT), cut
    to the time its caller's deadline leaves (worker.llm.deadline.call_deadline; a second at least)."""
    read = seconds * max(1.0, max_tokens / REPLY_TOKENS_PER_TIMEOUT)
    connect = min(seconds, CONNECT_TIMEOUT_SECONDS)
    left = time_left()
    if left is not None:
        read, connect = min(read, max(left, 1.0)), min(connect, max(left, 1.0))
    return sdk.Timeout(read, connect=connect)


def keep_alive_http_client(sdk: Any, keep_alive: int | None) -> Any:
    """The HTTP client for an SDK client (``sdk`` is the ``openai`` or ``anthropic`` package) that keeps
    ``keep_alive`` connections open; None leaves the SDK's own (100). A worker with more calls in flight
    than that would close and reopen a connection per call."""
    default = sdk.DEFAULT_CONNECTION_LIMITS
    if keep_alive is None or keep_alive <= (default.max_keepalive_connections or 0):
        return None
    # The limits class of whichever httpx the SDK rides on (httpx or its fork httpx2).
    limits = type(default)(
        max_connections=max(keep_alive, default.max_connections or 0), max_keepalive_connections=keep_alive
    )
    return sdk.DefaultHttpxClient(limits=limits)
