"""The LLM a search uses, opened only when a line needs it: a client, a function that opens one (the
runtime's, whose settings may be incomplete), or none."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

from worker.accounting import LLMCallRecord
from worker.core.errors import LLMConfigurationError
from worker.llm.types import LLMClient
from worker.search.errors import UNCONFIGURED, VectorSearchUnavailableError

logger = logging.getLogger(__name__)

LLMSource = LLMClient | Callable[[], LLMClient] | None


def vector_model(call: LLMCallRecord) -> str:
    """What names a vector's model (facts.embedding_model): the provider and the model it answered
    with (an OpenAI-compatible server and OpenAI may both answer "text-embedding-3-small")."""
    return f"{call.provider}/{call.model}"


@functools.cache
def _without_llm(problem: str) -> None:  # once a process and problem: the reader is told less
    logger.warning("search runs without the LLM: %s", problem)


def resolve_llm(llm: LLMSource) -> LLMClient | None:
    """The client, opened if need be; incomplete LLM settings make vector search (and the expansion)
    unavailable: a plain query stays lexical, a vec: line is refused (no 500)."""
    if llm is None:
        return None
    if hasattr(llm, "chat"):
        return llm  # type: ignore[return-value]
    try:
        return llm()  # type: ignore[operator]
    except LLMConfigurationError as exc:
        _without_llm(str(exc))
        raise VectorSearchUnavailableError(UNCONFIGURED) from exc


__all__ = ["LLMSource", "resolve_llm", "vector_model"]
