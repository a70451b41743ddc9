"""The outermost gateway layer: a budget check before every call (the budget itself is accounting's)."""

from __future__ import annotations

from typing import Any, Protocol

from worker.llm.types import ChatRequest, ChatResponse, EmbeddingResponse, LLMClient


class BudgetCheck(Protocol):
    """Raises BudgetExhaustedError when a budget is spent (worker.accounting.Budget is one)."""

    def check(self, job_id: int | None = None) -> None: ...


class BudgetedClient:
    """Checks the day's budget before every call any part of Factmill makes through this client
    (extraction also checks its job's budget). A refused call raises BudgetExhaustedError."""

    def __init__(self, inner: LLMClient, budget: BudgetCheck) -> None:
        self.inner, self.budget = inner, budget
        self.provider, self.model = inner.provider, inner.model

    def chat(self, request: ChatRequest) -> ChatResponse:
        self.budget.check()
        return self.inner.chat(request)

    def embed(self, texts: list[str], *, purpose: str = "embedding") -> EmbeddingResponse:
        self.budget.check()
        return self.inner.embed(texts, purpose=purpose)

    def __getattr__(self, name: str) -> Any:
        # chat_traced / embed_traced of the retry layer, provider-specific helpers: checked, then passed on.
        attribute = getattr(self.inner, name)
        if name in ("chat_traced", "embed_traced"):

            def checked(*args: Any, **kwargs: Any) -> Any:
                self.budget.check()
                return attribute(*args, **kwargs)

            return checked
        return attribute
