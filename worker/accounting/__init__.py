"""LLM accounting: prices, budgets, and the one writer of llm_calls rows."""

from __future__ import annotations

from worker.accounting.budget import (
    BUDGET_KEYS,
    DAILY_BUDGET_KEY,
    JOB_BUDGET_KEY,
    SEARCH_DAILY_BUDGET_KEY,
    SEARCH_PURPOSES,
    Budget,
    parse_usd,
)
from worker.accounting.ledger import (
    ERASED_CALL_ERROR,
    Ledger,
    LLMCallRecord,
    forget_call_errors,
    forget_errors_of,
)
from worker.accounting.prices import BATCH_DISCOUNT, PRICES, PRICES_KEY, Price, cost_usd, parse_prices


def validate_config_value(key: str, value: str) -> None:
    """Refuse a budget or price override that would not parse (called by `config set` and the API)."""
    if key in BUDGET_KEYS:
        parse_usd(value)
    elif key == PRICES_KEY:
        parse_prices(value)


__all__ = [
    "BATCH_DISCOUNT",
    "BUDGET_KEYS",
    "DAILY_BUDGET_KEY",
    "ERASED_CALL_ERROR",
    "JOB_BUDGET_KEY",
    "PRICES",
    "PRICES_KEY",
    "SEARCH_DAILY_BUDGET_KEY",
    "SEARCH_PURPOSES",
    "Budget",
    "LLMCallRecord",
    "Ledger",
    "Price",
    "cost_usd",
    "forget_call_errors",
    "forget_errors_of",
    "parse_prices",
    "parse_usd",
    "validate_config_value",
]
