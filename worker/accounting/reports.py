"""Spend reports over llm_calls: calls, tokens, the cached share of input tokens, and USD per group."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from models import LLMCall

GROUPS: dict[str, Any] = {
    "model": LLMCall.model,
    "purpose": LLMCall.purpose,
    "day": func.to_char(func.date_trunc("day", LLMCall.created_at), "YYYY-MM-DD"),
}


@dataclass(frozen=True)
class SpendRow:
    key: str
    calls: int
    input_tokens: int
    cached_tokens: int
    output_tokens: int
    cost_usd: float

    @property
    def cached_share(self) -> float:
        return round(self.cached_tokens / self.input_tokens, 4) if self.input_tokens else 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"cached_share": self.cached_share}


def spend(session: Session, *, by: str, since: datetime) -> list[SpendRow]:
    """Spend since ``since`` grouped by model, purpose or day (ValueError for anything else)."""
    if by not in GROUPS:
        raise ValueError(f"--by must be one of {', '.join(GROUPS)}")
    key = GROUPS[by].label("key")
    query = (
        select(
            key,
            func.count(),
            func.sum(LLMCall.input_tokens),
            func.sum(LLMCall.cache_read_tokens),
            func.sum(LLMCall.output_tokens),
            func.sum(LLMCall.cost_usd),
        )
        .where(LLMCall.created_at >= since)
        .group_by(key)
        .order_by(key)
    )
    return [
        SpendRow(str(k), int(n), int(i or 0), int(c or 0), int(o or 0), float(usd or 0))
        for k, n, i, c, o, usd in session.execute(query)
    ]


def total(rows: list[SpendRow]) -> SpendRow:
    return SpendRow(
        "total",
        sum(r.calls for r in rows),
        sum(r.input_tokens for r in rows),
        sum(r.cached_tokens for r in rows),
        sum(r.output_tokens for r in rows),
        sum(r.cost_usd for r in rows),
    )
