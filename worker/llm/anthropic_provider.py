"""Anthropic chat provider: the Messages API through the official SDK, JSON through a forced tool."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Unpack

from worker.core.jsonvalues import made_storable
from worker.llm.errors import LLMError, NoEmbeddingsError, to_llm_error
from worker.llm.replies import ReplyShapeError, message_text, optional_text, token_count
from worker.llm.types import (
    CONTEXT_WINDOW_FULL,
    ChatRequest,
    ChatResponse,
    EmbeddingResponse,
    Finish,
    LLMClient,
    SdkConnection,
    Usage,
    keep_alive_http_client,
    reply_timeout,
    sdk_options,
)

if TYPE_CHECKING:
    import anthropic
    from anthropic.types import Message

# Stop reasons as the gateway names them. pause_turn (server tools) and stop_sequence end a turn normally.
STOP_REASONS: dict[str, Finish] = {
    "end_turn": "end",
    "tool_use": "end",
    "stop_sequence": "end",
    "pause_turn": "end",
    "max_tokens": "truncated",
    CONTEXT_WINDOW_FULL: "truncated",  # (ChatResponse.window_full says which)
    "refusal": "refusal",
}
NO_EMBEDDINGS = (
    "Anthropic has no embeddings API. Factmill embeds through the OpenAI embeddings API: set "
    "OPENAI_API_KEY (chat stays on Anthropic), or use FACTMILL_LLM=openai or simulator."
)


def _usage(message: Any) -> Usage:
    """A message's token counts (ReplyShapeError when one is not a count). Anthropic's input_tokens
    leaves out the cached parts; ours counts every prompt token, as OpenAI's prompt_tokens does, with
    the cached parts broken out beside it."""
    usage = message.usage
    cache_read = token_count(usage.cache_read_input_tokens, "usage.cache_read_input_tokens")
    cache_write = token_count(usage.cache_creation_input_tokens, "usage.cache_creation_input_tokens")
    return Usage(
        input_tokens=token_count(
            token_count(usage.input_tokens, "usage.input_tokens") + cache_read + cache_write,
            "usage.input_tokens (with the cached parts)",
        ),
        output_tokens=token_count(usage.output_tokens, "usage.output_tokens"),
        cache_read_tokens=cache_read,
        cache_write_tokens=cache_write,
    )


def _billed(message: Any) -> Usage | None:
    """The token counts of a message that cannot be used otherwise, when they can be read (None else)."""
    try:
        return _usage(message)
    except (ReplyShapeError, AttributeError, TypeError):
        return None


def billed_in(raw: object) -> Usage | None:
    """The token counts of a message the SDK cannot read as one (a content block, a stop reason or a
    usage field newer than it knows), from its ``usage`` counts alone, not validated as the SDK's
    Usage (whose strict fields may be what it could not read): such a reply was billed all the same."""
    usage = raw.get("usage") if isinstance(raw, dict) else None
    if not isinstance(usage, dict):
        return None
    counts = {name: usage.get(name) for name in _USAGE_COUNTS}
    return _billed(SimpleNamespace(usage=SimpleNamespace(**counts)))


_USAGE_COUNTS = ("input_tokens", "output_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")


class AnthropicChatClient:
    """Messages API through the official SDK; its own retries are off (one retry layer, ours).

    The system prompt is one block marked ``cache_control: ephemeral``: with the tool definition ahead
    of it, the stable part of every extraction prompt (tool schema + instructions) is a cached prefix.
    ``embeddings``, when given, answers ``embed()`` (Anthropic has no embeddings API of its own).
    """

    def __init__(
        self,
        *,
        model: str,
        provider: str = "anthropic",
        embeddings: LLMClient | None = None,
        keep_alive: int | None = None,
        **connection: Unpack[SdkConnection],
    ) -> None:
        self.provider = provider
        self.model = model
        self.embeddings = embeddings
        # embed() goes to another provider's endpoint (OpenAI's): the rate limiter keys it there, not
        # under this model's limits.
        self.embedding_key = getattr(embeddings, "embedding_key", f"{provider}:{model}")
        # The SDK is imported when a client is made, not with this module: it takes seconds to import
        # and most processes (every CLI command, a worker on another provider) never call Anthropic.
        import anthropic

        self._client = anthropic.Anthropic(
            **sdk_options(anthropic, **connection), http_client=keep_alive_http_client(anthropic, keep_alive)
        )
        self._sdk_module, self._timeout = anthropic, connection.get("timeout", 60.0)

    @property
    def sdk(self) -> anthropic.Anthropic:
        """The SDK client underneath (the batch APIs use it directly)."""
        return self._client

    def message_params(self, request: ChatRequest) -> dict[str, Any]:
        """The Messages API parameters (also one request's params in a Message Batch)."""
        return self._kwargs(request)

    def _kwargs(self, request: ChatRequest) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "model": self.model,
            "max_tokens": request.max_tokens,
            "system": [{"type": "text", "text": request.system, "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": role, "content": content} for role, content in request.messages],
        }
        if request.json_schema is not None:
            kwargs["tools"] = [
                {
                    "name": request.schema_name,
                    "description": f"Record the {request.schema_name} answer as structured data.",
                    "input_schema": request.json_schema,
                }
            ]
            kwargs["tool_choice"] = {"type": "tool", "name": request.schema_name}
        return kwargs

    def chat(self, request: ChatRequest) -> ChatResponse:
        kwargs = self._kwargs(request)
        started = time.perf_counter()
        try:
            timeout = reply_timeout(self._sdk_module, self._timeout, request.max_tokens)
            message = self._client.messages.create(**kwargs, timeout=timeout)
        except Exception as exc:
            raise to_llm_error(exc, int((time.perf_counter() - started) * 1000)) from exc
        return self.response_from(message, request, int((time.perf_counter() - started) * 1000))

    def response_from(self, message: Message, request: ChatRequest, latency_ms: int) -> ChatResponse:
        """A Message (online, or one succeeded result of a Message Batch) in the gateway's terms."""
        try:
            return self._read(message, request, latency_ms)
        except (ReplyShapeError, AttributeError, TypeError) as exc:  # the SDK builds replies unvalidated
            detail = str(exc) if isinstance(exc, ReplyShapeError) else type(exc).__name__
            raise LLMError(
                f"the provider's reply is not a message ({detail})",
                retryable=False,
                latency_ms=latency_ms,
                usage=_billed(message),
            ) from exc

    def _read(self, message: Message, request: ChatRequest, latency_ms: int) -> ChatResponse:
        texts: list[str] = []
        tool_input: object | None = None
        for block in message.content:
            if block.type == "tool_use" and block.name == request.schema_name and tool_input is None:
                tool_input = block.input
            elif block.type == "text":
                texts.append(message_text(block.text, "content[].text"))
        reason = optional_text(message.stop_reason, "stop_reason") or "end_turn"
        finish: Finish = STOP_REASONS.get(reason, "end")
        refusal: str | None = None
        if finish == "refusal":
            refusal = "".join(texts) or "the model refused"
        # The forced tool's input is the JSON answer; a cut-off tool call still says what it got so far.
        # Cleaned as every other reply is (made_storable): a lone surrogate, a \ud83d cut off at
        # max_tokens, failed the commit of the audit row quoting it, and the repair turn resending it.
        text = (
            made_storable(json.dumps(tool_input, ensure_ascii=False))
            if tool_input is not None
            else "".join(texts)
        )

        return ChatResponse(
            text=text if finish != "refusal" else "",
            finish=finish,
            usage=_usage(message),
            provider=self.provider,
            model=optional_text(message.model, "model") or self.model,
            latency_ms=latency_ms,
            refusal=refusal,
            raw_finish_reason=reason,
        )

    def embed(self, texts: list[str], *, purpose: str = "embedding") -> EmbeddingResponse:
        if self.embeddings is None:
            raise NoEmbeddingsError(NO_EMBEDDINGS)
        return self.embeddings.embed(texts, purpose=purpose)
