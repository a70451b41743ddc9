"""OpenAI and OpenAI-compatible chat providers (vLLM, Ollama, llama.cpp, the bundled simulator)."""

from __future__ import annotations

import base64
import binascii
import hashlib
import sys
import time
from array import array
from typing import TYPE_CHECKING, Any, Literal, Unpack

from worker.llm.errors import LLMError, NoEmbeddingsError, error_in_reply, to_llm_error
from worker.llm.replies import ReplyShapeError, finite_vector, message_text, optional_text, token_count
from worker.llm.types import (
    ChatRequest,
    ChatResponse,
    EmbeddingResponse,
    Finish,
    SdkConnection,
    Usage,
    keep_alive_http_client,
    reply_timeout,
    sdk_options,
)

if TYPE_CHECKING:
    import openai

JsonMode = Literal["json_schema", "json_object", "none"]


# OpenAI (and the servers copying it) refuse a longer prompt_cache_key with a 400: every call would fail.
PROMPT_CACHE_KEY_MAX_CHARS = 64


def bounded_cache_key(key: str) -> str:
    """``key`` when it fits OpenAI's limit, else a digest of it that does (the same key, the same digest,
    so requests sharing a prefix still land on one cache)."""
    if len(key) <= PROMPT_CACHE_KEY_MAX_CHARS:
        return key
    return "sha256:" + hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:48]


def _usage(completion: Any) -> Usage:
    """A completion's token counts (ReplyShapeError when one is not a count)."""
    usage = completion.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    return Usage(
        input_tokens=token_count(usage.get("prompt_tokens"), "usage.prompt_tokens"),
        output_tokens=token_count(usage.get("completion_tokens"), "usage.completion_tokens"),
        cache_read_tokens=token_count(
            details.get("cached_tokens"), "usage.prompt_tokens_details.cached_tokens"
        ),
    )


def _billed(completion: Any) -> Usage | None:
    """The token counts of a reply that cannot be used otherwise, when they can be read (None else)."""
    try:
        return _usage(completion)
    except (ReplyShapeError, AttributeError, TypeError):
        return None


DEFAULT_EMBEDDING_MODEL = "text-embedding-3-small"
NO_EMBEDDING_MODEL = (
    "no embeddings model is set for this OpenAI-compatible server: set FACTMILL_EMBEDDING_MODEL to one of "
    "its models that answers 256 dimensions (vector search is off until then)"
)


