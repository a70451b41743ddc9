"""What a provider's reply must hold, read strictly: token counts, text and vectors of the right types.

OpenAI-compatible servers (vLLM, Ollama, gateways) vary, and the SDKs build their reply objects without
validating them. A count that is not a number, negative or past a 32-bit integer, a message content that is
an object, a NaN in a vector: each would surface later as a TypeError in a worker or as a database error
at commit, failing the segment's transaction again on every retry. Read here, each is a ``ReplyShapeError``
naming the field, which the providers turn into a non-retryable ``LLMError`` (recorded, audited, and the
page goes on by the failure policy).
"""

from __future__ import annotations

from collections.abc import Sequence

from worker.core.embeddings import storable_vector
from worker.core.jsonvalues import made_storable

# llm_calls keeps token counts in 32-bit integer columns.
MAX_TOKEN_COUNT = 2**31 - 1


class ReplyShapeError(ValueError):
    """A field of the reply is not what the wire format says it is."""


def token_count(value: object, field: str) -> int:
    """A usage count: absent (None) is 0; otherwise a whole number from 0 to MAX_TOKEN_COUNT, sent as a
    JSON number or as a string of decimal digits (some gateways quote their counts: the reply is
    otherwise sound, and refusing it would fail the segment for its bookkeeping alone)."""
    if value is None:
        return 0
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 10:
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOKEN_COUNT:
        raise ReplyShapeError(f"{field} is {_shown(value)}, not a token count")
    return value


def message_text(content: object, field: str) -> str:
    """A message's text: a string, none (""), or a list of content parts whose text parts are joined
    (how several OpenAI-compatible servers send it); made storable (no NUL, no lone surrogate), since
    a summary or a refusal is stored as it is."""
    if content is None:
        return ""
    if isinstance(content, str):
        return made_storable(content)
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or not isinstance(part.get("text", ""), str):
                raise ReplyShapeError(f"{field} holds {_shown(part)}, not a content part")
            if part.get("type") == "text":
                texts.append(part["text"])
        return made_storable("".join(texts))
    raise ReplyShapeError(f"{field} is {_shown(content)}, not text")


def optional_text(value: object, field: str) -> str | None:
    """A string field that may be absent (a model name, a refusal, a finish reason)."""
    if value is None or isinstance(value, str):
        return None if value is None else made_storable(value)
    raise ReplyShapeError(f"{field} is {_shown(value)}, not text")


def finite_vector(values: Sequence[float], field: str) -> list[float]:
    """An embedding whose every value is a finite number within float32's range (pgvector stores
    float4, and no NaN or infinity)."""
    vector = list(values)
    if not storable_vector(vector):
        raise ReplyShapeError(f"{field} holds a NaN, an infinity or a value past float32's range")
    return vector


def _shown(value: object) -> str:
    """The offending value: a number as it is, anything else by its JSON type only. The message is
    stored and logged, and a reply's strings hold what the model drew from the page."""
    if value is None or isinstance(value, bool | int | float):
        return "null" if value is None else repr(value)
    kinds = {str: "a string", list: "a list", dict: "an object"}
    return next((name for kind, name in kinds.items() if isinstance(value, kind)), type(value).__name__)
