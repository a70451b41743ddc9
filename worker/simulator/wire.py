"""What the OpenAI and Anthropic wire formats do alike: one request pipeline, faults, and reply shaping.

Each wire module supplies how its API spells errors and replies (a WireFormat, a parse step and a
reply step); the order of validation, seeded draw, latency and fault handling lives here once, so both
APIs fail and recover in exactly the same way.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from worker.simulator.config import (
    HTTP_FAULTS,
    OUTCOME_INVALID,
    OUTCOME_RAW,
    Draw,
    Fault,
    SimulatorConfig,
    text_fault,
)
from worker.simulator.prompt import (
    CHARACTERS_PER_TOKEN,
    UNTRUSTED_CLOSE,
    UNTRUSTED_OPEN,
    PromptMessage,
    estimate_tokens,
)
from worker.simulator.replies import SimReply, reply_to
from worker.simulator.state import SimulatorState, state_of

REFUSAL_TEXT = "I'm sorry, but I can't help with that request. (simulated refusal)"
BATCH_TIMEOUT_MESSAGE = "The request timed out while the batch was processed (simulated)."
# What a summarizer that lost everything would say: the compaction headings and nothing specific.
LOSSY_SUMMARY = (
    "## Goal\nContinue the task.\n\n## Constraints & Preferences\n- (none)\n\n## Progress\n"
    "### Done\n- (none)\n### In Progress\n- (none)\n### Blocked\n- (none)\n\n## Key Decisions\n"
    "- (none)\n\n## Next Steps\n- Continue.\n\n## Critical Context\n- (none)"
)

# A hung upstream, for the online routes: sleeps, and says whether the client went away meanwhile.
# Batched requests have no connection to hang, so they pass None and a timeout fault errors the request.
Hang = Callable[[float], Awaitable[bool]]
# A parsed body answered as the route would: what online routes and batches both call.
Answer = Callable[[SimulatorState, str, Mapping[str, Any], Fault | None, Hang | None], Awaitable[Response]]


class BadRequest(Exception):
    """The request is invalid; each wire format turns this into its own 400."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


@dataclass(frozen=True)
class WireFormat:
    """How one API spells the answers the shared pipeline gives instead of a reply."""

    invalid: Callable[[BadRequest], Response]  # a 400 for a request that fails validation
    fault: Callable[[Fault, SimulatorConfig, str], Response]  # an HTTP fault for a request to a model
    batch_timeout: Callable[[], Response]  # a timeout fault where there is no connection to hang


class Parsed(Protocol):
    """A validated request body; the pipeline only needs its model (fault messages name it)."""

    @property
    def model(self) -> str: ...


P = TypeVar("P", bound=Parsed)


# Deeper documents are refused at the door: every step after (flattening, schema filling, json.dumps)
# recurses over the document, and the real APIs refuse far shallower schemas (OpenAI: 10 levels).
MAX_JSON_DEPTH = 64


