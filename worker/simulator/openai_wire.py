"""The OpenAI wire format: POST /v1/chat/completions and /v1/embeddings, their errors and faults."""

from __future__ import annotations

import base64
import json
import re
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from worker.simulator.caching import CacheLookup, openai_prefixes
from worker.simulator.config import (
    OUTCOME_OK,
    SYSTEM_FINGERPRINT,
    Draw,
    Fault,
    SimulatorConfig,
    sim_id,
)
from worker.simulator.embeddings import embed_text
from worker.simulator.prompt import PromptMessage, estimate_tokens
from worker.simulator.replies import SimReply, fill_json_schema
from worker.simulator.state import SimulatorState
from worker.simulator.wire import (
    BATCH_TIMEOUT_MESSAGE,
    REFUSAL_TEXT,
    BadRequest,
    FlatPrompt,
    PromptRequest,
    WireFormat,
    endpoint,
    positive_int,
    required_model,
    retry_after_headers,
    serve_online,
    shape_text,
    simulated_reply,
    stop_list,
)


def openai_error(
    status: int,
    message: str,
    error_type: str,
    code: str | None = None,
    *,
    param: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> Response:
    body = {"error": {"message": message, "type": error_type, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers={"x-request-id": sim_id("req_"), **(headers or {})})


PROMPT_CACHE_KEY_MAX_CHARS = 64
# OpenAI's reasoning models, which refuse max_tokens (max_completion_tokens only).
REASONING_MODEL = re.compile(r"(?:o\d|gpt-5)(?:$|[-.])")
MAX_CHOICES = 128


def invalid_request(exc: BadRequest) -> Response:
    return openai_error(400, exc.message, "invalid_request_error", exc.code, param=exc.param)


def _fault_response(fault: Fault, config: SimulatorConfig, model: str) -> Response:
    if fault is Fault.RATE_LIMIT:
        return openai_error(
            429,
            f"Rate limit reached for {model} (simulated by the Factmill LLM simulator). "
            f"Please try again in {config.retry_after_seconds:g}s.",
            "requests",
            "rate_limit_exceeded",
            headers=retry_after_headers(config.retry_after_seconds),
        )
    if fault is Fault.SERVER_ERROR:
        return openai_error(
            500, "The server had an error while processing your request (simulated).", "server_error"
        )
    return openai_error(
        503,
        "The engine is currently overloaded, please try again later (simulated).",
        "server_error",
        "overloaded",
    )


OPENAI = WireFormat(
    invalid=invalid_request,
    fault=_fault_response,
    batch_timeout=lambda: openai_error(500, BATCH_TIMEOUT_MESSAGE, "server_error", "timeout"),
)


# --------------------------------------------------------------------------------------------------
# Prompt flattening
# --------------------------------------------------------------------------------------------------


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        pieces = []
        for part in content:
            if isinstance(part, Mapping):
                if isinstance(part.get("text"), str):
                    pieces.append(part["text"])
                elif part.get("type") in ("image_url", "input_image"):
                    pieces.append("[image]")
                elif part.get("type") in ("input_audio",):
                    pieces.append("[audio]")
            elif isinstance(part, str):
                pieces.append(part)
        return "\n".join(pieces)
    return json.dumps(content)


def flatten(body: Mapping[str, Any]) -> FlatPrompt:
    raw_messages = body.get("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise BadRequest("messages must be a non-empty array.", "messages")
    messages: list[PromptMessage] = []
    for index, raw in enumerate(raw_messages):
        if not isinstance(raw, Mapping) or not isinstance(raw.get("role"), str):
            raise BadRequest(f"messages[{index}] must be an object with a role.", f"messages[{index}]")
        messages.append(PromptMessage(raw["role"], _content_text(raw.get("content"))))

    # Tools and the response schema are rendered ahead of the messages (as OpenAI does), so they are part
    # of the stable prefix, as the client wrote them (keys in its order: a reordered schema is a new prefix).
    preamble = ""
    for key in ("tools", "response_format"):
        if body.get(key) is not None:
            preamble += json.dumps(body[key], ensure_ascii=False) + "\n"
    text = preamble + "".join(f"<|{m.role}|>\n{m.text}\n" for m in messages)
    # OpenAI caches any prefix of the prompt (worker.simulator.caching): nothing to mark here.
    return FlatPrompt(messages, text)


# --------------------------------------------------------------------------------------------------
# POST /v1/chat/completions
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _ChatRequest(PromptRequest):
    max_tokens: int | None  # None: the config's default_max_tokens
    choices: int
    cache: CacheLookup


def _parse_chat(
    state: SimulatorState, route: str, config: SimulatorConfig, body: Mapping[str, Any]
) -> _ChatRequest:
    model = required_model(body, "you must provide a model parameter", "model")
    prompt = flatten(body)
    state.remember(route, prompt.messages)
    if "max_tokens" in body and REASONING_MODEL.match(model):  # OpenAI's own answer
        raise BadRequest(
            "Unsupported parameter: 'max_tokens' is not supported with this model. Use "
            "'max_completion_tokens' instead.",
            "max_tokens",
            "unsupported_parameter",
        )
    max_tokens = positive_int(body.get("max_completion_tokens"), "max_completion_tokens")
    max_tokens = max_tokens or positive_int(body.get("max_tokens"), "max_tokens")
    choices = positive_int(body.get("n"), "n") or 1
    if choices > MAX_CHOICES:  # OpenAI's own bound
        raise BadRequest(f"n must be at most {MAX_CHOICES}.", "n")
    if body.get("stream"):
        raise BadRequest("The Factmill LLM simulator does not stream; send stream=false.", "stream")
    cache_key = str(body.get("prompt_cache_key") or "")
    if len(cache_key) > PROMPT_CACHE_KEY_MAX_CHARS:  # OpenAI's own limit and message
        raise BadRequest(
            "Invalid 'prompt_cache_key': string too long. Expected a string with maximum length "
            f"{PROMPT_CACHE_KEY_MAX_CHARS}, but got a string with length {len(cache_key)} instead.",
            "prompt_cache_key",
        )
    namespace = ("openai", cache_key, model)
    prefixes = openai_prefixes(namespace, prompt.text, config.cache_min_tokens)
    return _ChatRequest(
        body, model, prompt, max_tokens, choices, CacheLookup(state.cache_read(prefixes), prefixes)
    )


def _json_schema_of(response_format: Any) -> dict[str, Any] | None:
    if isinstance(response_format, Mapping) and response_format.get("type") == "json_schema":
        spec = response_format.get("json_schema")
        if isinstance(spec, Mapping) and isinstance(spec.get("schema"), Mapping):
            return dict(spec["schema"])
    return None


def _reply_text(reply: SimReply, response_format: Any) -> str:
    """The reply as the request wants it: plain, or as a JSON document (plain text fitted to the schema)."""
    wants_json = isinstance(response_format, Mapping) and response_format.get("type") in (
        "json_object",
        "json_schema",
    )
    if not wants_json or reply.kind in ("facts", "json"):
        return reply.text
    return json.dumps(fill_json_schema(_json_schema_of(response_format), reply.text), ensure_ascii=False)


def _chat_reply(
    state: SimulatorState, route: str, config: SimulatorConfig, chat: _ChatRequest, draw: Draw
) -> Response:
    cap = chat.max_tokens or config.default_max_tokens
    reply = simulated_reply(chat.prompt.messages, cap, config)
    outcome = OUTCOME_OK if draw.fault is None else draw.fault.value
    content: str | None = None
    refusal: str | None = None
    finish_reason = "stop"
    if draw.fault is Fault.REFUSAL:
        refusal = REFUSAL_TEXT
    else:
        text = _reply_text(reply, chat.body.get("response_format"))
        shaped = shape_text(text, draw.fault, cap, stop_list(chat.body.get("stop")))
        content = shaped.text
        if shaped.cut_short:
            finish_reason = "length"
        if shaped.over_cap:
            outcome = Fault.TRUNCATED.value

    prompt = chat.prompt
    prompt_tokens = estimate_tokens(prompt.text)
    state.cache_write(chat.cache.writes)
    cached = chat.cache.read_tokens
    completion_tokens = estimate_tokens(content if content is not None else refusal or "") * chat.choices
    state.record(
        route, outcome, input=prompt_tokens, output=completion_tokens, cache_read=cached, cache_creation=0
    )
    message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": refusal, "annotations": []}
    payload = {
        "id": sim_id("chatcmpl-"),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": chat.model,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "service_tier": "default",
        "choices": [
            {"index": i, "message": message, "logprobs": None, "finish_reason": finish_reason}
            for i in range(chat.choices)
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached, "audio_tokens": 0},
            "completion_tokens_details": {
                "reasoning_tokens": 0,
                "audio_tokens": 0,
                "accepted_prediction_tokens": 0,
                "rejected_prediction_tokens": 0,
            },
        },
    }
    return JSONResponse(payload, headers={"x-request-id": sim_id("req_")})


# A chat completion for a parsed body: what the online route answers, and each batched request.
answer_chat_completion = endpoint(OPENAI, _parse_chat, _chat_reply)


async def chat_completions(request: Request) -> Response:
    """POST /v1/chat/completions (OpenAI)."""
    return await serve_online(request, "chat.completions", OPENAI, answer_chat_completion)


# --------------------------------------------------------------------------------------------------
# POST /v1/embeddings
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _EmbeddingsRequest:
    model: str
    inputs: list[str]
    dimensions: int
    encoding: str


def _embedding_inputs(raw: Any) -> list[str]:
    if isinstance(raw, str):
        return [raw]
    if isinstance(raw, list) and raw:
        if all(isinstance(x, str) for x in raw):
            return list(raw)
        if all(isinstance(x, int) for x in raw):  # one pre-tokenised input
            return [" ".join(str(x) for x in raw)]
        if all(isinstance(x, list) and all(isinstance(t, int) for t in x) for x in raw):
            return [" ".join(str(t) for t in x) for x in raw]
    raise BadRequest("input must be a string, an array of strings, or token arrays (non-empty).", "input")


def _parse_embeddings(
    state: SimulatorState, route: str, config: SimulatorConfig, body: Mapping[str, Any]
) -> _EmbeddingsRequest:
    model = required_model(body, "you must provide a model parameter", "model")
    inputs = _embedding_inputs(body.get("input"))
    dimensions = positive_int(body.get("dimensions"), "dimensions") or config.embedding_dimensions
    if dimensions > 8192:
        raise BadRequest("dimensions must be at most 8192.", "dimensions")
    encoding = body.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise BadRequest("encoding_format must be 'float' or 'base64'.", "encoding_format")
    return _EmbeddingsRequest(model, inputs, dimensions, encoding)


def _embeddings_reply(
    state: SimulatorState, route: str, config: SimulatorConfig, request: _EmbeddingsRequest, draw: Draw
) -> Response:
    data = []
    for index, text in enumerate(request.inputs):
        vector = embed_text(text, request.dimensions)
        encoded: list[float] | str = vector
        if request.encoding == "base64":
            encoded = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
        data.append({"object": "embedding", "index": index, "embedding": encoded})
    tokens = sum(estimate_tokens(text) for text in request.inputs)
    # Content faults (malformed, truncated, refusal) do not apply to embeddings: those count as ok.
    outcome = draw.fault.value if draw.fault is Fault.TIMEOUT else OUTCOME_OK
    state.record(route, outcome, input=tokens)
    payload = {
        "object": "list",
        "data": data,
        "model": request.model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
    return JSONResponse(payload, headers={"x-request-id": sim_id("req_")})


_answer_embeddings = endpoint(OPENAI, _parse_embeddings, _embeddings_reply)


async def embeddings(request: Request) -> Response:
    """POST /v1/embeddings (OpenAI). Content faults (malformed, truncated, refusal) do not apply here."""
    return await serve_online(request, "embeddings", OPENAI, _answer_embeddings)
