"""What the simulated model says: facts for an extraction prompt, otherwise a deterministic text reply."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from worker.core.intent import extract_intent_terms
from worker.simulator.consolidation import consolidation_reply, is_consolidation_prompt
from worker.simulator.extractor import extract_facts, facts_document
from worker.simulator.heuristics import sentences
from worker.simulator.prompt import (
    CHARACTERS_PER_TOKEN,
    DEFAULT_MAX_FACTS,
    UNTRUSTED_CLOSE,
    UNTRUSTED_OPEN,
    PromptMessage,
    SegmentMatch,
    find_segment,
    requested_max_facts,
)


def _first_sentences(text: str, count: int) -> list[str]:
    out: list[str] = []
    for sentence in sentences(text):
        out.append(sentence)
        if len(out) >= count:
            break
    return out


def _fit(parts: list[str], max_chars: int | None, joiner: str) -> str:
    text = joiner.join(parts)
    if max_chars is None:
        return text
    while len(parts) > 1 and len(text) > max_chars:
        parts = parts[:-1]
        text = joiner.join(parts)
    return text


_TRANSCRIPT_TAG = re.compile(r"^\[(?P<tag>[^\]]+)\]\s*(?P<text>.*)$")
_CONSTRAINT = re.compile(
    r"\b(?:must|should|never|always|don't|do not|avoid|prefer|only|without|require[sd]?)\b", re.IGNORECASE
)
_DECISION = re.compile(
    r"\b(?:decided|decision|chose|chosen|we'll use|will use|agreed|settled on)\b", re.IGNORECASE
)
_NEXT = re.compile(r"\b(?:next|todo|to do|then|need to|will|plan to|remaining)\b", re.IGNORECASE)
_BLOCKED = re.compile(r"\b(?:blocked|fail(?:s|ed|ing)?|error|cannot|can't|denied|broken)\b", re.IGNORECASE)


def compaction_summary(transcript: str, max_chars: int | None = None) -> str:
    """A summary under the compaction headings, built from first sentences of the transcript's lines."""
    entries: list[tuple[str, str]] = []
    for raw in transcript.splitlines():
        line = raw.strip()
        if not line:
            continue
        match = _TRANSCRIPT_TAG.match(line)
        if match:
            entries.append((match["tag"].lower(), match["text"]))
        elif entries:
            tag, text = entries[-1]
            entries[-1] = (tag, f"{text} {line}")
        else:
            entries.append(("user", line))

    def first(text: str) -> str:
        found = _first_sentences(text, 1)
        return found[0][:300] if found else ""

    user_lines = [first(t) for tag, t in entries if tag == "user" and first(t)]
    said = [first(t) for tag, t in entries if not tag.startswith("tool") and first(t)]
    assistant = [first(t) for tag, t in entries if tag == "assistant" and first(t)]

    def bullets(items: Iterable[str], limit: int) -> list[str]:
        picked = list(dict.fromkeys(items))[:limit]
        return [f"- {item}" for item in picked] or ["- (none)"]

    head = [
        "## Goal",
        user_lines[0] if user_lines else "(not stated)",
        "",
        "## Constraints & Preferences",
        *bullets((s for s in said if _CONSTRAINT.search(s)), 3),
        "",
        "## Progress",
        "### Done",
        *bullets(assistant, 3),
        "### In Progress",
        *bullets(assistant[3:4], 1),
        "### Blocked",
        *bullets((s for s in said if _BLOCKED.search(s)), 2),
        "",
        "## Key Decisions",
        *bullets((s for s in said if _DECISION.search(s)), 3),
        "",
        "## Next Steps",
        *bullets((s for s in said[-6:] if _NEXT.search(s)), 3),
        "",
        "## Critical Context",
    ]
    context = [f"- {s}" for s in list(dict.fromkeys(said))[-12:]] or ["- (none)"]
    head_text = "\n".join(head)
    room = None if max_chars is None else max_chars - len(head_text) - 1
    return head_text + "\n" + _fit(context, room, "\n")


SEARCH_QUERY_OPEN = "<search-query>"
SEARCH_QUERY_CLOSE = "</search-query>"
SEARCH_INTENT_OPEN = "<search-intent>"
SEARCH_INTENT_CLOSE = "</search-intent>"


def _between(text: str, open_tag: str, close_tag: str) -> str | None:
    start = text.find(open_tag)
    end = text.rfind(close_tag)
    if start < 0 or end < start + len(open_tag):
        return None
    return text[start + len(open_tag) : end].strip()


