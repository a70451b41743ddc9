"""A wire-level LLM simulator speaking the OpenAI and Anthropic HTTP APIs, with latency and seeded faults.

The real `openai` and `anthropic` SDKs talk to it over HTTP, so the demo, the tests and the benchmarks
exercise the same client path production uses. It never pretends to be a real model: every response
carries `x-factmill-simulator: true`, ids and fingerprints start with `sim-`, and it advertises the
model `simulator-1`. What it answers comes from `worker.simulator.replies` (pure, deterministic).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import hashlib
import json
import logging
import math
import random
import socket
import struct
import threading
import time
import uuid
from collections import Counter, OrderedDict, deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Self

import uvicorn
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from worker.simulator.embeddings import DEFAULT_EMBEDDING_DIMENSIONS, embed_text
from worker.simulator.prompt import (
    CHARACTERS_PER_TOKEN,
    DEFAULT_MAX_FACTS,
    MAX_FACTS_CEILING,
    UNTRUSTED_CLOSE,
    UNTRUSTED_OPEN,
    PromptMessage,
    estimate_tokens,
    find_segment,
)
from worker.simulator.replies import SimReply, fill_json_schema, reply_to

logger = logging.getLogger(__name__)

SIMULATOR_HEADER = "x-factmill-simulator"
DEFAULT_FAULT_HEADER = "x-simulator-fault"
SIMULATOR_MODEL = "simulator-1"
SIMULATOR_EMBEDDING_MODEL = "simulator-embedding-1"
SYSTEM_FINGERPRINT = "sim-fp-factmill-1"
REFUSAL_TEXT = "I'm sorry, but I can't help with that request. (simulated refusal)"
# How many recent chat prompts the simulator keeps for inspection (GET /_simulator/requests).
RECENT_REQUESTS = 32
# What a summarizer that lost everything would say: the compaction headings and nothing specific.
LOSSY_SUMMARY = (
    "## Goal\nContinue the task.\n\n## Constraints & Preferences\n- (none)\n\n## Progress\n"
    "### Done\n- (none)\n### In Progress\n- (none)\n### Blocked\n- (none)\n\n## Key Decisions\n"
    "- (none)\n\n## Next Steps\n- Continue.\n\n## Critical Context\n- (none)"
)


class Fault(StrEnum):
    """Fault classes, named as the `x-simulator-fault` header spells them."""

    RATE_LIMIT = "429"
    SERVER_ERROR = "500"
    OVERLOADED = "529"
    TIMEOUT = "timeout"
    MALFORMED = "malformed"
    TRUNCATED = "truncated"
    REFUSAL = "refusal"


# The order in which one uniform draw is mapped onto the fault rates; changing it changes seeded runs.
FAULT_ORDER: tuple[Fault, ...] = tuple(Fault)
_HTTP_FAULTS = frozenset({Fault.RATE_LIMIT, Fault.SERVER_ERROR, Fault.OVERLOADED})
# Outcomes counted in stats besides the fault names.
OUTCOME_OK = "ok"
OUTCOME_INVALID = "invalid_request"


class SimulatorConfig(BaseModel):
    """Every knob of the simulator. Defaults: no latency, no faults, seed 0."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    seed: int = 0
    latency_ms: float = Field(default=0.0, ge=0)
    jitter_ms: float = Field(default=0.0, ge=0, description="uniform extra latency in [0, jitter_ms), seeded")
    rate_429: float = Field(default=0.0, ge=0, le=1)
    rate_500: float = Field(default=0.0, ge=0, le=1)
    rate_529: float = Field(
        default=0.0, ge=0, le=1, description="Anthropic 529 overloaded_error; 503 on OpenAI routes"
    )
    rate_timeout: float = Field(
        default=0.0, ge=0, le=1, description="hang for hang_seconds, then answer normally"
    )
    rate_malformed: float = Field(default=0.0, ge=0, le=1)
    rate_truncated: float = Field(default=0.0, ge=0, le=1)
    rate_refusal: float = Field(default=0.0, ge=0, le=1)
    retry_after_seconds: float = Field(
        default=1.0, ge=0, description="sent on 429 as Retry-After (and retry-after-ms)"
    )
    hang_seconds: float = Field(default=30.0, ge=0)
    fault_header: str | None = Field(
        default=DEFAULT_FAULT_HEADER,
        description="request header that forces a fault; None turns the escape hatch off",
    )
    default_max_facts: int = Field(default=DEFAULT_MAX_FACTS, ge=0, le=MAX_FACTS_CEILING)
    default_max_tokens: int = Field(
        default=4096, ge=1, description="OpenAI replies when the request sets no cap"
    )
    embedding_dimensions: int = Field(default=DEFAULT_EMBEDDING_DIMENSIONS, ge=1, le=8192)
    cache_capacity: int = Field(
        default=4096, ge=0, description="prompt-prefix LRU entries (0 disables caching)"
    )
    cache_min_tokens: int = Field(
        default=0, ge=0, description="shorter prefixes are never cached (real APIs: 1024)"
    )
    lossy_summary: bool = Field(
        default=False,
        description="compaction prompts (transcript in <untrusted-data>) get a content-free summary",
    )
    batch_delay_seconds: float = Field(
        default=0.5, ge=0, description="how long a batch takes, from creation to ended"
    )
    batch_expire: bool = Field(
        default=False, description="batches end expired, with results for only the first half of requests"
    )
    model: str = SIMULATOR_MODEL
    embedding_model: str = SIMULATOR_EMBEDDING_MODEL

    @model_validator(mode="after")
    def _rates_fit(self) -> Self:
        total = sum(self.fault_rates().values())
        if total > 1.0 + 1e-9:
            raise ValueError(f"fault rates add up to {total:.3f}; they must add up to at most 1")
        return self

    def fault_rates(self) -> dict[Fault, float]:
        return {
            Fault.RATE_LIMIT: self.rate_429,
            Fault.SERVER_ERROR: self.rate_500,
            Fault.OVERLOADED: self.rate_529,
            Fault.TIMEOUT: self.rate_timeout,
            Fault.MALFORMED: self.rate_malformed,
            Fault.TRUNCATED: self.rate_truncated,
            Fault.REFUSAL: self.rate_refusal,
        }

    @classmethod
    def with_error_rate(cls, error_rate: float, **overrides: Any) -> SimulatorConfig:
        """A config whose total fault rate is `error_rate`, spread evenly over every fault class."""
        if not 0.0 <= error_rate <= 1.0:
            raise ValueError("error_rate must be between 0 and 1")
        share = error_rate / len(FAULT_ORDER)
        rates = {f"rate_{fault.value}": share for fault in FAULT_ORDER}
        return cls(**{**rates, **overrides})


# --------------------------------------------------------------------------------------------------
# Shared state: config, seeded draws, the prompt-prefix cache, stats
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Draw:
    fault: Fault | None
    delay_seconds: float


