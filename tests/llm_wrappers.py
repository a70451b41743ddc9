"""Real LLM clients (the simulator over HTTP) with one failure put in front, for the retry layer's tests."""

from __future__ import annotations

from typing import Any

from worker.llm.errors import LLMError


class FailsFirst:
    """``llm``, but its first chat fails as a 429 would (the retry layer above tries again)."""

    def __init__(self, llm: Any) -> None:
        self.llm, self.provider, self.model, self.failed = llm, llm.provider, llm.model, False

    def chat(self, request: Any) -> Any:
        if not self.failed:
            self.failed = True
            raise LLMError("HTTP 429: slow down", retryable=True, status=429, latency_ms=4)
        return self.llm.chat(request)

    def embed(self, texts: list[str], *, purpose: str = "embedding") -> Any:
        return self.llm.embed(texts, purpose=purpose)
