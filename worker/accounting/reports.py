"""Spend reports over llm_calls: calls, tokens, the cached share of input tokens, and USD per group.

Every figure is summed from the stored rows (costed once, by the Ledger, when they were written), so
`factmill costs`, a job's spend and the metrics agree by construction.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import String, case, cast, func, select
from sqlalchemy.orm import Session

from models import Job, LLMCall
from worker.accounting.budget import COUNTS_FOR_JOB_BUDGET

GROUPS: dict[str, Any] = {
    "job": func.coalesce(cast(LLMCall.job_id, String), "none"),
    "model": LLMCall.model,
    "purpose": LLMCall.purpose,
    # The UTC day, as the day budgets count (worker.accounting.budget), whatever the session's zone.
    "day": func.to_char(func.timezone("UTC", LLMCall.created_at), "YYYY-MM-DD"),
}
# Jobs in id order (their keys are text); calls of no job ("none") last.
ORDERS: dict[str, Any] = {"job": func.min(LLMCall.job_id)}
# How a call was billed: through a provider batch (at the batch discount) or online.
MODE = case((LLMCall.batch, "batch"), else_="online")
MODES = ("batch", "online")

_SUMS = (
    func.count(),
    func.coalesce(func.sum(LLMCall.input_tokens), 0),
    func.coalesce(func.sum(LLMCall.cache_read_tokens), 0),
    func.coalesce(func.sum(LLMCall.output_tokens), 0),
    func.coalesce(func.sum(LLMCall.cost_usd), 0),
)


@dataclass(frozen=True)
class SpendRow:
    key: str
    mode: str  # batch, online, or "all" for a total over both
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
    """Spend since ``since`` grouped by job, model, purpose or day, each group split into batch and
    online rows (ValueError for another grouping)."""
    if by not in GROUPS:
        raise ValueError(f"--by must be one of {', '.join(GROUPS)}")
    key = GROUPS[by].label("key")
    mode = MODE.label("mode")
    query = (
        select(key, mode, *_SUMS)
        .where(LLMCall.created_at >= since)
        .group_by(key, mode)
        .order_by(ORDERS.get(by, key), mode)
    )
    return [
        SpendRow(str(k), str(m), int(n), int(i), int(c), int(o), float(usd))
        for k, m, n, i, c, o, usd in session.execute(query)
    ]


def total(rows: list[SpendRow], mode: str = "all") -> SpendRow:
    """The rows summed (only those of ``mode``, batch or online, unless it is "all")."""
    kept = [r for r in rows if mode == "all" or r.mode == mode]
    return SpendRow(
        "total",
        mode,
        sum(r.calls for r in kept),
        sum(r.input_tokens for r in kept),
        sum(r.cached_tokens for r in kept),
        sum(r.output_tokens for r in kept),
        sum(r.cost_usd for r in kept),
    )


@dataclass(frozen=True)
class JobSpend:
    """What one job's LLM calls used and cost (every try of every call, batch and online)."""

    calls: int
    input_tokens: int  # every prompt token, cached ones included
    cached_tokens: int  # of input_tokens, read from the provider's prompt cache
    output_tokens: int
    cost_usd: Decimal
    # Of cost_usd, what its own budget (llm.budget_job_usd) counts: since its budgets last started over.
    budget_cost_usd: Decimal

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {
            "cost_usd": float(self.cost_usd),
            "budget_cost_usd": float(self.budget_cost_usd),
        }


def job_spend(session: Session, job_id: int) -> JobSpend:
    """One job's spend, summed from its llm_calls rows (`GET /v1/jobs/{id}` and `factmill jobs show`)."""
    budgeted = func.coalesce(func.sum(LLMCall.cost_usd).filter(COUNTS_FOR_JOB_BUDGET), 0)
    row = session.execute(
        select(*_SUMS, budgeted).join(Job, Job.id == LLMCall.job_id).where(LLMCall.job_id == job_id)
    ).one()
    calls, input_tokens, cached, output_tokens, usd, budget_usd = row
    return JobSpend(
        int(calls), int(input_tokens), int(cached), int(output_tokens), Decimal(usd), Decimal(budget_usd)
    )
