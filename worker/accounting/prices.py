"""USD prices per million tokens (list prices plus the `llm.prices` override), and one call's cost."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

from worker.core.model_names import undated_model
from worker.llm.ratelimit import estimate_request_tokens
from worker.llm.types import ChatRequest, Usage


@dataclass(frozen=True)
class Price:
    input: Decimal
    output: Decimal
    cache_read: Decimal
    cache_write: Decimal


def _p(inp: str, out: str, read: str | None = None, write: str | None = None) -> Price:
    i = Decimal(inp)
    return Price(i, Decimal(out), Decimal(read) if read else i / 10, Decimal(write) if write else i)


PRICES_KEY = "llm.prices"

# Published list prices (USD per 1M tokens) at the time of writing; a deployment overrides them with
# the `llm.prices` config key. Unknown models cost 0 (the ledger names each in a warning, once a process).
PRICES: dict[str, Price] = {
    "gpt-4o-mini": _p("0.15", "0.60", "0.075"),
    "gpt-4o": _p("2.50", "10.00", "1.25"),
    "gpt-4.1-mini": _p("0.40", "1.60", "0.10"),
    "gpt-4.1": _p("2.00", "8.00", "0.50"),
    # A reply names its dated snapshot (gpt-5-mini-2025-08-07, claude-haiku-4-5-20251001): priced by these.
    "gpt-5-nano": _p("0.05", "0.40", "0.005"),
    "gpt-5-mini": _p("0.25", "2.00", "0.025"),
    "gpt-5": _p("1.25", "10.00", "0.125"),
    "claude-3-5-haiku-latest": _p("0.80", "4.00", "0.08", "1.00"),
    "claude-haiku-4-5": _p("1.00", "5.00", "0.10", "1.25"),
    "claude-sonnet-4-5": _p("3.00", "15.00", "0.30", "3.75"),
    "claude-opus-4-5": _p("5.00", "25.00", "0.50", "6.25"),
    # Embeddings bill input only. The gateway embeds with text-embedding-3-small by default (with the
    # Anthropic provider too): unpriced, every embedding cost 0 and the search budget never saw one.
    "text-embedding-3-small": _p("0.02", "0"),
    "text-embedding-3-large": _p("0.13", "0"),
}

MILLION = Decimal(1_000_000)
# A price past this (USD per 1M tokens; list prices today are at most a few hundred) is a typo, such as a
# price per token written as per million, or per thousand. It also keeps every call's cost (at most
# 2^31 tokens of each class, worker.llm.replies) within llm_calls.cost_usd.
MAX_PRICE = Decimal(10_000)
PRICE_FIELDS = ("input", "output", "cache_read", "cache_write")
# The OpenAI Batch API and Anthropic Message Batches both bill every token class at half the list price.
BATCH_DISCOUNT = Decimal("0.5")


def price_of(model: str, prices: dict[str, Price] | None = None) -> Price | None:
    """The price of ``model`` as a provider's reply names it: its own entry (an override may price one
    snapshot), else its undated name's, else that name's "-latest" alias; None when none is known.
    Priced by the reply's exact name only, every call to a real provider cost 0 (and no budget ever
    tripped), since replies name the dated snapshot that served them."""
    table = prices or PRICES
    price = table.get(model)
    if price is not None:
        return price
    undated = undated_model(model)
    if undated == model:
        return None
    return table.get(undated) or table.get(f"{undated}-latest")


def cost_usd(
    model: str, usage: Usage, prices: dict[str, Price] | None = None, *, batch: bool = False
) -> Decimal:
    price = price_of(model, prices)
    if price is None:
        return Decimal(0)
    # input_tokens counts every prompt token, cached ones included (both providers, as the gateway reports).
    uncached = max(0, usage.input_tokens - usage.cache_read_tokens - usage.cache_write_tokens)
    total = (
        uncached * price.input
        + usage.cache_read_tokens * price.cache_read
        + usage.cache_write_tokens * price.cache_write
        + usage.output_tokens * price.output
    ) / MILLION
    if batch:
        total *= BATCH_DISCOUNT
    return total.quantize(Decimal("0.000001"))


def estimated_batch_cost(
    model: str, requests: Iterable[ChatRequest], prices: dict[str, Price] | None = None
) -> Decimal:
    """What a batch of ``requests`` may cost at most: each prompt at 4 characters a token and each
    output cap in full, at the batch price (0 for a model with no known price)."""
    total = Decimal(0)
    for request in requests:
        estimated = estimate_request_tokens(request)
        usage = Usage(input_tokens=estimated - request.max_tokens, output_tokens=request.max_tokens)
        total += cost_usd(model, usage, prices, batch=True)
    return total


def parse_prices(value: str | None) -> dict[str, Price]:
    """``{"model": {"input": 0.15, "output": 0.6, "cache_read": 0.075, "cache_write": 0.15}}`` (USD per
    1M tokens) → prices; cache prices default to a tenth / the full input price."""
    if value is None or not value.strip():
        return {}
    try:
        raw = json.loads(value)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{PRICES_KEY} must be a JSON object of model → prices: {exc.msg}") from exc
    except RecursionError:  # thousands of nested arrays: past the decoder's limit (a 500 before)
        raise ValueError(f"{PRICES_KEY} must be a JSON object of model → prices, not nested") from None
    except ValueError:  # an integer of 4,300+ digits: Python's advice (sys.set_int_max_str_digits) was said
        raise ValueError(
            f"{PRICES_KEY} holds a number thousands of digits long; prices are USD per 1M tokens"
        ) from None
    if not isinstance(raw, dict):
        raise ValueError(f"{PRICES_KEY} must be a JSON object of model → prices")
    prices: dict[str, Price] = {}
    for model, entry in raw.items():
        if not isinstance(entry, dict) or "input" not in entry or "output" not in entry:
            raise ValueError(
                f"{PRICES_KEY}[{model!r}] needs at least 'input' and 'output' (USD per 1M tokens)"
            )
        unknown = sorted(str(k) for k in entry if k not in PRICE_FIELDS)
        if unknown:  # a misspelt cache_read would silently price at the default
            raise ValueError(
                f"{PRICES_KEY}[{model!r}] has {', '.join(map(repr, unknown))}: the prices are "
                f"{', '.join(PRICE_FIELDS)} (USD per 1M tokens)"
            )
        numbers = {k: _price(model, k, v) for k, v in entry.items()}
        prices[str(model)] = Price(
            numbers["input"],
            numbers["output"],
            numbers.get("cache_read", numbers["input"] / 10),
            numbers.get("cache_write", numbers["input"]),
        )
    return prices


def _price(model: object, field: str, value: object) -> Decimal:
    """One price: a JSON number from 0 to MAX_PRICE (USD per 1M tokens)."""
    shown = f"{PRICES_KEY}[{model!r}].{field}"
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"{shown} must be a number of USD per 1M tokens")
    try:
        number = Decimal(str(value))
    except InvalidOperation as exc:
        raise ValueError(f"{shown} must be a number of USD per 1M tokens, not {value!r}") from exc
    if not number.is_finite() or not 0 <= number <= MAX_PRICE:
        raise ValueError(f"{shown} must be from 0 to {MAX_PRICE:,} USD per 1M tokens, not {value}")
    return number