class SimulatorState:
    """Mutable state of one simulator app. Guarded by a lock: the Python API reads it from other threads."""

    def __init__(self, config: SimulatorConfig) -> None:
        self._lock = threading.Lock()
        self.config = config
        self._prefixes: OrderedDict[str, int] = OrderedDict()
        # Uploaded files and batches live as long as the simulator (a reset only zeroes the stats).
        self.files: dict[str, _StoredFile] = {}
        self.batches: dict[str, _Batch] = {}
        self._reset_unlocked()

    def _reseed(self) -> None:
        seed = self.config.seed
        self._fault_rng = random.Random(seed)
        # A separate stream so changing the jitter never changes which requests fail.
        self._jitter_rng = random.Random(seed * 7919 + 104729)

    def _reset_unlocked(self) -> None:
        self._reseed()
        self._prefixes.clear()
        self.requests = 0
        self.by_route: Counter[str] = Counter()
        self.by_outcome: Counter[str] = Counter()
        self.by_route_outcome: dict[str, Counter[str]] = {}
        self.counters: Counter[str] = Counter()
        self.in_flight = 0
        self.max_in_flight = 0
        self._recent: deque[dict[str, Any]] = deque(maxlen=RECENT_REQUESTS)

    def reset(self) -> None:
        """Zero the stats, forget cached prefixes and restart the seeded streams."""
        with self._lock:
            self._reset_unlocked()

    def update_config(self, changes: Mapping[str, Any]) -> SimulatorConfig:
        """Apply a partial config (validated as a whole); a new seed restarts the seeded streams."""
        changes = dict(changes)
        if "error_rate" in changes:
            error_rate = float(changes.pop("error_rate"))
            spread = SimulatorConfig.with_error_rate(error_rate).fault_rates()
            for fault, rate in spread.items():
                changes.setdefault(f"rate_{fault.value}", rate)
        with self._lock:
            merged = {**self.config.model_dump(), **changes}
            new_config = SimulatorConfig.model_validate(merged)
            self.config = new_config
            if "seed" in changes:
                self._reseed()
            if new_config.cache_capacity == 0:
                self._prefixes.clear()
            return new_config

    def remember(self, route: str, messages: Sequence[PromptMessage]) -> None:
        """Keep a chat prompt as the simulator saw it (the newest RECENT_REQUESTS), for tests to inspect."""
        entry = {"route": route, "messages": [{"role": m.role, "text": m.text} for m in messages]}
        with self._lock:
            self._recent.append(entry)

    def recent_requests(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._recent)

    def begin(self) -> None:
        with self._lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)

    def end(self) -> None:
        with self._lock:
            self.in_flight -= 1

    def draw(self, forced: Fault | None) -> _Draw:
        """One seeded draw per request, even when a header forces the fault, so sequences stay aligned."""
        with self._lock:
            config = self.config
            roll = self._fault_rng.random()
            jitter = self._jitter_rng.random() * config.jitter_ms
        fault = forced
        if fault is None:
            cumulative = 0.0
            for candidate in FAULT_ORDER:
                cumulative += config.fault_rates()[candidate]
                if roll < cumulative:
                    fault = candidate
                    break
        return _Draw(fault, (config.latency_ms + jitter) / 1000.0)

    def cache_lookup(self, key: str, prefix_tokens: int) -> bool:
        """Whether this prefix was seen before (and remember it now). Too-short prefixes are never cached."""
        with self._lock:
            if self.config.cache_capacity == 0 or prefix_tokens <= 0:
                return False
            if prefix_tokens < self.config.cache_min_tokens:
                return False
            if key in self._prefixes:
                self._prefixes.move_to_end(key)
                return True
            self._prefixes[key] = prefix_tokens
            while len(self._prefixes) > self.config.cache_capacity:
                self._prefixes.popitem(last=False)
            return False

    def record(self, route: str, outcome: str, **counts: int) -> None:
        with self._lock:
            self.requests += 1
            self.by_route[route] += 1
            self.by_outcome[outcome] += 1
            self.by_route_outcome.setdefault(route, Counter())[outcome] += 1
            for name, count in counts.items():
                self.counters[name] += count

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "simulator": True,
                "requests_total": self.requests,
                "by_route": dict(self.by_route),
                "by_outcome": dict(self.by_outcome),
                "by_route_outcome": {route: dict(c) for route, c in self.by_route_outcome.items()},
                "tokens": {
                    "input": self.counters["input"],
                    "output": self.counters["output"],
                    "cache_read": self.counters["cache_read"],
                    "cache_creation": self.counters["cache_creation"],
                },
                "client_disconnects": self.counters["client_disconnects"],
                "in_flight": self.in_flight,
                "max_in_flight": self.max_in_flight,
                "cached_prefixes": len(self._prefixes),
                "config": self.config.model_dump(),
            }


# --------------------------------------------------------------------------------------------------
# Wire helpers
# --------------------------------------------------------------------------------------------------


class _SimulatorHeaderMiddleware:
    """Stamps `x-factmill-simulator: true` on every response, 404s included (pure ASGI: no body buffering)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                headers.append((SIMULATOR_HEADER.encode(), b"true"))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_header)


def _sim_id(prefix: str) -> str:
    return f"sim-{prefix}{uuid.uuid4().hex[:24]}"


class _BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def _openai_error(status: int, message: str, error_type: str, code: str | None = None, **kw: Any) -> Response:
    body = {"error": {"message": message, "type": error_type, "param": kw.pop("param", None), "code": code}}
    headers = {"x-request-id": _sim_id("req_"), **kw.pop("headers", {})}
    return JSONResponse(body, status_code=status, headers=headers)


def _anthropic_error(
    status: int, error_type: str, message: str, headers: Mapping[str, str] | None = None
) -> Response:
    request_id = _sim_id("req_")
    body = {"type": "error", "error": {"type": error_type, "message": message}, "request_id": request_id}
    return JSONResponse(body, status_code=status, headers={"request-id": request_id, **(headers or {})})


def _retry_after_headers(seconds: float) -> dict[str, str]:
    # Retry-After is whole seconds by RFC 9110; both SDKs prefer the finer retry-after-ms when present.
    return {"retry-after": str(math.ceil(seconds)), "retry-after-ms": str(round(seconds * 1000))}


def _openai_fault_response(fault: Fault, config: SimulatorConfig, model: str) -> Response:
    if fault is Fault.RATE_LIMIT:
        return _openai_error(
            429,
            f"Rate limit reached for {model} (simulated by the Factmill LLM simulator). "
            f"Please try again in {config.retry_after_seconds:g}s.",
            "requests",
            "rate_limit_exceeded",
            headers=_retry_after_headers(config.retry_after_seconds),
        )
    if fault is Fault.SERVER_ERROR:
        return _openai_error(
            500, "The server had an error while processing your request (simulated).", "server_error"
        )
    return _openai_error(
        503,
        "The engine is currently overloaded, please try again later (simulated).",
        "server_error",
        "overloaded",
    )


def _anthropic_fault_response(fault: Fault, config: SimulatorConfig) -> Response:
    if fault is Fault.RATE_LIMIT:
        return _anthropic_error(
            429,
            "rate_limit_error",
            "This request would exceed the rate limit (simulated by the Factmill LLM simulator).",
            headers=_retry_after_headers(config.retry_after_seconds),
        )
    if fault is Fault.SERVER_ERROR:
        return _anthropic_error(500, "api_error", "Internal server error (simulated).")
    return _anthropic_error(529, "overloaded_error", "Overloaded (simulated).")


async def _read_json(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.body())
    except (ValueError, UnicodeDecodeError) as exc:
        raise _BadRequest(f"The request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise _BadRequest("The request body must be a JSON object.")
    return body


def _forced_fault(request: Request, config: SimulatorConfig) -> Fault | None:
    if not config.fault_header:
        return None
    raw = request.headers.get(config.fault_header)
    if raw is None:
        return None
    try:
        return Fault(raw.strip().lower())
    except ValueError:
        allowed = "|".join(f.value for f in Fault)
        raise _BadRequest(f"{config.fault_header} must be one of {allowed}, not {raw!r}.") from None


async def _hang(request: Request, seconds: float) -> bool:
    """Sleep like a hung upstream; True if the client gave up meanwhile (so the task ends early)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while (remaining := deadline - loop.time()) > 0:
        await asyncio.sleep(min(0.05, remaining))
        if await request.is_disconnected():
            return True
    return False


def _cut_to_tokens(text: str, max_tokens: int) -> str:
    return text[: max(0, max_tokens) * CHARACTERS_PER_TOKEN]


def _malformed(text: str) -> str:
    """Prose around JSON that is cut off mid-way: what a model that ignored the format might send."""
    return f"Sure! Here is what I found in the conversation:\n\n{text[: max(1, len(text) // 2)]}"