def search_expansion_reply(query: str, intent: str | None = None) -> str:
    """What the simulator says to a search query-expansion prompt: one lex:, one vec: and one hyde: line.

    The lex line keeps the query's content words (stop words dropped), the vec line restates the query
    with its intent, and the hyde line is a "hypothetical fact" built from the same words. Not a model:
    it only gives search a deterministic expansion to fuse.
    """
    words = extract_intent_terms(query) or query.lower().split() or ["nothing"]
    focus = extract_intent_terms(intent) if intent else []
    lex = " ".join(dict.fromkeys(words + focus))
    vec = query.strip() + (f" ({intent.strip()})" if intent and intent.strip() else "")
    hyde = " ".join(words).capitalize() + "."
    return f"lex: {lex}\nvec: {vec}\nhyde: {hyde}"


def text_reply(messages: Sequence[PromptMessage], max_tokens: int | None = None) -> str:
    """A short deterministic reply to a prompt that is not a fact extraction.

    Search query-expansion prompts (a last user message opening with <search-query>) get lex:/vec:/hyde:
    lines; compaction prompts (transcript inside <untrusted-data>) get a summary under the compaction
    headings; anything else gets the first sentences of the last user message. The reply aims to fit
    max_tokens.
    """
    max_chars = None if max_tokens is None else max(1, max_tokens) * CHARACTERS_PER_TOKEN
    last = next((m.text for m in reversed(messages) if m.role == "user" and m.text.strip()), "")
    if last.lstrip().startswith(SEARCH_QUERY_OPEN):
        query = _between(last, SEARCH_QUERY_OPEN, SEARCH_QUERY_CLOSE)
        if query is not None:
            intent = _between(last, SEARCH_INTENT_OPEN, SEARCH_INTENT_CLOSE)
            return search_expansion_reply(query, intent)
    for message in reversed(messages):
        start = message.text.find(UNTRUSTED_OPEN)
        end = message.text.rfind(UNTRUSTED_CLOSE)
        if start >= 0 and end > start:
            return compaction_summary(message.text[start + len(UNTRUSTED_OPEN) : end], max_chars)
    last_user = last
    if not last_user:
        last_user = next((m.text for m in reversed(messages) if m.text.strip()), "")
    opening = _first_sentences(last_user, 3)
    if not opening:
        return "(nothing to summarise)"
    return _fit(opening, max_chars, " ")


@dataclass(frozen=True)
class SimReply:
    """What the simulated model says: a facts object (kind "facts"), another JSON document it answers
    in full (kind "json": consolidation decisions) or plain text (kind "text")."""

    kind: Literal["facts", "json", "text"]
    text: str
    payload: dict[str, Any] | None = None
    segment: SegmentMatch | None = None


def reply_to(
    messages: Sequence[PromptMessage],
    *,
    max_tokens: int | None = None,
    default_max_facts: int = DEFAULT_MAX_FACTS,
) -> SimReply:
    """The simulated model's answer to a prompt: facts for an extraction prompt, decisions for a
    consolidation prompt, otherwise text."""
    last = next((m.text for m in reversed(messages) if m.role == "user"), "")
    if is_consolidation_prompt(last):
        decisions = consolidation_reply(last)
        return SimReply("json", json.dumps(decisions, ensure_ascii=False), decisions)
    segment = find_segment(messages)
    if segment is not None:
        cap = requested_max_facts(segment.instructions, default_max_facts)
        payload = facts_document(extract_facts(segment.content, cap))
        return SimReply("facts", json.dumps(payload, ensure_ascii=False), payload, segment)
    return SimReply("text", text_reply(messages, max_tokens))


def fill_json_schema(schema: Mapping[str, Any] | None, text: str) -> Any:
    """A minimal value that fits a JSON schema, with `text` in its string slots (for non-extraction JSON)."""
    if not isinstance(schema, Mapping):
        return {"text": text}
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        return enum[0]
    if "const" in schema:
        return schema["const"]
    for combinator in ("anyOf", "oneOf", "allOf"):
        options = schema.get(combinator)
        if isinstance(options, list) and options:
            return fill_json_schema(options[0], text)
    if kind == "object" or (kind is None and "properties" in schema):
        properties = schema.get("properties")
        if not isinstance(properties, Mapping) or not properties:
            return {"text": text}
        return {name: fill_json_schema(sub, text) for name, sub in properties.items()}
    if kind == "array":
        return []
    if kind == "string":
        return text
    if kind == "integer":
        return 0
    if kind == "number":
        return 0.0
    if kind == "boolean":
        return False
    if kind == "null":
        return None
    return text
