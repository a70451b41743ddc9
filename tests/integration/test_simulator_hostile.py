"""The LLM simulator over HTTP on request shapes no SDK would send: each is a 400, never a 500.

A 500 from the simulator reads to the client as a provider outage, so a test that sends a malformed
request would see retries instead of the refusal a real provider answers; and uvicorn drops the
connection after an unhandled error, which resets the next request on it.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from worker.simulator import Simulator
from worker.simulator.wire import MAX_JSON_DEPTH

CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"
USER = [{"role": "user", "content": "Alice (2024-03-15T09:00:00Z): I moved to Lisbon."}]
VALID: dict[str, dict[str, Any]] = {
    CHAT: {
        "model": "simulator-1",
        "messages": USER,
        "response_format": {
            "type": "json_schema",
            "json_schema": {
                "name": "x",
                "schema": {"type": "object", "properties": {"k": {"type": "string"}}},
            },
        },
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        "n": 1,
    },
    MESSAGES: {
        "model": "simulator-1",
        "max_tokens": 200,
        "messages": USER,
        "tools": [{"name": "f", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "tool", "name": "f"},
    },
    # tool_choice "any" makes the simulator pick a tool by its schema (the forced one above does not).
    MESSAGES + "#any": {
        "model": "simulator-1",
        "max_tokens": 200,
        "messages": USER,
        "tools": [{"name": "f", "input_schema": {"type": "object", "properties": {"facts": {}}}}],
        "tool_choice": {"type": "any"},
    },
    "/v1/messages/count_tokens": {"model": "simulator-1", "messages": USER},
    "/v1/embeddings": {"model": "simulator-1", "input": ["a", "b"]},
    "/v1/messages/batches": {"requests": [{"custom_id": "a", "params": {"model": "m", "max_tokens": 9}}]},
}


@pytest.fixture
def http(sim: Simulator) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=sim.url, timeout=30) as client:
        yield client


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize(
    ("route", "body", "says"),
    [
        # A schema whose enum is an object, not a list (the schema filler read enum[0]: KeyError).
        (
            CHAT,
            {
                **VALID[CHAT],
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"type": "object", "properties": {"k": {"enum": {"a": 1}}}},
                    },
                },
            },
            None,
        ),
        # A tool named by a list (a set of names was built from it: unhashable).
        (
            MESSAGES,
            {
                **VALID[MESSAGES],
                "tools": [{"name": ["f"], "input_schema": {}}],
                "tool_choice": {"type": "tool", "name": ["f"]},
            },
            "tools.0.name",
        ),
        (MESSAGES, {**VALID[MESSAGES], "tools": ["f"]}, "tools.0.name"),
        # A tool schema's properties as a number, the tool picked by its schema ("facts" in 5).
        (
            MESSAGES,
            {
                **VALID[MESSAGES],
                "tools": [{"name": "f", "input_schema": {"properties": 5}}],
                "tool_choice": {"type": "any"},
            },
            None,
        ),
        # Ten million choices were built in memory (and answered) before; OpenAI's bound is 128.
        (CHAT, {**VALID[CHAT], "n": 10**7}, "at most 128"),
        (
            "/v1/messages/batches",
            {"requests": [{"custom_id": "a", "params": {}}, {"custom_id": "a", "params": {}}]},
            "unique in the batch",
        ),
    ],
    ids=[
        "enum-object",
        "tool-name-list",
        "tool-not-object",
        "properties-number",
        "n-huge",
        "batch-duplicate-id",
    ],
)
def test_odd_shapes_are_refused_or_answered_never_a_500(
    http: httpx.Client, route: str, body: dict[str, Any], says: str | None
) -> None:
    response = http.post(route, json=body)
    if says is None:
        assert response.status_code == 200, response.text
    else:
        assert response.status_code == 400, response.text
        assert says in response.text
    assert http.get("/_simulator/health").status_code == 200  # the connection still serves


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 900, 100_000])
def test_deeply_nested_json_is_a_400(http: httpx.Client, depth: int) -> None:
    """Past the decoder's limit (100,000) it raised RecursionError; below it, later steps could."""
    body = json.dumps({**VALID[CHAT], "metadata": None})[:-1] + ', "user": ' + _nested(depth) + "}"
    response = http.post(CHAT, content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text[:300]
    assert f"deeper than {MAX_JSON_DEPTH} levels" in response.json()["error"]["message"]
    ok = json.dumps({**VALID[CHAT], "metadata": {"k": _nested(MAX_JSON_DEPTH - 2)}})
    # At the limit: served (the chat route ignores metadata); an off-by-one refused it unseen.
    assert http.post(CHAT, content=ok, headers={"content-type": "application/json"}).status_code == 200


def test_a_batch_file_line_nested_too_deeply_is_refused(http: httpx.Client) -> None:
    line = json.dumps({"custom_id": "a", "method": "POST", "url": CHAT, "body": {"model": "m"}})
    deep = line[:-2] + ', "x": ' + _nested(5_000) + "}}"
    uploaded = http.post(
        "/v1/files", files={"file": ("in.jsonl", (deep + "\n").encode())}, data={"purpose": "batch"}
    ).json()
    created = http.post(
        "/v1/batches",
        json={"input_file_id": uploaded["id"], "endpoint": CHAT, "completion_window": "24h"},
    )
    assert created.status_code == 400, created.text
    assert "line 1 of the input file nests JSON deeper" in created.text


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def _paths(document: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every key path into a valid body, so a mutation can land anywhere in it."""
    found = [prefix] if prefix else []
    if isinstance(document, dict):
        for key, value in document.items():
            found += _paths(value, (*prefix, key))
    elif isinstance(document, list):
        for index, value in enumerate(document):
            found += _paths(value, (*prefix, index))
    return found


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_valid_body_with_any_part_replaced_is_never_a_500(http: httpx.Client, data: st.DataObject) -> None:
    route = data.draw(st.sampled_from(sorted(VALID)))
    body = copy.deepcopy(VALID[route])
    path = data.draw(st.sampled_from(_paths(body)))
    target = body
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = data.draw(JSON_VALUES)
    response = http.post(route.partition("#")[0], json=body)
    assert response.status_code < 500, (route, body, response.text[:300])
