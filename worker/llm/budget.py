"""LLM spending limits per day and per job, read live from the config table, and price overrides."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from models import LLMCall
from worker.llm.errors import LLMError
from worker.llm.pricing import PRICES, Price
from worker.llm.types import ChatRequest, ChatResponse, EmbeddingResponse, LLMClient

DAILY_BUDGET_KEY = "llm.budget_daily_usd"
JOB_BUDGET_KEY = "llm.budget_job_usd"
PRICES_KEY = "llm.prices"
BUDGET_KEYS = (DAILY_BUDGET_KEY, JOB_BUDGET_KEY)


class BudgetExhaustedError(LLMError):
    """No LLM call was made: a budget is spent. Work waits (paused) until the budget has room."""

    outcome = "budget_exhausted"

    def __init__(self, scope: str, limit: Decimal, spent: Decimal) -> None:
        key = DAILY_BUDGET_KEY if scope == "day" else JOB_BUDGET_KEY
        super().__init__(
            f"the {scope} LLM budget is exhausted (spent ${spent:.4f} of ${limit:.4f}); raise it with "
            f"`factmill config set {key} <usd>`; waiting jobs resume by themselves",
            retryable=False,
        )
        self.scope, self.limit, self.spent = scope, limit, spent


def parse_usd(value: str | None) -> Decimal | None:
    """A budget value: a non-negative number of dollars; None/empty means no limit."""
    if value is None or not value.strip():
        return None
    try:
        amount = Decimal(value.strip())
    except InvalidOperation as exc:
        raise ValueError(
            f"a budget must be a number of US dollars such as 25 or 2.50, got {value!r}"
        ) from exc
    if not amount.is_finite() or amount < 0:
        raise ValueError(f"a budget must be a non-negative number of US dollars, got {value!r}")
    return amount


def parse_prices(value: str | None) -> dict[str, Price]:
    """``{"model": {"input": 0.15, "output": 0.6, "cache_read": 0.075, "cache_write": 0.15}}`` (USD per
    1M tokens) → prices; cache prices default to a tenth / the full input price."""
    if value is None or not value.strip():
        return {}
    try:
        raw = json.loads(value)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{PRICES_KEY} must be a JSON object of model → prices: {exc.msg}") from exc
    if not isinstance(raw, dict):
        raise ValueError(f"{PRICES_KEY} must be a JSON object of model → prices")
    prices: dict[str, Price] = {}
    for model, entry in raw.items():
        if not isinstance(entry, dict) or "input" not in entry or "output" not in entry:
            raise ValueError(
                f"{PRICES_KEY}[{model!r}] needs at least 'input' and 'output' (USD per 1M tokens)"
            )
        try:
            numbers = {
                k: Decimal(str(v))
                for k, v in entry.items()
                if k in ("input", "output", "cache_read", "cache_write")
            }
        except InvalidOperation as exc:
            raise ValueError(f"{PRICES_KEY}[{model!r}] prices must be numbers") from exc
        if any(not n.is_finite() or n < 0 for n in numbers.values()):
            raise ValueError(f"{PRICES_KEY}[{model!r}] prices must be non-negative numbers")
        prices[str(model)] = Price(
            numbers["input"],
            numbers["output"],
            numbers.get("cache_read", numbers["input"] / 10),
            numbers.get("cache_write", numbers["input"]),
        )
    return prices


def validate_config_value(key: str, value: str) -> None:
    if key in BUDGET_KEYS:
        parse_usd(value)
    elif key == PRICES_KEY:
        parse_prices(value)


class Budget:
    """Checks spend (from llm_calls) against the live budgets before each call.

    The day total is cached for ``ttl`` seconds, so a check costs one query per ttl; concurrent
    calls may overshoot a budget by the calls already in flight, never by more.
    """

    def __init__(
        self,
        factory: sessionmaker[Session],
        get_config: Callable[[str], str | None],
        ttl: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._factory, self._get, self._ttl, self._clock = factory, get_config, ttl, clock
        self._lock = threading.Lock()
        self._day: tuple[float, Decimal] | None = None

    def prices(self) -> dict[str, Price]:
        try:
            return {**PRICES, **parse_prices(self._get(PRICES_KEY))}
        except ValueError:
            return dict(PRICES)  # a bad override was refused at `config set`; never fail a call over it

    def spent_today(self) -> Decimal:
        now = self._clock()
        with self._lock:
            if self._day is not None and now - self._day[0] < self._ttl:
                return self._day[1]
        midnight = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
        with self._factory() as session:
            spent = session.scalar(
                select(func.coalesce(func.sum(LLMCall.cost_usd), 0)).where(LLMCall.created_at >= midnight)
            )
        with self._lock:
            self._day = (now, Decimal(spent or 0))
        return Decimal(spent or 0)

    def spent_by_job(self, job_id: int) -> Decimal:
        with self._factory() as session:
            spent = session.scalar(
                select(func.coalesce(func.sum(LLMCall.cost_usd), 0)).where(LLMCall.job_id == job_id)
            )
        return Decimal(spent or 0)

    def check(self, job_id: int | None = None) -> None:
        """Raise BudgetExhaustedError if the day's (or this job's) budget is spent."""
        daily = self._limit(DAILY_BUDGET_KEY)
        if daily is not None:
            spent = self.spent_today()
            if spent >= daily:
                raise BudgetExhaustedError("day", daily, spent)
        per_job = self._limit(JOB_BUDGET_KEY)
        if per_job is not None and job_id is not None:
            spent = self.spent_by_job(job_id)
            if spent >= per_job:
                raise BudgetExhaustedError("job", per_job, spent)

    def has_room(self, job_id: int | None = None) -> bool:
        try:
            self.check(job_id)
        except BudgetExhaustedError:
            return False
        return True

    def _limit(self, key: str) -> Decimal | None:
        try:
            return parse_usd(self._get(key))
        except ValueError:
            return None


class BudgetedClient:
    """Checks the day's budget before every call any part of Factmill makes through this client
    (extraction also checks its job's budget). A refused call raises BudgetExhaustedError."""

    def __init__(self, inner: LLMClient, budget: Budget) -> None:
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
