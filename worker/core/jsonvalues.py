"""JSON values as JSON Schema means them, where Python's types differ, and what Postgres can store."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from typing import Any

BIGINT_MAX = 2**63 - 1  # Postgres bigint (every id column)
INT4_MAX = 2**31 - 1  # Postgres integer (seq, token counts, settings)
_SURROGATE = re.compile("[\ud800-\udfff]")


def json_integer(value: object) -> object:
    """1.0 is an integer in JSON Schema: give it as 1. Anything else is returned as it is, so 1.5, "1"
    and true stay what they are (and are refused by whoever wants an int)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def text_problem(value: str) -> str | None:
    """Why ``value`` cannot be stored as text (NUL, a lone surrogate), or None when it can."""
    if "\x00" in value:
        return "must not contain NUL (\\u0000) characters"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return "must not contain lone surrogates (\\ud800-\\udfff): it is not valid Unicode text"
    return None


def not_json(value: object, path: str = "") -> str | None:
    """Where in ``value`` (a parsed document: dicts, lists, scalars) something JSON cannot hold sits,
    or Postgres cannot store, and what it is (``"x.y[2]: nan is not a JSON number"``); None when it
    all can. NaN and the infinities (YAML's ``.nan``, ``.inf``, or a number past a double), bytes
    (YAML's ``!!binary``), sets (``!!set``), and a key or string holding NUL or a lone surrogate (YAML's
    ``"\0"`` and ``"\ud800"`` escapes: a traceback at the page's hash or its insert)."""
    stack: list[tuple[object, str]] = [(value, path)]
    while stack:
        node, where = stack.pop()
        if isinstance(node, float) and not math.isfinite(node):
            return f"{where or 'value'}: {node!r} is not a JSON number"
        if isinstance(node, str) and (problem := text_problem(node)):
            return f"{where or 'value'}: {problem}"
        if isinstance(node, bytes | bytearray | set | frozenset):
            return f"{where or 'value'}: a {type(node).__name__} value has no JSON form"
        if isinstance(node, dict):
            for key in node:
                if isinstance(key, str) and (problem := text_problem(key)):
                    return f"{where or 'value'}: a key {problem}"
            stack.extend((item, f"{where}.{key}" if where else str(key)) for key, item in node.items())
        elif isinstance(node, list | tuple):
            stack.extend((item, f"{where}[{index}]") for index, item in enumerate(node))
    return None


def nesting_depth(value: object) -> int:
    """How many mappings and lists deep ``value`` nests (a scalar 0, ``{}`` 1, ``{"a": [1]}`` 2), walked
    without recursion."""
    deepest = 0
    stack: list[tuple[object, int]] = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            node = list(node.values())
        if isinstance(node, list | tuple):
            deepest = max(deepest, depth + 1)
            stack.extend((item, depth + 1) for item in node)
    return deepest


def made_storable(text: str) -> str:
    """A model's text as Postgres can store it: NUL characters dropped and each lone surrogate replaced
    by U+FFFD, everything else as it was. Refusing instead would fail a segment (or a summary) whose
    answer is otherwise good, at its commit, on every retry; a client's text is refused (``text_problem``)."""
    if "\x00" in text:
        text = text.replace("\x00", "")
    if text.isascii():  # CPython knows this without a scan: most replies skip the encode below
        return text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return _SURROGATE.sub("\ufffd", text)
    return text


def storable_text(value: str) -> str:
    """``value`` itself, or ValueError saying why it cannot be stored (a validator for text fields)."""
    problem = text_problem(value)
    if problem:
        raise ValueError(problem)
    return value


__all__ = [
    "EchoedExampleError",
    "SecondObjectError",
    "json_integer",
    "made_storable",
    "not_json",
    "reply_json",
    "storable_text",
    "strip_code_fence",
    "text_problem",
]


_FENCE_OPEN = re.compile(r"```[a-zA-Z]*")


def strip_code_fence(text: str) -> str:
    """A model's JSON reply without the Markdown code fence some providers wrap it in (json_object mode
    does not forbid one). String operations, not a trailing-space pattern: linear in any reply."""
    stripped = text.strip()
    opening = _FENCE_OPEN.match(stripped)
    if opening is None:
        return stripped
    stripped = stripped[opening.end() :].lstrip()
    return stripped[:-3].rstrip() if stripped.endswith("```") else stripped


_DECODER = json.JSONDecoder()


def reply_json(text: str, *, echoes: Sequence[Any] = ()) -> Any:
    """A model's JSON reply: the whole of it (a code fence and a byte-order mark taken off), else its
    one whole object with prose around it ("Here are the facts: {...}", a stray fence after it), which
    json_object mode does not forbid: each such reply cost a paid repair turn. Not when another object
    (whole, or begun and broken) follows: a draft, or the prompt's own '{"facts":[]}' quoted before the
    answer, was taken for it (0 facts, the checkpoint past the segment); nor one of ``echoes`` (the
    prompt's worked example): the caller asks again (EchoedExampleError for an echo). Raises what
    json.loads raises."""
    body = strip_code_fence(text.lstrip("\ufeff"))
    try:
        found = json.loads(body)
    except json.JSONDecodeError as first:
        start = body.find("{")
        if start < 0:
            raise
        try:
            found, end = _DECODER.raw_decode(body, start)
        except json.JSONDecodeError:
            raise first from None
        if _another_object_after(body, end):
            raise SecondObjectError("more than one JSON object (which is the answer?)", body, end) from None
    if any(found == echo for echo in echoes):  # alone or with prose: the prompt's, not an answer
        raise EchoedExampleError(
            "the reply repeats the prompt's worked example, not this segment's answer", body, 0
        )
    return found


class EchoedExampleError(json.JSONDecodeError):
    """The reply is the prompt's worked example, repeated: valid JSON, and no answer."""


class SecondObjectError(json.JSONDecodeError):
    """The reply holds an object with prose around it, and another object (or the start of one) after."""


def _another_object_after(body: str, end: int) -> bool:
    """Whether something that begins like an object (a brace, then a key's quote or its closing brace)
    follows ``end``: whole or broken (a trailing comma, cut off in a key), it is another answer, and
    which one is meant is a guess. A brace in prose ("{note}", "{ a, b }") is passed over. One regular
    search, linear (trying to decode at every brace cost a scan of the text before it per brace)."""
    return _OBJECT_START.search(body, end) is not None


_OBJECT_START = re.compile(r'\{\s*["}]')
