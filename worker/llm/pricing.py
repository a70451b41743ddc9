"""USD prices per million tokens, and the cost of one call's usage."""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal

from worker.llm.types import Usage


@dataclass(frozen=True)
class Price:
    input: Decimal
    output: Decimal
    cache_read: Decimal
    cache_write: Decimal


def _p(inp: str, out: str, read: str | None = None, write: str | None = None) -> Price:
    i = Decimal(inp)
    return Price(i, Decimal(out), Decimal(read) if read else i / 10, Decimal(write) if write else i)


# Published list prices (USD per 1M tokens) at the time of writing; override per deployment once
# the gateway's config-backed price table lands. Unknown models cost 0 and are logged as such.
PRICES: dict[str, Price] = {
    "gpt-4o-mini": _p("0.15", "0.60", "0.075"),
    "gpt-4o": _p("2.50", "10.00", "1.25"),
    "gpt-4.1-mini": _p("0.40", "1.60", "0.10"),
    "gpt-4.1": _p("2.00", "8.00", "0.50"),
    "claude-3-5-haiku-latest": _p("0.80", "4.00", "0.08", "1.00"),
    "claude-sonnet-4-5": _p("3.00", "15.00", "0.30", "3.75"),
}

MILLION = Decimal(1_000_000)
# The OpenAI Batch API and Anthropic Message Batches both bill every token class at half the list price.
BATCH_DISCOUNT = Decimal("0.5")


def cost_usd(
    model: str, usage: Usage, prices: dict[str, Price] | None = None, *, batch: bool = False
) -> Decimal:
    price = (prices or PRICES).get(model)
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
