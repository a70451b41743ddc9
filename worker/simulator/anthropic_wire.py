"""The Anthropic wire format: POST /v1/messages and /v1/messages/count_tokens, their errors and faults."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from worker.simulator.caching import (
    ANTHROPIC_MAX_BREAKPOINTS,
    CacheLookup,
    anthropic_min_tokens,
    anthropic_prefixes,
)
from worker.simulator.config import OUTCOME_OK, Draw, Fault, SimulatorConfig, sim_id
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
    malformed,
    read_json,
    required_model,
    retry_after_headers,
    serve_online,
    shape_text,
    simulated_reply,
    stop_list,
)


def anthropic_error(
    status: int, error_type: str, message: str, headers: Mapping[str, str] | None = None
) -> Response:
    request_id = sim_id("req_")
    body = {"type": "error", "error": {"type": error_type, "message": message}, "request_id": request_id}
    return JSONResponse(body, status_code=status, headers={"request-id": request_id, **(headers or {})})


def invalid_request(exc: BadRequest) -> Response:
    return anthropic_error(400, "invalid_request_error", exc.message)


def _fault_response(fault: Fault, config: SimulatorConfig, model: str) -> Response:
    if fault is Fault.RATE_LIMIT:
        return anthropic_error(
            429,
            "rate_limit_error",
            "This request would exceed the rate limit (simulated by the Factmill LLM simulator).",
            headers=retry_after_headers(config.retry_after_seconds),
        )
    if fault is Fault.SERVER_ERROR:
        return anthropic_error(500, "api_error", "Internal server error (simulated).")
    return anthropic_error(529, "overloaded_error", "Overloaded (simulated).")


ANTHROPIC = WireFormat(
    invalid=invalid_request,
    fault=_fault_response,
    batch_timeout=lambda: anthropic_error(500, "api_error", BATCH_TIMEOUT_MESSAGE),
)


# --------------------------------------------------------------------------------------------------
# Prompt flattening
# --------------------------------------------------------------------------------------------------


def _block_text(block: Any) -> str:
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
            return "\n".join(_block_text(b) for b in content)
        return str(content)
    if kind in ("image", "document"):
        return f"[{kind}]"
    return json.dumps(block, ensure_ascii=False)


def _blocks_text(blocks: list[Any], parts: list[tuple[str, bool]]) -> str:
    """The blocks as one text; each block is also added to `parts`, marked if it is a cache breakpoint."""
    texts = []
    for block in blocks:
        text = _block_text(block)
        texts.append(text)
        parts.append((text, isinstance(block, Mapping) and "cache_control" in block))
    return "\n".join(texts)


def flatten(body: Mapping[str, Any]) -> FlatPrompt:
    raw_messages = body.get("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise BadRequest("messages: at least one message is required")
    # (text, has cache_control) in the order Anthropic builds its prompt: tools, system, messages.
    parts: list[tuple[str, bool]] = []
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise BadRequest("tools: Input should be a valid list")
    for index, tool in enumerate(tools):
        if not isinstance(tool, Mapping) or not isinstance(tool.get("name"), str) or not tool["name"]:
            raise BadRequest(f"tools.{index}.name: Field required (a non-empty string)")
        clean = {k: v for k, v in tool.items() if k != "cache_control"}
        parts.append((json.dumps(clean, ensure_ascii=False), "cache_control" in tool))

    messages: list[PromptMessage] = []
    system = body.get("system")
    if isinstance(system, str):
        parts.append((system, False))
        messages.append(PromptMessage("system", system))
    elif isinstance(system, list):
        messages.append(PromptMessage("system", _blocks_text(system, parts)))
    elif system is not None:
        raise BadRequest("system: Input should be a valid string or list of text blocks")

    for index, raw in enumerate(raw_messages):
        if not isinstance(raw, Mapping) or raw.get("role") not in ("user", "assistant"):
            raise BadRequest(f"messages.{index}.role: Input should be 'user' or 'assistant'")
        content = raw.get("content")
        parts.append((f"<|{raw['role']}|>", False))
        if isinstance(content, str):
            parts.append((content, False))
            messages.append(PromptMessage(raw["role"], content))
        elif isinstance(content, list):
            messages.append(PromptMessage(raw["role"], _blocks_text(content, parts)))
        else:
            raise BadRequest(f"messages.{index}.content: Input should be a valid string or list")

    breakpoints = tuple(i for i, (_, marked) in enumerate(parts) if marked)
    if len(breakpoints) > ANTHROPIC_MAX_BREAKPOINTS:
        raise BadRequest(
            f"A maximum of {ANTHROPIC_MAX_BREAKPOINTS} blocks with cache_control may be provided. "
            f"Found {len(breakpoints)}."
        )
    ends: list[int] = []
    length = 0
    for part, _ in parts:
        length += len(part) + 1
        ends.append(length)
    text = "".join(part + "\n" for part, _ in parts)
    return FlatPrompt(messages, text, tuple(ends), breakpoints)


# --------------------------------------------------------------------------------------------------
# POST /v1/messages
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _MessageRequest(PromptRequest):
    max_tokens: int
    cache: CacheLookup


def _parse_message(
    state: SimulatorState, route: str, config: SimulatorConfig, body: Mapping[str, Any]
) -> _MessageRequest:
    model = required_model(body, "model: Field required")
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise BadRequest("max_tokens: Field required (a positive integer)")
    prompt = flatten(body)
    state.remember(route, prompt.messages)
    tool_choice = body.get("tool_choice")
    if tool_choice is not None and not isinstance(tool_choice, Mapping):
        raise BadRequest("tool_choice: Input should be an object")
    if isinstance(tool_choice, Mapping) and tool_choice.get("type") == "tool":
        names = [t["name"] for t in body.get("tools") or []]  # flatten() checked each is a named object
        if tool_choice.get("name") not in names:
            raise BadRequest(f"tool_choice: tool {tool_choice.get('name')!r} is not in tools")
    if body.get("stream"):
        raise BadRequest("stream: the Factmill LLM simulator does not stream; send stream=false")
    namespace = ("anthropic", model)
    ends, marks = prompt.block_ends, prompt.breakpoints
    minimum = anthropic_min_tokens(model, config.cache_min_tokens)
    prefixes = anthropic_prefixes(namespace, prompt.text, ends, marks, minimum)
    cache = CacheLookup(state.cache_read(prefixes.lookups), prefixes.writes)
    return _MessageRequest(body, model, prompt, max_tokens, cache)


def _pick_tool(body: Mapping[str, Any], reply: SimReply) -> Mapping[str, Any] | None:
    tools = [t for t in body.get("tools") or [] if isinstance(t, Mapping) and isinstance(t.get("name"), str)]
    if not tools:
        return None
    choice = body.get("tool_choice") or {"type": "auto"}
    choice_type = choice.get("type") if isinstance(choice, Mapping) else None

    def wants_facts(tool: Mapping[str, Any]) -> bool:
        schema = tool.get("input_schema")
        properties = schema.get("properties") if isinstance(schema, Mapping) else None
        return isinstance(properties, Mapping) and "facts" in properties

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


@dataclass(frozen=True)
class _Content:
    """The content blocks of a reply and why it stopped."""

    blocks: list[dict[str, Any]]
    stop_reason: str
    stop_sequence: str | None = None
    stop_details: dict[str, Any] | None = None
    over_cap: bool = False  # cut at max_tokens (counted as truncated)


def _tool_use(reply: SimReply, tool: Mapping[str, Any], fault: Fault | None, max_tokens: int) -> _Content:
    tool_input: dict[str, Any]
    if reply.kind in ("facts", "json") and reply.payload is not None:
        tool_input = dict(reply.payload)
    else:
        filled = fill_json_schema(tool.get("input_schema"), reply.text)
        tool_input = filled if isinstance(filled, dict) else {"text": reply.text}
    stop_reason = "tool_use"
    if fault is Fault.MALFORMED:
        # Forced tool input is always a JSON object on the real API; the realistic failure is an
        # object of the wrong shape: a string where the schema wants an array.
        tool_input = {key: malformed(json.dumps(value)) for key, value in tool_input.items()} or {
            "text": malformed(reply.text)
        }
    elif fault is Fault.TRUNCATED:
        half = estimate_tokens(json.dumps(tool_input)) // 2
        tool_input = _fit_facts(tool_input, half) if "facts" in tool_input else {}
        stop_reason = "max_tokens"
    over_cap = estimate_tokens(json.dumps(tool_input, ensure_ascii=False)) > max_tokens
    if over_cap:
        tool_input = _fit_facts(tool_input, max_tokens) if "facts" in tool_input else {}
        stop_reason = "max_tokens"
    block = {"type": "tool_use", "id": sim_id("toolu_"), "name": tool["name"], "input": tool_input}
    return _Content([block], stop_reason, over_cap=over_cap)


def _content(message: _MessageRequest, reply: SimReply, fault: Fault | None) -> _Content:
    if fault is Fault.REFUSAL:
        details = {"type": "refusal", "category": None, "explanation": "Simulated refusal."}
        return _Content([{"type": "text", "text": REFUSAL_TEXT}], "refusal", stop_details=details)
    tool = _pick_tool(message.body, reply)
    if tool is not None:
        return _tool_use(reply, tool, fault, message.max_tokens)
    stops = stop_list(message.body.get("stop_sequences"))
    shaped = shape_text(reply.text, fault, message.max_tokens, stops)
    if shaped.stop_sequence is not None:
        stop_reason = "stop_sequence"
    else:
        stop_reason = "max_tokens" if shaped.cut_short else "end_turn"
    block = {"type": "text", "text": shaped.text}
    return _Content([block], stop_reason, shaped.stop_sequence, over_cap=shaped.over_cap)


def _message_reply(
    state: SimulatorState, route: str, config: SimulatorConfig, message: _MessageRequest, draw: Draw
) -> Response:
    reply = simulated_reply(message.prompt.messages, message.max_tokens, config)
    content = _content(message, reply, draw.fault)
    outcome = OUTCOME_OK if draw.fault is None else draw.fault.value
    if content.over_cap:
        outcome = Fault.TRUNCATED.value

    prompt = message.prompt
    total_tokens = estimate_tokens(prompt.text)
    state.cache_write(message.cache.writes)
    cache_read = message.cache.read_tokens
    cache_creation = message.cache.written_tokens if config.cache_capacity else 0
    output_tokens = sum(
        estimate_tokens(block["text"] if block["type"] == "text" else json.dumps(block["input"]))
        for block in content.blocks
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
        "id": sim_id("msg_"),
        "type": "message",
        "role": "assistant",
        "model": message.model,
        "content": content.blocks,
        "stop_reason": content.stop_reason,
        "stop_sequence": content.stop_sequence,
        "stop_details": content.stop_details,
        "usage": {
            "input_tokens": max(0, total_tokens - cache_read - cache_creation),
            "output_tokens": output_tokens,
            "cache_creation_input_tokens": cache_creation,
            "cache_read_input_tokens": cache_read,
            "service_tier": "standard",
        },
    }
    return JSONResponse(payload, headers={"request-id": sim_id("req_")})


# A Messages API reply for a parsed body: what the online route answers, and each batched request.
answer_message = endpoint(ANTHROPIC, _parse_message, _message_reply)


async def messages_route(request: Request) -> Response:
    """POST /v1/messages (Anthropic)."""
    return await serve_online(request, "messages", ANTHROPIC, answer_message)


async def count_tokens_route(request: Request) -> Response:
    """POST /v1/messages/count_tokens (Anthropic): the same estimate the messages route bills."""
    try:
        body = await read_json(request)
        prompt = flatten(body)
    except BadRequest as exc:
        return invalid_request(exc)
    return JSONResponse({"input_tokens": estimate_tokens(prompt.text)})