def _depth_exceeds(document: Any, limit: int) -> bool:
    """Whether `document` nests deeper than `limit` (iterative: it must not recurse itself)."""
    stack: list[tuple[Any, int]] = [(document, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        for child in children:
            if isinstance(child, dict | list):
                if depth + 1 > limit:
                    return True
                stack.append((child, depth + 1))
    return False


def json_document(raw: bytes | str, what: str) -> Any:
    """`raw` parsed as JSON, or BadRequest naming `what` (bad JSON, bad UTF-8, or nested too deeply)."""
    too_deep = BadRequest(f"{what} nests JSON deeper than {MAX_JSON_DEPTH} levels.")
    try:
        document = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"{what} is not valid JSON: {exc}") from exc
    except RecursionError:  # the decoder's own limit (about 1,000 levels)
        raise too_deep from None
    if _depth_exceeds(document, MAX_JSON_DEPTH):
        raise too_deep
    return document


async def read_json(request: Request) -> dict[str, Any]:
    body = json_document(await request.body(), "The request body")
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.")
    return body


def forced_fault(request: Request, config: SimulatorConfig) -> Fault | None:
    if not config.fault_header:
        return None
    raw = request.headers.get(config.fault_header)
    if raw is None:
        return None
    try:
        return Fault(raw.strip().lower())
    except ValueError:
        allowed = "|".join(f.value for f in Fault)
        raise BadRequest(f"{config.fault_header} must be one of {allowed}, not {raw!r}.") from None


async def _hang(request: Request, seconds: float) -> bool:
    """Sleep like a hung upstream; True if the client gave up meanwhile (so the task ends early)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while (remaining := deadline - loop.time()) > 0:
        await asyncio.sleep(min(0.05, remaining))
        if await request.is_disconnected():
            return True
    return False


async def serve_online(request: Request, route: str, wire: WireFormat, answer: Answer) -> Response:
    """An online route: read the body and the fault header, then answer, counted as in flight meanwhile."""
    state = state_of(request)
    state.begin(route)
    try:
        try:
            body = await read_json(request)
            forced = forced_fault(request, state.config)
        except BadRequest as exc:
            state.record(route, OUTCOME_INVALID)
            return wire.invalid(exc)
        raw = state.config.raw_replies.get(route)
        if raw is not None:
            state.record(route, OUTCOME_RAW)
            return JSONResponse(raw, state.config.raw_status)
        return await answer(state, route, body, forced, lambda seconds: _hang(request, seconds))
    finally:
        state.end(route)


# An endpoint's two own steps around the shared pipeline: validate a body (raising BadRequest), and reply.
Parse = Callable[[SimulatorState, str, SimulatorConfig, Mapping[str, Any]], P]
Reply = Callable[[SimulatorState, str, SimulatorConfig, P, Draw], Response]


def endpoint(wire: WireFormat, parse: Parse[P], reply: Reply[P]) -> Answer:
    """The Answer of one endpoint: validate, draw, wait the latency, then answer a fault or reply.

    A timeout fault hangs the online request (and then answers normally unless the client has gone);
    a batched request has nothing to hang, so its timeout is an error.
    """

    async def answer(
        state: SimulatorState, route: str, body: Mapping[str, Any], forced: Fault | None, hang: Hang | None
    ) -> Response:
        config = state.config
        try:
            parsed = parse(state, route, config, body)
        except BadRequest as exc:
            state.record(route, OUTCOME_INVALID)
            return wire.invalid(exc)
        prompt = getattr(parsed, "prompt", None)
        if forced is None and config.text_faults and isinstance(prompt, FlatPrompt):
            forced = text_fault(prompt.text)
        draw = state.draw(forced)
        if draw.delay_seconds and hang is not None:
            await asyncio.sleep(draw.delay_seconds)
        if draw.fault in HTTP_FAULTS:
            assert draw.fault is not None
            state.record(route, draw.fault.value)
            return wire.fault(draw.fault, config, parsed.model)
        if draw.fault is Fault.TIMEOUT and hang is None:
            state.record(route, Fault.TIMEOUT.value)
            return wire.batch_timeout()
        if draw.fault is Fault.TIMEOUT and hang is not None and await hang(config.hang_seconds):
            state.record(route, Fault.TIMEOUT.value, client_disconnects=1)
            return Response(status_code=499)  # nobody is listening any more; this only ends the task
        return reply(state, route, config, parsed, draw)

    return answer


def retry_after_headers(seconds: float) -> dict[str, str]:
    # Retry-After is whole seconds by RFC 9110; both SDKs prefer the finer retry-after-ms when present.
    return {"retry-after": str(math.ceil(seconds)), "retry-after-ms": str(round(seconds * 1000))}


def positive_int(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BadRequest(f"{name} must be a positive integer.", name)
    return value


def required_model(body: Mapping[str, Any], message: str, param: str | None = None) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest(message, param)
    return model


@dataclass(frozen=True)
class FlatPrompt:
    """The prompt as the simulator "sees" it, for token counting, caching and answering."""

    messages: list[PromptMessage]
    text: str  # the whole prompt as one string (tokens are counted on it)
    # Anthropic: where each content block ends in `text`, and the indexes of the blocks marked
    # cache_control (OpenAI caches any prefix, so it needs neither).
    block_ends: tuple[int, ...] = ()
    breakpoints: tuple[int, ...] = ()


@dataclass(frozen=True)
class PromptRequest:
    """A validated request for a model reply (chat completion or message), before the seeded draw."""

    body: Mapping[str, Any]
    model: str
    prompt: FlatPrompt


# --------------------------------------------------------------------------------------------------
# Replies: what the simulated model says, and how faults and caps bend it
# --------------------------------------------------------------------------------------------------


def _is_compaction_prompt(messages: Sequence[PromptMessage]) -> bool:
    for message in messages:
        start = message.text.find(UNTRUSTED_OPEN)
        if start >= 0 and message.text.rfind(UNTRUSTED_CLOSE) > start:
            return True
    return False


def simulated_reply(messages: Sequence[PromptMessage], max_tokens: int, config: SimulatorConfig) -> SimReply:
    """The model's answer; with lossy_summary on, a compaction summary keeps the headings, loses the rest."""
    reply = reply_to(messages, max_tokens=max_tokens, default_max_facts=config.default_max_facts)
    if config.lossy_summary and reply.kind == "text" and _is_compaction_prompt(messages):
        return SimReply("text", LOSSY_SUMMARY)
    return reply


def malformed(text: str) -> str:
    """Prose around JSON that is cut off mid-way: what a model that ignored the format might send."""
    return f"Sure! Here is what I found in the conversation:\n\n{text[: max(1, len(text) // 2)]}"


def _truncated(text: str, max_tokens: int) -> str:
    half = max(1, len(text) // 2)
    return text[: min(half, max(1, max_tokens) * CHARACTERS_PER_TOKEN)]


def _cut_to_tokens(text: str, max_tokens: int) -> str:
    return text[: max(0, max_tokens) * CHARACTERS_PER_TOKEN]


def _apply_stop_sequences(text: str, stops: Sequence[str]) -> tuple[str, str | None]:
    cut_at, matched = len(text), None
    for stop in stops:
        index = text.find(stop) if stop else -1
        if 0 <= index < cut_at:
            cut_at, matched = index, stop
    return text[:cut_at], matched


def stop_list(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return [s for s in value if isinstance(s, str)]
    return []


@dataclass(frozen=True)
class ShapedText:
    """A text reply after its fault, its stop sequences and its token cap."""

    text: str
    stop_sequence: str | None  # the stop sequence it ends at, if any
    cut_short: bool  # by a truncated fault or by the token cap
    over_cap: bool  # it ran past the token cap and was cut there (counted as truncated)


def shape_text(text: str, fault: Fault | None, max_tokens: int, stops: Sequence[str]) -> ShapedText:
    """Apply a content fault, then the stop sequences, then the token cap (unless a stop matched)."""
    cut_short = False
    if fault is Fault.MALFORMED:
        text = malformed(text)
    elif fault is Fault.TRUNCATED:
        text, cut_short = _truncated(text, max_tokens), True
    text, matched = _apply_stop_sequences(text, stops)
    over_cap = matched is None and estimate_tokens(text) > max_tokens
    if over_cap:
        text = _cut_to_tokens(text, max_tokens)
    return ShapedText(text, matched, cut_short or over_cap, over_cap)