def _truncated(text: str, max_tokens: int) -> str:
    half = max(1, len(text) // 2)
    return text[: min(half, max(1, max_tokens) * CHARACTERS_PER_TOKEN)]


def _apply_stop_sequences(text: str, stops: Sequence[str]) -> tuple[str, str | None]:
    cut_at, matched = len(text), None
    for stop in stops:
        index = text.find(stop) if stop else -1
        if 0 <= index < cut_at:
            cut_at, matched = index, stop
    return text[:cut_at], matched


def _stop_list(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return [s for s in value if isinstance(s, str)]
    return []


def _cache_key(*parts: str) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part.encode("utf-8", "surrogatepass"))
        digest.update(b"\x00")
    return digest.hexdigest()


def _positive_int(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _BadRequest(f"{name} must be a positive integer.", name)
    return value


# --------------------------------------------------------------------------------------------------
# Prompt flattening: the text the simulator "sees", for token counting, caching and answering
# --------------------------------------------------------------------------------------------------


def _openai_content_text(content: Any) -> str:
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


def _anthropic_block_text(block: Any) -> str:
    if isinstance(block, str):
        return block
    if not isinstance(block, Mapping):
        return json.dumps(block)
    kind = block.get("type")
    if kind == "text":
        return str(block.get("text", ""))
    if kind == "tool_use":
        return json.dumps(block.get("input", {}), ensure_ascii=False)
    if kind == "tool_result":
        content = block.get("content", "")
        if isinstance(content, list):
            return "\n".join(_anthropic_block_text(b) for b in content)
        return str(content)
    if kind in ("image", "document"):
        return f"[{kind}]"
    return json.dumps(block, ensure_ascii=False)


@dataclass(frozen=True)
class _FlatPrompt:
    messages: list[PromptMessage]
    text: str  # the whole prompt as one string (tokens are counted on it)
    cacheable_prefix: str  # a prefix of `text`; "" when nothing is cacheable


def _flatten_openai(body: Mapping[str, Any]) -> _FlatPrompt:
    raw_messages = body.get("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise _BadRequest("messages must be a non-empty array.", "messages")
    messages: list[PromptMessage] = []
    for index, raw in enumerate(raw_messages):
        if not isinstance(raw, Mapping) or not isinstance(raw.get("role"), str):
            raise _BadRequest(f"messages[{index}] must be an object with a role.", f"messages[{index}]")
        messages.append(PromptMessage(raw["role"], _openai_content_text(raw.get("content"))))

    # Tools and the response schema are rendered ahead of the messages (as OpenAI does), so they are part
    # of the stable prefix.
    preamble = ""
    for key in ("tools", "response_format"):
        if body.get(key) is not None:
            preamble += json.dumps(body[key], sort_keys=True, ensure_ascii=False) + "\n"
    headers = [f"<|{m.role}|>\n" for m in messages]
    pieces = [preamble] + [h + m.text + "\n" for h, m in zip(headers, messages, strict=True)]
    text = "".join(pieces)

    # OpenAI caches the longest previously seen prefix. The simulator treats as stable what an extraction
    # prompt puts before the segment, or, for any other prompt, everything before the last message.
    segment = find_segment(messages)
    if segment is not None:
        before = sum(len(p) for p in pieces[: segment.message_index + 1])
        prefix_len = before + len(headers[segment.message_index]) + segment.open_offset
    elif len(messages) > 1:
        prefix_len = sum(len(p) for p in pieces[:-1])
    else:
        prefix_len = 0
    return _FlatPrompt(messages, text, text[:prefix_len])


def _flatten_anthropic(body: Mapping[str, Any]) -> _FlatPrompt:
    raw_messages = body.get("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise _BadRequest("messages: at least one message is required")
    # (text, has cache_control) in the order Anthropic builds its prompt: tools, system, messages.
    parts: list[tuple[str, bool]] = []
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise _BadRequest("tools: Input should be a valid list")
    for tool in tools:
        if isinstance(tool, Mapping):
            clean = {k: v for k, v in tool.items() if k != "cache_control"}
            parts.append((json.dumps(clean, sort_keys=True, ensure_ascii=False), "cache_control" in tool))

    messages: list[PromptMessage] = []
    system = body.get("system")
    if isinstance(system, str):
        parts.append((system, False))
        messages.append(PromptMessage("system", system))
    elif isinstance(system, list):
        texts = []
        for block in system:
            text = _anthropic_block_text(block)
            texts.append(text)
            parts.append((text, isinstance(block, Mapping) and "cache_control" in block))
        messages.append(PromptMessage("system", "\n".join(texts)))
    elif system is not None:
        raise _BadRequest("system: Input should be a valid string or list of text blocks")

    for index, raw in enumerate(raw_messages):
        if not isinstance(raw, Mapping) or raw.get("role") not in ("user", "assistant"):
            raise _BadRequest(f"messages.{index}.role: Input should be 'user' or 'assistant'")
        content = raw.get("content")
        parts.append((f"<|{raw['role']}|>", False))
        if isinstance(content, str):
            parts.append((content, False))
            messages.append(PromptMessage(raw["role"], content))
        elif isinstance(content, list):
            texts = []
            for block in content:
                text = _anthropic_block_text(block)
                texts.append(text)
                parts.append((text, isinstance(block, Mapping) and "cache_control" in block))
            messages.append(PromptMessage(raw["role"], "\n".join(texts)))
        else:
            raise _BadRequest(f"messages.{index}.content: Input should be a valid string or list")

    text = ""
    prefix_len = 0
    for part, cached in parts:
        text += part + "\n"
        if cached:  # a cache breakpoint caches everything up to and including its block
            prefix_len = len(text)
    return _FlatPrompt(messages, text, text[:prefix_len])


# --------------------------------------------------------------------------------------------------
# Routes
# --------------------------------------------------------------------------------------------------


def _state(request: Request) -> SimulatorState:
    state: SimulatorState = request.app.state.simulator
    return state


def _json_schema_of(response_format: Any) -> dict[str, Any] | None:
    if isinstance(response_format, Mapping) and response_format.get("type") == "json_schema":
        spec = response_format.get("json_schema")
        if isinstance(spec, Mapping) and isinstance(spec.get("schema"), Mapping):
            return dict(spec["schema"])
    return None


def _structured_text(reply: SimReply, schema: Mapping[str, Any] | None) -> str:
    """The reply as a JSON document: facts as they are, plain text fitted into the requested schema."""
    if reply.kind == "facts":
        return reply.text
    return json.dumps(fill_json_schema(schema, reply.text), ensure_ascii=False)


# A hung upstream, for the online routes: sleeps, and says whether the client went away meanwhile.
# Batched requests have no connection to hang, so they pass None and a timeout fault errors the request.
Hang = Callable[[float], Awaitable[bool]]
BATCH_TIMEOUT_MESSAGE = "The request timed out while the batch was processed (simulated)."


async def chat_completions(request: Request) -> Response:
    """POST /v1/chat/completions (OpenAI)."""
    state = _state(request)
    route = "chat.completions"
    state.begin()
    try:
        try:
            body = await _read_json(request)
            forced = _forced_fault(request, state.config)
        except _BadRequest as exc:
            state.record(route, OUTCOME_INVALID)
            return _openai_error(400, exc.message, "invalid_request_error", param=exc.param)
        return await _answer_chat_completion(state, route, body, forced, lambda s: _hang(request, s))
    finally:
        state.end()


async def _answer_chat_completion(
    state: SimulatorState, route: str, body: Mapping[str, Any], forced: Fault | None, hang: Hang | None
) -> Response:
    """A chat completion for a parsed body: what the online route answers, and each batched request."""
    try:
        config = state.config
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise _BadRequest("you must provide a model parameter", "model")
        prompt = _flatten_openai(body)
        state.remember(route, prompt.messages)
        max_tokens = _positive_int(body.get("max_completion_tokens"), "max_completion_tokens")
        max_tokens = max_tokens or _positive_int(body.get("max_tokens"), "max_tokens")
        choices_n = _positive_int(body.get("n"), "n") or 1
        if body.get("stream"):
            raise _BadRequest("The Factmill LLM simulator does not stream; send stream=false.", "stream")
    except _BadRequest as exc:
        state.record(route, OUTCOME_INVALID)
        return _openai_error(400, exc.message, "invalid_request_error", param=exc.param)

    draw = state.draw(forced)
    if draw.delay_seconds and hang is not None:
        await asyncio.sleep(draw.delay_seconds)
    if draw.fault in _HTTP_FAULTS:
        assert draw.fault is not None
        state.record(route, draw.fault.value)
        return _openai_fault_response(draw.fault, config, model)
    if draw.fault is Fault.TIMEOUT and hang is None:
        state.record(route, Fault.TIMEOUT.value)
        return _openai_error(500, BATCH_TIMEOUT_MESSAGE, "server_error", "timeout")
    if draw.fault is Fault.TIMEOUT and hang is not None and await hang(config.hang_seconds):
        state.record(route, Fault.TIMEOUT.value, client_disconnects=1)
        return Response(status_code=499)  # nobody is listening any more; this only ends the task

    cap = max_tokens or config.default_max_tokens
    reply = reply_to(prompt.messages, max_tokens=cap, default_max_facts=config.default_max_facts)
    if config.lossy_summary:
        reply = _lossy(reply, prompt.messages)
    response_format = body.get("response_format")
    wants_json = isinstance(response_format, Mapping) and response_format.get("type") in (
        "json_object",
        "json_schema",
    )
    content: str | None = (
        _structured_text(reply, _json_schema_of(response_format)) if wants_json else reply.text
    )
    refusal: str | None = None
    finish_reason = "stop"
    outcome = OUTCOME_OK if draw.fault is None else draw.fault.value
    assert content is not None
    if draw.fault is Fault.REFUSAL:
        content, refusal = None, REFUSAL_TEXT
    elif draw.fault is Fault.MALFORMED:
        content = _malformed(content)
    elif draw.fault is Fault.TRUNCATED:
        content, finish_reason = _truncated(content, cap), "length"
    if content is not None:
        content, matched = _apply_stop_sequences(content, _stop_list(body.get("stop")))
        if matched is None and estimate_tokens(content) > cap:
            content, finish_reason, outcome = (
                _cut_to_tokens(content, cap),
                "length",
                Fault.TRUNCATED.value,
            )

    prompt_tokens = estimate_tokens(prompt.text)
    prefix_tokens = estimate_tokens(prompt.cacheable_prefix)
    cache_key = _cache_key("openai", str(body.get("prompt_cache_key") or ""), model, prompt.cacheable_prefix)
    cached = prefix_tokens if state.cache_lookup(cache_key, prefix_tokens) else 0
    completion_tokens = estimate_tokens(content if content is not None else refusal or "") * choices_n
    state.record(
        route, outcome, input=prompt_tokens, output=completion_tokens, cache_read=cached, cache_creation=0
    )
    message: dict[str, Any] = {
        "role": "assistant",
        "content": content,
        "refusal": refusal,
        "annotations": [],
    }
    payload = {
        "id": _sim_id("chatcmpl-"),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "service_tier": "default",
        "choices": [
            {"index": i, "message": message, "logprobs": None, "finish_reason": finish_reason}
            for i in range(choices_n)
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
    return JSONResponse(payload, headers={"x-request-id": _sim_id("req_")})


def _is_compaction_prompt(messages: Sequence[PromptMessage]) -> bool:
    for message in messages:
        start = message.text.find(UNTRUSTED_OPEN)
        if start >= 0 and message.text.rfind(UNTRUSTED_CLOSE) > start:
            return True
    return False


def _lossy(reply: SimReply, messages: Sequence[PromptMessage]) -> SimReply:
    """With lossy_summary on, a compaction prompt's summary keeps the headings and loses the content."""
    if reply.kind == "text" and _is_compaction_prompt(messages):
        return SimReply("text", LOSSY_SUMMARY)
    return reply


def _pick_tool(body: Mapping[str, Any], reply: SimReply) -> Mapping[str, Any] | None:
    tools = [t for t in body.get("tools") or [] if isinstance(t, Mapping) and isinstance(t.get("name"), str)]
    if not tools:
        return None
    choice = body.get("tool_choice") or {"type": "auto"}
    choice_type = choice.get("type") if isinstance(choice, Mapping) else None

    def wants_facts(tool: Mapping[str, Any]) -> bool:
        schema = tool.get("input_schema")
        return isinstance(schema, Mapping) and "facts" in (schema.get("properties") or {})

    if choice_type == "tool":
        return next((t for t in tools if t["name"] == choice.get("name")), None)
    if choice_type == "any":
        return next((t for t in tools if wants_facts(t)), tools[0])
    if choice_type == "auto" and reply.kind == "facts":
        # A model offered a tool made for exactly this answer would use it.
        return next((t for t in tools if wants_facts(t)), None)
    return None


def _fit_facts(payload: Mapping[str, Any], max_tokens: int) -> dict[str, Any]:
    """The facts that fit in max_tokens: what a partial tool input parsed from a cut-off reply would hold."""
    facts = list(payload.get("facts", []))
    while facts and estimate_tokens(json.dumps({"facts": facts}, ensure_ascii=False)) > max_tokens:
        facts.pop()
    return {"facts": facts}


async def messages_route(request: Request) -> Response:
    """POST /v1/messages (Anthropic)."""
    state = _state(request)
    route = "messages"
    state.begin()
    try:
        try:
            body = await _read_json(request)
            forced = _forced_fault(request, state.config)
        except _BadRequest as exc:
            state.record(route, OUTCOME_INVALID)
            return _anthropic_error(400, "invalid_request_error", exc.message)
        return await _answer_message(state, route, body, forced, lambda s: _hang(request, s))
    finally:
        state.end()


async def _answer_message(
    state: SimulatorState, route: str, body: Mapping[str, Any], forced: Fault | None, hang: Hang | None
) -> Response:
    """A Messages API reply for a parsed body: what the online route answers, and each batched request."""
    try:
        config = state.config
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise _BadRequest("model: Field required")
        max_tokens = body.get("max_tokens")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise _BadRequest("max_tokens: Field required (a positive integer)")
        prompt = _flatten_anthropic(body)
        state.remember(route, prompt.messages)
        tool_choice = body.get("tool_choice")
        if tool_choice is not None and not isinstance(tool_choice, Mapping):
            raise _BadRequest("tool_choice: Input should be an object")
        if isinstance(tool_choice, Mapping) and tool_choice.get("type") == "tool":
            names = {t.get("name") for t in body.get("tools") or [] if isinstance(t, Mapping)}
            if tool_choice.get("name") not in names:
                raise _BadRequest(f"tool_choice: tool {tool_choice.get('name')!r} is not in tools")
        if body.get("stream"):
            raise _BadRequest("stream: the Factmill LLM simulator does not stream; send stream=false")
    except _BadRequest as exc:
        state.record(route, OUTCOME_INVALID)
        return _anthropic_error(400, "invalid_request_error", exc.message)

    draw = state.draw(forced)
    if draw.delay_seconds and hang is not None:
        await asyncio.sleep(draw.delay_seconds)
    if draw.fault in _HTTP_FAULTS:
        assert draw.fault is not None
        state.record(route, draw.fault.value)
        return _anthropic_fault_response(draw.fault, config)
    if draw.fault is Fault.TIMEOUT and hang is None:
        state.record(route, Fault.TIMEOUT.value)
        return _anthropic_error(500, "api_error", BATCH_TIMEOUT_MESSAGE)
    if draw.fault is Fault.TIMEOUT and hang is not None and await hang(config.hang_seconds):
        state.record(route, Fault.TIMEOUT.value, client_disconnects=1)
        return Response(status_code=499)  # nobody is listening any more; this only ends the task

    reply = reply_to(prompt.messages, max_tokens=max_tokens, default_max_facts=config.default_max_facts)
    if config.lossy_summary:
        reply = _lossy(reply, prompt.messages)
    tool = _pick_tool(body, reply)
    outcome = OUTCOME_OK if draw.fault is None else draw.fault.value
    content: list[dict[str, Any]]
    stop_reason = "end_turn"
    stop_sequence: str | None = None
    stop_details: dict[str, Any] | None = None

    if draw.fault is Fault.REFUSAL:
        content = [{"type": "text", "text": REFUSAL_TEXT}]
        stop_reason = "refusal"
        stop_details = {"type": "refusal", "category": None, "explanation": "Simulated refusal."}
    elif tool is not None:
        tool_input: dict[str, Any]
        if reply.kind == "facts" and reply.payload is not None:
            tool_input = dict(reply.payload)
        else:
            filled = fill_json_schema(tool.get("input_schema"), reply.text)
            tool_input = filled if isinstance(filled, dict) else {"text": reply.text}
        stop_reason = "tool_use"
        if draw.fault is Fault.MALFORMED:
            # Forced tool input is always a JSON object on the real API; the realistic failure is an
            # object of the wrong shape: a string where the schema wants an array.
            tool_input = {key: _malformed(json.dumps(value)) for key, value in tool_input.items()} or {
                "text": _malformed(reply.text)
            }
        elif draw.fault is Fault.TRUNCATED:
            half = estimate_tokens(json.dumps(tool_input)) // 2
            tool_input = _fit_facts(tool_input, half) if "facts" in tool_input else {}
            stop_reason = "max_tokens"
        if estimate_tokens(json.dumps(tool_input, ensure_ascii=False)) > max_tokens:
            tool_input = _fit_facts(tool_input, max_tokens) if "facts" in tool_input else {}
            stop_reason, outcome = "max_tokens", Fault.TRUNCATED.value
        content = [{"type": "tool_use", "id": _sim_id("toolu_"), "name": tool["name"], "input": tool_input}]
    else:
        text = reply.text
        if draw.fault is Fault.MALFORMED:
            text = _malformed(text)
        elif draw.fault is Fault.TRUNCATED:
            text, stop_reason = _truncated(text, max_tokens), "max_tokens"
        text, stop_sequence = _apply_stop_sequences(text, _stop_list(body.get("stop_sequences")))
        if stop_sequence is not None:
            stop_reason = "stop_sequence"
        elif estimate_tokens(text) > max_tokens:
            text, stop_reason, outcome = (
                _cut_to_tokens(text, max_tokens),
                "max_tokens",
                Fault.TRUNCATED.value,
            )
        content = [{"type": "text", "text": text}]

    total_tokens = estimate_tokens(prompt.text)
    prefix_tokens = estimate_tokens(prompt.cacheable_prefix)
    seen = state.cache_lookup(_cache_key("anthropic", model, prompt.cacheable_prefix), prefix_tokens)
    cacheable = prefix_tokens if prefix_tokens >= config.cache_min_tokens and config.cache_capacity else 0
    cache_read = cacheable if seen else 0
    cache_creation = 0 if seen else cacheable
    input_tokens = max(0, total_tokens - cache_read - cache_creation)
    output_tokens = sum(
        estimate_tokens(block["text"] if block["type"] == "text" else json.dumps(block["input"]))
        for block in content
    )
    state.record(
        route,
        outcome,
        input=total_tokens,
        output=output_tokens,
        cache_read=cache_read,
        cache_creation=cache_creation,
    )
    payload = {
        "id": _sim_id("msg_"),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "stop_details": stop_details,
        "usage": {
            "input_tokens": input_tokens,
            "output_tokens": output_tokens,
            "cache_creation_input_tokens": cache_creation,
            "cache_read_input_tokens": cache_read,
            "service_tier": "standard",
        },
    }
    return JSONResponse(payload, headers={"request-id": _sim_id("req_")})


async def count_tokens_route(request: Request) -> Response:
    """POST /v1/messages/count_tokens (Anthropic): the same estimate the messages route bills."""
    try:
        body = await _read_json(request)
        prompt = _flatten_anthropic(body)
    except _BadRequest as exc:
        return _anthropic_error(400, "invalid_request_error", exc.message)
    return JSONResponse({"input_tokens": estimate_tokens(prompt.text)})


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
    raise _BadRequest("input must be a string, an array of strings, or token arrays (non-empty).", "input")


async def embeddings(request: Request) -> Response:
    """POST /v1/embeddings (OpenAI). Content faults (malformed, truncated, refusal) do not apply here."""
    state = _state(request)
    route = "embeddings"
    state.begin()
    try:
        try:
            body = await _read_json(request)
            config = state.config
            forced = _forced_fault(request, config)
            model = body.get("model")
            if not isinstance(model, str) or not model:
                raise _BadRequest("you must provide a model parameter", "model")
            inputs = _embedding_inputs(body.get("input"))
            dimensions = _positive_int(body.get("dimensions"), "dimensions") or config.embedding_dimensions
            if dimensions > 8192:
                raise _BadRequest("dimensions must be at most 8192.", "dimensions")
            encoding = body.get("encoding_format") or "float"
            if encoding not in ("float", "base64"):
                raise _BadRequest("encoding_format must be 'float' or 'base64'.", "encoding_format")
        except _BadRequest as exc:
            state.record(route, OUTCOME_INVALID)
            return _openai_error(400, exc.message, "invalid_request_error", param=exc.param)

        draw = state.draw(forced)
        if draw.delay_seconds:
            await asyncio.sleep(draw.delay_seconds)
        if draw.fault in _HTTP_FAULTS:
            assert draw.fault is not None
            state.record(route, draw.fault.value)
            return _openai_fault_response(draw.fault, config, model)
        if draw.fault is Fault.TIMEOUT and await _hang(request, config.hang_seconds):
            state.record(route, Fault.TIMEOUT.value, client_disconnects=1)
            return Response(status_code=499)  # nobody is listening any more; this only ends the task

        data = []
        for index, text in enumerate(inputs):
            vector = embed_text(text, dimensions)
            encoded: list[float] | str = vector
            if encoding == "base64":
                encoded = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
            data.append({"object": "embedding", "index": index, "embedding": encoded})
        tokens = sum(estimate_tokens(text) for text in inputs)
        outcome = draw.fault.value if draw.fault is Fault.TIMEOUT else OUTCOME_OK
        state.record(route, outcome, input=tokens)
        payload = {
            "object": "list",
            "data": data,
            "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
        return JSONResponse(payload, headers={"x-request-id": _sim_id("req_")})
    finally:
        state.end()


# --------------------------------------------------------------------------------------------------
# Batches: the OpenAI Batch API (files + batches) and Anthropic Message Batches
# --------------------------------------------------------------------------------------------------

BATCH_EXPIRED_MESSAGE = "This request could not be executed before the completion window expired."
BATCH_CANCELLED_MESSAGE = "This request was not executed because the batch was cancelled."
BATCH_COMPLETION_WINDOW_SECONDS = 24 * 3600


@dataclass
class _StoredFile:
    id: str
    filename: str
    purpose: str
    content: bytes
    created_at: int

    def as_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "file",
            "bytes": len(self.content),
            "created_at": self.created_at,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "status_details": None,
        }


@dataclass
class _BatchItem:
    custom_id: str
    status: int  # the HTTP status the online route answered with
    body: dict[str, Any]


@dataclass
class _Batch:
    """One batch. Every request is answered when the batch is created (that is when the seeded faults are
    drawn, in request order); the clock only decides how much of that the batch shows."""

    id: str
    wire: str  # "openai" | "anthropic"
    created_at: float
    delay: float
    custom_ids: list[str]
    items: list[_BatchItem]  # answered requests, in order: fewer than custom_ids when the batch expires
    expire: bool
    input_file_id: str | None = None
    endpoint: str = "/v1/chat/completions"
    cancelled_at: float | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None

    def ended(self, now: float) -> bool:
        return self.cancelled_at is not None or now - self.created_at >= self.delay

    def kept(self) -> list[_BatchItem]:
        """The answered requests the batch ends with: all, or (cancelled) the share done by then."""
        if self.cancelled_at is None:
            return self.items
        share = 1.0 if self.delay <= 0 else min(1.0, (self.cancelled_at - self.created_at) / self.delay)
        return self.items[: int(len(self.custom_ids) * share)]

    def final_status(self) -> str:
        if self.cancelled_at is not None:
            return "cancelled"
        return "expired" if self.expire else "completed"


async def _answer_batch(
    state: SimulatorState, wire: str, requests: list[tuple[str, Mapping[str, Any]]]
) -> tuple[list[_BatchItem], bool]:
    """Answer each batched request exactly as the online route would (seeded faults included)."""
    expire = state.config.batch_expire
    answered = requests[: len(requests) // 2] if expire else requests
    items = []
    for custom_id, body in answered:
        if wire == "openai":
            response = await _answer_chat_completion(state, "batch.chat.completions", body, None, None)
        else:
            response = await _answer_message(state, "batch.messages", body, None, None)
        items.append(_BatchItem(custom_id, response.status_code, json.loads(bytes(response.body))))
    return items, expire


def _iso(epoch: float | None) -> str | None:
    if epoch is None:
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))


def _parse_multipart(content_type: str, body: bytes) -> dict[str, tuple[str | None, bytes]]:
    """Form fields of a multipart/form-data body: name → (filename, bytes). (Stdlib only: Starlette's own
    form parser needs python-multipart, which the service does not otherwise need.)"""
    from email.parser import BytesParser
    from email.policy import HTTP

    message = BytesParser(policy=HTTP).parsebytes(
        b"Content-Type: " + content_type.encode("latin-1") + b"\r\n\r\n" + body
    )
    if not message.is_multipart():
        raise _BadRequest("The body must be multipart/form-data with a file and a purpose.")
    fields: dict[str, tuple[str | None, bytes]] = {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if isinstance(name, str):
            payload = part.get_payload(decode=True)
            fields[name] = (part.get_filename(), payload if isinstance(payload, bytes) else b"")
    return fields


async def upload_file(request: Request) -> Response:
    """POST /v1/files (OpenAI): multipart upload; only purpose=batch is of use here."""
    state = _state(request)
    try:
        fields = _parse_multipart(request.headers.get("content-type", ""), await request.body())
        if "file" not in fields:
            raise _BadRequest("file: a file is required.", "file")
        purpose = fields.get("purpose", (None, b""))[1].decode("utf-8", "replace")
        if purpose != "batch":
            raise _BadRequest(f"purpose must be 'batch' on the simulator, not {purpose!r}.", "purpose")
    except _BadRequest as exc:
        return _openai_error(400, exc.message, "invalid_request_error", param=exc.param)
    filename, content = fields["file"]
    stored = _StoredFile(_sim_id("file-"), filename or "upload.jsonl", purpose, content, int(time.time()))
    with state._lock:
        state.files[stored.id] = stored
    return JSONResponse(stored.as_json())


async def file_content(request: Request) -> Response:
    """GET /v1/files/{file_id}/content (OpenAI)."""
    state = _state(request)
    _settle_batches(state)
    stored = state.files.get(request.path_params["file_id"])
    if stored is None:
        return _openai_error(404, "No such File object.", "invalid_request_error", param="id")
    return Response(stored.content, media_type="application/octet-stream")


def _openai_input_lines(content: bytes) -> list[tuple[str, Mapping[str, Any]]]:
    requests: list[tuple[str, Mapping[str, Any]]] = []
    seen: set[str] = set()
    for number, line in enumerate(content.decode("utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except ValueError as exc:
            raise _BadRequest(f"line {number} of the input file is not JSON: {exc}") from exc
        if not isinstance(entry, dict) or not isinstance(entry.get("body"), dict):
            raise _BadRequest(f"line {number}: each line needs custom_id, method, url and a body object.")
        custom_id = entry.get("custom_id")
        if not isinstance(custom_id, str) or custom_id in seen:
            raise _BadRequest(f"line {number}: custom_id must be a string, unique in the batch.")
        if entry.get("method") != "POST" or entry.get("url") != "/v1/chat/completions":
            raise _BadRequest(f"line {number}: only POST /v1/chat/completions is batched by the simulator.")
        seen.add(custom_id)
        requests.append((custom_id, entry["body"]))
    if not requests:
        raise _BadRequest("The input file holds no requests.")
    return requests


def _settle_batches(state: SimulatorState) -> None:
    """Write the output and error files of OpenAI batches that have ended (once each)."""
    now = time.monotonic()
    for batch in list(state.batches.values()):
        if batch.wire != "openai" or not batch.ended(now) or batch.output_file_id or batch.error_file_id:
            continue
        kept = batch.kept()
        output: list[dict[str, Any]] = []
        errors: list[dict[str, Any]] = []
        for item in kept:
            line = {
                "id": _sim_id("batch_req_"),
                "custom_id": item.custom_id,
                "response": {"status_code": item.status, "request_id": _sim_id("req_"), "body": item.body},
                "error": None,
            }
            (output if item.status == 200 else errors).append(line)
        code, message = (
            ("batch_cancelled", BATCH_CANCELLED_MESSAGE)
            if batch.cancelled_at is not None
            else ("batch_expired", BATCH_EXPIRED_MESSAGE)
        )
        for custom_id in batch.custom_ids[len(kept) :]:
            errors.append(
                {
                    "id": _sim_id("batch_req_"),
                    "custom_id": custom_id,
                    "response": None,
                    "error": {"code": code, "message": message},
                }
            )
        for lines, attr in ((output, "output_file_id"), (errors, "error_file_id")):
            if lines:
                text = "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines)
                stored = _StoredFile(
                    _sim_id("file-"),
                    f"{batch.id}_{attr}.jsonl",
                    "batch_output",
                    text.encode(),
                    int(time.time()),
                )
                state.files[stored.id] = stored
                setattr(batch, attr, stored.id)


def _openai_batch_json(batch: _Batch) -> dict[str, Any]:
    now = time.monotonic()
    wall = time.time() - (now - batch.created_at)  # the creation time on the wall clock
    ended = batch.ended(now)
    status = (
        batch.final_status()
        if ended
        else ("validating" if now - batch.created_at < 0.2 * batch.delay else "in_progress")
    )
    kept = batch.kept() if ended else []
    completed = sum(1 for item in kept if item.status == 200)
    end_time = wall + (batch.delay if batch.cancelled_at is None else batch.cancelled_at - batch.created_at)
    return {
        "id": batch.id,
        "object": "batch",
        "endpoint": batch.endpoint,
        "errors": None,
        "input_file_id": batch.input_file_id,
        "completion_window": "24h",
        "status": status,
        "output_file_id": batch.output_file_id,
        "error_file_id": batch.error_file_id,
        "created_at": int(wall),
        "in_progress_at": int(wall),
        "expires_at": int(wall) + BATCH_COMPLETION_WINDOW_SECONDS,
        "finalizing_at": int(end_time) if ended else None,
        "completed_at": int(end_time) if status == "completed" else None,
        "failed_at": None,
        "expired_at": int(end_time) if status == "expired" else None,
        "cancelling_at": int(end_time) if status == "cancelled" else None,
        "cancelled_at": int(end_time) if status == "cancelled" else None,
        "request_counts": {
            "total": len(batch.custom_ids),
            "completed": completed,
            "failed": len(batch.custom_ids) - completed if ended else 0,
        },
        "metadata": None,
    }


async def create_openai_batch(request: Request) -> Response:
    """POST /v1/batches (OpenAI): every line of the input file is answered like /v1/chat/completions."""
    state = _state(request)
    try:
        body = await _read_json(request)
        if body.get("endpoint") != "/v1/chat/completions":
            raise _BadRequest("endpoint: the simulator batches /v1/chat/completions only.", "endpoint")
        if body.get("completion_window") != "24h":
            raise _BadRequest("completion_window must be '24h'.", "completion_window")
        stored = state.files.get(str(body.get("input_file_id")))
        if stored is None or stored.purpose != "batch":
            raise _BadRequest(
                "input_file_id: no uploaded file with purpose 'batch' has that id.", "input_file_id"
            )
        requests = _openai_input_lines(stored.content)
    except (_BadRequest, UnicodeDecodeError) as exc:
        message = exc.message if isinstance(exc, _BadRequest) else "the input file is not UTF-8"
        return _openai_error(400, message, "invalid_request_error")
    items, expire = await _answer_batch(state, "openai", requests)
    batch = _Batch(
        id=_sim_id("batch_"),
        wire="openai",
        created_at=time.monotonic(),
        delay=state.config.batch_delay_seconds,
        custom_ids=[custom_id for custom_id, _ in requests],
        items=items,
        expire=expire,
        input_file_id=stored.id,
    )
    with state._lock:
        state.batches[batch.id] = batch
    return JSONResponse(_openai_batch_json(batch))


def _find_batch(request: Request, wire: str) -> _Batch | None:
    state = _state(request)
    _settle_batches(state)
    batch = state.batches.get(request.path_params["batch_id"])
    return batch if batch is not None and batch.wire == wire else None


async def retrieve_openai_batch(request: Request) -> Response:
    """GET /v1/batches/{batch_id} (OpenAI)."""
    batch = _find_batch(request, "openai")
    if batch is None:
        return _openai_error(404, "No such Batch object.", "invalid_request_error", param="batch_id")
    return JSONResponse(_openai_batch_json(batch))


async def cancel_openai_batch(request: Request) -> Response:
    """POST /v1/batches/{batch_id}/cancel (OpenAI): it ends at once with the requests done so far."""
    batch = _find_batch(request, "openai")
    if batch is None:
        return _openai_error(404, "No such Batch object.", "invalid_request_error", param="batch_id")
    if not batch.ended(time.monotonic()):
        batch.cancelled_at = time.monotonic()
        _settle_batches(_state(request))
    return JSONResponse(_openai_batch_json(batch))


def _anthropic_batch_json(batch: _Batch, request: Request) -> dict[str, Any]:
    now = time.monotonic()
    wall = time.time() - (now - batch.created_at)
    ended = batch.ended(now)
    counts = {"processing": len(batch.custom_ids), "succeeded": 0, "errored": 0, "canceled": 0, "expired": 0}
    if ended:
        kept = batch.kept()
        succeeded = sum(1 for item in kept if item.status == 200)
        missing = len(batch.custom_ids) - len(kept)
        counts = {
            "processing": 0,
            "succeeded": succeeded,
            "errored": len(kept) - succeeded,
            "canceled": missing if batch.cancelled_at is not None else 0,
            "expired": missing if batch.cancelled_at is None else 0,
        }
    end_time = wall + (batch.delay if batch.cancelled_at is None else batch.cancelled_at - batch.created_at)
    results_url = f"{str(request.base_url).rstrip('/')}/v1/messages/batches/{batch.id}/results"
    return {
        "id": batch.id,
        "type": "message_batch",
        "processing_status": "ended" if ended else "in_progress",
        "request_counts": counts,
        "created_at": _iso(wall),
        "expires_at": _iso(wall + BATCH_COMPLETION_WINDOW_SECONDS),
        "ended_at": _iso(end_time) if ended else None,
        "archived_at": None,
        "cancel_initiated_at": _iso(end_time) if batch.cancelled_at is not None else None,
        "results_url": results_url if ended else None,
    }


async def create_anthropic_batch(request: Request) -> Response:
    """POST /v1/messages/batches (Anthropic): each request's params are answered like /v1/messages."""
    state = _state(request)
    try:
        body = await _read_json(request)
        raw = body.get("requests")
        if not isinstance(raw, list) or not raw:
            raise _BadRequest("requests: at least one request is required")
        requests: list[tuple[str, Mapping[str, Any]]] = []
        for index, entry in enumerate(raw):
            if not isinstance(entry, Mapping) or not isinstance(entry.get("params"), Mapping):
                raise _BadRequest(f"requests.{index}: custom_id and params are required")
            custom_id = entry.get("custom_id")
            if not isinstance(custom_id, str) or any(custom_id == c for c, _ in requests):
                raise _BadRequest(f"requests.{index}.custom_id: must be a string, unique in the batch")
            requests.append((custom_id, entry["params"]))
    except _BadRequest as exc:
        return _anthropic_error(400, "invalid_request_error", exc.message)
    items, expire = await _answer_batch(state, "anthropic", requests)
    batch = _Batch(
        id=_sim_id("msgbatch_"),
        wire="anthropic",
        created_at=time.monotonic(),
        delay=state.config.batch_delay_seconds,
        custom_ids=[custom_id for custom_id, _ in requests],
        items=items,
        expire=expire,
    )
    with state._lock:
        state.batches[batch.id] = batch
    return JSONResponse(_anthropic_batch_json(batch, request))


async def retrieve_anthropic_batch(request: Request) -> Response:
    """GET /v1/messages/batches/{batch_id} (Anthropic)."""
    batch = _find_batch(request, "anthropic")
    if batch is None:
        return _anthropic_error(404, "not_found_error", "No message batch has that id.")
    return JSONResponse(_anthropic_batch_json(batch, request))


async def cancel_anthropic_batch(request: Request) -> Response:
    """POST /v1/messages/batches/{batch_id}/cancel (Anthropic): it ends at once with the requests done."""
    batch = _find_batch(request, "anthropic")
    if batch is None:
        return _anthropic_error(404, "not_found_error", "No message batch has that id.")
    if not batch.ended(time.monotonic()):
        batch.cancelled_at = time.monotonic()
    return JSONResponse(_anthropic_batch_json(batch, request))


async def anthropic_batch_results(request: Request) -> Response:
    """GET /v1/messages/batches/{batch_id}/results (Anthropic): JSONL, one result per request."""
    batch = _find_batch(request, "anthropic")
    if batch is None:
        return _anthropic_error(404, "not_found_error", "No message batch has that id.")
    if not batch.ended(time.monotonic()):
        return _anthropic_error(400, "invalid_request_error", "The batch is still processing.")
    lines = []
    kept = batch.kept()
    for item in kept:
        result: dict[str, Any]
        if item.status == 200:
            result = {"type": "succeeded", "message": item.body}
        else:
            error = {k: v for k, v in item.body.items() if k in ("type", "error", "request_id")}
            result = {"type": "errored", "error": error}
        lines.append({"custom_id": item.custom_id, "result": result})
    missing = "canceled" if batch.cancelled_at is not None else "expired"
    lines += [{"custom_id": c, "result": {"type": missing}} for c in batch.custom_ids[len(kept) :]]
    text = "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines)
    return Response(text, media_type="application/binary")


async def list_models(request: Request) -> Response:
    """GET /v1/models: one list both SDKs can parse (each ignores the other's fields)."""
    config = _state(request).config
    created = 1_700_000_000
    data = [
        {
            "id": name,
            "object": "model",
            "type": "model",
            "created": created,
            "created_at": "2023-11-14T22:13:20Z",
            "owned_by": "factmill-simulator",
            "display_name": f"{name} (Factmill LLM simulator)",
        }
        for name in dict.fromkeys([config.model, config.embedding_model])
    ]
    return JSONResponse(
        {
            "object": "list",
            "data": data,
            "has_more": False,
            "first_id": data[0]["id"],
            "last_id": data[-1]["id"],
        }
    )


async def stats_route(request: Request) -> Response:
    return JSONResponse(_state(request).snapshot())


async def requests_route(request: Request) -> Response:
    """The newest chat prompts as the simulator flattened them (role + text per message), oldest first."""
    return JSONResponse({"simulator": True, "requests": _state(request).recent_requests()})


async def config_route(request: Request) -> Response:
    state = _state(request)
    if request.method == "GET":
        return JSONResponse(state.config.model_dump())
    try:
        body = await _read_json(request)
        return JSONResponse(state.update_config(body).model_dump())
    except _BadRequest as exc:
        return JSONResponse(
            {"error": {"message": exc.message, "type": "invalid_request_error"}}, status_code=400
        )
    except (ValidationError, ValueError, TypeError) as exc:
        message = f"Invalid simulator config: {exc}"
        return JSONResponse({"error": {"message": message, "type": "invalid_request_error"}}, status_code=400)


async def reset_route(request: Request) -> Response:
    _state(request).reset()
    return JSONResponse({"reset": True})


async def health_route(request: Request) -> Response:
    return JSONResponse({"ok": True, "simulator": True})


def create_app(config: SimulatorConfig | None = None) -> Starlette:
    """The simulator as an ASGI app; its state is at `app.state.simulator` (a SimulatorState)."""
    app = Starlette(
        routes=[
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/messages", messages_route, methods=["POST"]),
            Route("/v1/messages/count_tokens", count_tokens_route, methods=["POST"]),
            Route("/v1/embeddings", embeddings, methods=["POST"]),
            Route("/v1/models", list_models, methods=["GET"]),
            Route("/v1/files", upload_file, methods=["POST"]),
            Route("/v1/files/{file_id}/content", file_content, methods=["GET"]),
            Route("/v1/batches", create_openai_batch, methods=["POST"]),
            Route("/v1/batches/{batch_id}", retrieve_openai_batch, methods=["GET"]),
            Route("/v1/batches/{batch_id}/cancel", cancel_openai_batch, methods=["POST"]),
            Route("/v1/messages/batches", create_anthropic_batch, methods=["POST"]),
            Route("/v1/messages/batches/{batch_id}", retrieve_anthropic_batch, methods=["GET"]),
            Route("/v1/messages/batches/{batch_id}/cancel", cancel_anthropic_batch, methods=["POST"]),
            Route("/v1/messages/batches/{batch_id}/results", anthropic_batch_results, methods=["GET"]),
            Route("/_simulator/stats", stats_route, methods=["GET"]),
            Route("/_simulator/requests", requests_route, methods=["GET"]),
            Route("/_simulator/config", config_route, methods=["GET", "POST"]),
            Route("/_simulator/reset", reset_route, methods=["POST"]),
            Route("/_simulator/health", health_route, methods=["GET"]),
        ],
        middleware=[Middleware(_SimulatorHeaderMiddleware)],
    )
    app.state.simulator = SimulatorState(config or SimulatorConfig())
    return app


# --------------------------------------------------------------------------------------------------
# Running it
# --------------------------------------------------------------------------------------------------


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


class Simulator:
    """The simulator on a background thread, for tests, the demo and benchmarks.

    >>> with Simulator(SimulatorConfig(latency_ms=50)) as sim:
    ...     client = openai.OpenAI(base_url=sim.base_url, api_key="sim", max_retries=0)
    """

    def __init__(self, config: SimulatorConfig | None = None, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host = host
        self._requested_port = port
        self.app = create_app(config)
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._port: int | None = None
        self._socket: socket.socket | None = None

    @property
    def state(self) -> SimulatorState:
        state: SimulatorState = self.app.state.simulator
        return state

    @property
    def config(self) -> SimulatorConfig:
        return self.state.config

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("the simulator is not running; call start() first")
        return self._port

    @property
    def url(self) -> str:
        """Root URL, e.g. http://127.0.0.1:PORT."""
        return f"http://{_url_host(self.host)}:{self.port}"

    @property
    def base_url(self) -> str:
        """For `openai.OpenAI(base_url=...)`: the root URL plus /v1."""
        return f"{self.url}/v1"

    @property
    def anthropic_base_url(self) -> str:
        """For `anthropic.Anthropic(base_url=...)`: the root URL (the SDK appends /v1/messages)."""
        return self.url

    def start(self, timeout: float = 10.0) -> Simulator:
        """Serve on a background thread; returns once the socket accepts connections."""
        if self._thread is not None:
            return self
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        # proto=IPPROTO_TCP matters: asyncio only turns Nagle off (TCP_NODELAY) on sockets that say they are
        # TCP, and with Nagle on every response waits ~40 ms for the client's delayed ACK.
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            sock.bind((self.host, self._requested_port))
            # Listening before uvicorn starts means early connections queue instead of being refused.
            sock.listen(2048)
        except OSError:
            sock.close()
            raise
        self._port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.app,
            log_level="warning",
            access_log=False,
            lifespan="off",
            backlog=2048,
            timeout_keep_alive=30,
            timeout_graceful_shutdown=1,
        )
        server = uvicorn.Server(config)
        thread = threading.Thread(
            target=server.run, kwargs={"sockets": [sock]}, name=f"llm-simulator:{self._port}", daemon=True
        )
        self._server, self._thread, self._socket = server, thread, sock
        thread.start()
        deadline = time.monotonic() + timeout
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the LLM simulator did not start on {self.host}:{self._port}")
            time.sleep(0.01)
        logger.info("LLM simulator (not a real model) listening on %s", self.url)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        server, thread = self._server, self._thread
        if server is None or thread is None:
            return
        server.should_exit = True
        thread.join(timeout)
        if thread.is_alive():
            server.force_exit = True
            thread.join(timeout)
        if self._socket is not None:
            with contextlib.suppress(OSError):
                self._socket.close()
        self._server, self._thread, self._socket = None, None, None

    def stats(self) -> dict[str, Any]:
        return self.state.snapshot()

    def recent_requests(self) -> list[dict[str, Any]]:
        """The newest chat prompts received (same as GET /_simulator/requests); reset() clears them."""
        return self.state.recent_requests()

    def configure(self, **changes: Any) -> SimulatorConfig:
        """Change knobs at runtime (same as POST /_simulator/config)."""
        return self.state.update_config(changes)

    def reset(self) -> None:
        """Zero stats, forget cached prefixes, restart the seeded streams (same as POST /_simulator/reset)."""
        self.state.reset()

    def __enter__(self) -> Simulator:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def serve(config: SimulatorConfig | None = None, host: str = "127.0.0.1", port: int = 8765) -> None:
    """Run the simulator in the foreground until interrupted (the `factmill simulator` command)."""
    config = config or SimulatorConfig()
    logger.warning(
        "Factmill LLM simulator (NOT a real LLM) on http://%s:%s - OpenAI base_url http://%s:%s/v1, "
        "Anthropic base_url http://%s:%s; latency %sms±%sms, fault rates %s, seed %s",
        host,
        port,
        host,
        port,
        host,
        port,
        config.latency_ms,
        config.jitter_ms,
        {f.value: r for f, r in config.fault_rates().items() if r},
        config.seed,
    )
    uvicorn.run(create_app(config), host=host, port=port, log_level="info", access_log=False)


def config_from_cli(
    *,
    latency_ms: float = 0.0,
    jitter_ms: float = 0.0,
    error_rate: float = 0.0,
    seed: int = 0,
    hang_seconds: float | None = None,
) -> SimulatorConfig:
    """The config behind `factmill simulator`: error_rate is spread evenly over every fault class."""
    extra: dict[str, Any] = {} if hang_seconds is None else {"hang_seconds": hang_seconds}
    return SimulatorConfig.with_error_rate(
        error_rate, latency_ms=latency_ms, jitter_ms=jitter_ms, seed=seed, **extra
    )


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m worker.llm.simulator`: the same knobs as `factmill simulator`."""
    parser = argparse.ArgumentParser(description="Factmill LLM simulator (OpenAI + Anthropic wire formats)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--latency-ms", type=float, default=0.0)
    parser.add_argument("--jitter-ms", type=float, default=0.0)
    parser.add_argument(
        "--error-rate", type=float, default=0.0, help="total fault rate, spread over all classes"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hang-seconds", type=float, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    config = config_from_cli(
        latency_ms=args.latency_ms,
        jitter_ms=args.jitter_ms,
        error_rate=args.error_rate,
        seed=args.seed,
        hang_seconds=args.hang_seconds,
    )
    serve(config, args.host, args.port)


if __name__ == "__main__":
    main()