class OpenAIChatClient:
    """Chat Completions through the official SDK; its own retries are off (one retry layer, ours)."""

    def __init__(
        self,
        *,
        model: str,
        json_mode: JsonMode = "json_schema",
        provider: str = "openai",
        embedding_model: str | None = DEFAULT_EMBEDDING_MODEL,  # None: no embeddings (NoEmbeddingsError)
        embedding_dimensions: int | None = 256,
        send_prompt_cache_key: bool = True,
        keep_alive: int | None = None,
        **connection: Unpack[SdkConnection],
    ) -> None:
        # OpenAI routes requests with the same prompt_cache_key to the same cache; servers that merely
        # speak the format may reject unknown fields, so the gateway turns it off for them.
        self.send_prompt_cache_key = send_prompt_cache_key
        self.embedding_model = embedding_model
        # The rate limiter's key for embed(): the endpoint that answers it.
        self.embedding_key = f"{provider}:{embedding_model}"
        self.embedding_dimensions = embedding_dimensions
        self.provider = provider
        self.model = model
        self.json_mode = json_mode
        # The SDK is imported when a client is made, not with this module: it takes a second or more to
        # import, and most processes (every CLI command that makes no LLM call) never need it.
        import openai

        self._client = openai.OpenAI(
            **sdk_options(openai, **connection), http_client=keep_alive_http_client(openai, keep_alive)
        )
        self._sdk_module, self._timeout = openai, connection.get("timeout", 60.0)

    def _response_format(self, request: ChatRequest) -> dict[str, Any] | None:
        if request.json_schema is None or self.json_mode == "none":
            return None
        if self.json_mode == "json_object":
            return {"type": "json_object"}
        return {
            "type": "json_schema",
            "json_schema": {"name": request.schema_name, "schema": request.json_schema, "strict": True},
        }

    @property
    def sdk(self) -> openai.OpenAI:
        """The SDK client underneath (the batch APIs use it directly)."""
        return self._client

    def chat_body(self, request: ChatRequest) -> dict[str, Any]:
        """The /chat/completions request body (also one line's body in a Batch API input file)."""
        messages: list[dict[str, str]] = [{"role": "system", "content": request.system}]
        messages += [{"role": role, "content": content} for role, content in request.messages]
        # OpenAI's reasoning models refuse max_tokens (400 unsupported_parameter: every call a deployment
        # fault); all its chat models take max_completion_tokens. Compatible servers know the old name.
        cap = "max_tokens" if self.provider == "openai-compatible" else "max_completion_tokens"
        body: dict[str, Any] = {"model": self.model, "messages": messages, cap: request.max_tokens}
        response_format = self._response_format(request)
        if response_format is not None:
            body["response_format"] = response_format
        if request.cache_key and self.send_prompt_cache_key:
            body["prompt_cache_key"] = bounded_cache_key(request.cache_key)
        return body

    def chat(self, request: ChatRequest) -> ChatResponse:
        body = self.chat_body(request)
        started = time.perf_counter()
        try:
            # The body is plain JSON already, so it goes through the SDK's own post() (same client, auth,
            # timeouts, retries and error classes) rather than chat.completions.create(), whose
            # typed-params transform walks every message union for nothing (bench/gateway.py). The reply
            # comes back as the decoded JSON (cast_to=object): building the ChatCompletion model was 15%
            # of the SDK's CPU (py-spy), for the five fields read below.
            timeout = reply_timeout(self._sdk_module, self._timeout, request.max_tokens)
            completion = self._client.post(
                "/chat/completions", body=body, cast_to=object, options={"timeout": timeout}
            )
            response = self.response_from(completion, int((time.perf_counter() - started) * 1000))
        except Exception as exc:
            raise to_llm_error(exc, int((time.perf_counter() - started) * 1000)) from exc
        return response

    def response_from(self, completion: Any, latency_ms: int) -> ChatResponse:
        """A chat completion's JSON (online, or one line of a batch's output file) in the gateway's terms."""
        failed = error_in_reply(completion, latency_ms, _billed(completion))
        if failed is not None:
            raise failed
        try:
            choice = completion["choices"][0]
            message = choice["message"]
            usage = _usage(completion)
            text = message_text(message.get("content"), "choices[0].message.content")
            refusal = optional_text(message.get("refusal"), "choices[0].message.refusal")
            reason = optional_text(choice.get("finish_reason"), "choices[0].finish_reason")
            model = optional_text(completion.get("model"), "model")
        except ReplyShapeError as exc:
            reason = f"the provider's reply is not a chat completion ({exc})"
            raise LLMError(reason, retryable=False, latency_ms=latency_ms, usage=_billed(completion)) from exc
        except (KeyError, IndexError, TypeError, AttributeError) as exc:
            raise LLMError(
                f"the provider's reply is not a chat completion ({type(exc).__name__}: {exc})",
                retryable=False,
                latency_ms=latency_ms,
                usage=_billed(completion),
            ) from exc
        finish: Finish = "end"
        if refusal or reason == "content_filter":
            finish = "refusal"
        elif reason == "length":
            finish = "truncated"
        return ChatResponse(
            text=text,
            finish=finish,
            usage=usage,
            provider=self.provider,
            model=model or self.model,
            latency_ms=latency_ms,
            refusal=refusal,
            raw_finish_reason=reason,
        )

    def embed(self, texts: list[str], *, purpose: str = "embedding") -> EmbeddingResponse:
        """Embeddings through the OpenAI embeddings API (the simulator returns deterministic vectors).

        As for chat, the body goes through the SDK's own post() and the reply comes back as decoded
        JSON: its typed transform of the params and its CreateEmbeddingResponse model were half of an
        embedding call's CPU in a worker (py-spy, bench/pipeline.py). The vectors come as base64
        float32, as the SDK asks for them by default; a server that sends float lists instead is read
        as well. With no embeddings model, NoEmbeddingsError (no call made)."""
        if self.embedding_model is None:
            raise NoEmbeddingsError(NO_EMBEDDING_MODEL)
        body: dict[str, Any] = {"model": self.embedding_model, "input": texts, "encoding_format": "base64"}
        if self.embedding_dimensions is not None:
            body["dimensions"] = self.embedding_dimensions
        started = time.perf_counter()
        try:
            timeout = reply_timeout(self._sdk_module, self._timeout)  # a caller's deadline cuts it
            result: Any = self._client.post(
                "/embeddings", body=body, cast_to=object, options={"timeout": timeout}
            )
        except Exception as exc:
            error = to_llm_error(exc, int((time.perf_counter() - started) * 1000))
            # The call's row names the model it asked for (the chat model's name otherwise).
            error.answered_by = error.answered_by or (self.provider, self.embedding_model)
            raise error from exc
        latency_ms = int((time.perf_counter() - started) * 1000)
        # A gateway's error inside a 200 (its 429 or 502 retried, its 401 the deployment's), as for chat:
        # read as "not an embeddings list", each was final and unretried, the provider's words lost.
        failed = error_in_reply(result, latency_ms, _embeddings_billed(result))
        if failed is not None:
            failed.answered_by = failed.answered_by or (self.provider, self.embedding_model)
            raise failed
        try:
            items = sorted(result["data"], key=lambda item: item["index"])
            vectors = [finite_vector(_vector(item["embedding"]), "data[].embedding") for item in items]
            usage = result.get("usage") or {}
            input_tokens = token_count(usage.get("prompt_tokens"), "usage.prompt_tokens")
            model = optional_text(result.get("model"), "model")
            if len(vectors) != len(texts):
                raise ReplyShapeError(f"{len(vectors)} embeddings came back for {len(texts)} texts")
        except (KeyError, IndexError, TypeError, AttributeError, ValueError, binascii.Error) as exc:
            raise LLMError(
                f"the provider's reply is not an embeddings list ({type(exc).__name__}: {exc})",
                retryable=False,
                latency_ms=latency_ms,
                usage=_embeddings_billed(result),
                answered_by=(self.provider, self.embedding_model),
            ) from exc
        return EmbeddingResponse(
            vectors=vectors,
            usage=Usage(input_tokens=input_tokens),
            provider=self.provider,
            model=model or self.embedding_model,
            latency_ms=latency_ms,
        )


def _embeddings_billed(result: Any) -> Usage | None:
    """The tokens an embeddings reply that cannot be used billed, when they can be read (None else)."""
    try:
        usage = result.get("usage") or {}
        return Usage(input_tokens=token_count(usage.get("prompt_tokens"), "usage.prompt_tokens"))
    except (ReplyShapeError, AttributeError, TypeError):
        return None


def _vector(embedding: Any) -> list[float]:
    """One embedding as floats: base64 of little-endian float32 (what was asked for), or a list."""
    if isinstance(embedding, str):
        values = array("f", base64.b64decode(embedding, validate=True))
        if sys.byteorder == "big":
            values.byteswap()
        return values.tolist()
    return [float(value) for value in embedding]
