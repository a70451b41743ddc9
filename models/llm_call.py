"""One row per LLM call: who was asked, for what, what it cost and how it ended; and each day's spend."""

from __future__ import annotations

from datetime import date, datetime, timedelta
from decimal import Decimal

from sqlalchemy import BigInteger, Boolean, CheckConstraint, ForeignKey, Index, Numeric, text
from sqlalchemy.orm import Mapped, Session, mapped_column

from models.base import Base, count_column, utcnow_column
from models.job import PENDING


class LLMCall(Base):
    __tablename__ = "llm_calls"
    __table_args__ = (Index("ix_llm_calls_created_at", "created_at"),)

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    job_id: Mapped[int | None] = mapped_column(ForeignKey("jobs.id", ondelete="SET NULL"), index=True)
    provider: Mapped[str]
    model: Mapped[str]
    purpose: Mapped[str]
    input_tokens: Mapped[int] = count_column()
    output_tokens: Mapped[int] = count_column()
    cache_read_tokens: Mapped[int] = count_column()
    cache_write_tokens: Mapped[int] = count_column()
    latency_ms: Mapped[int] = count_column()
    outcome: Mapped[str]
    cost_usd: Mapped[Decimal] = mapped_column(Numeric(18, 6), nullable=False, server_default="0")
    # Billed through a provider batch at the batch discount (worker.accounting.prices.BATCH_DISCOUNT).
    batch: Mapped[bool] = mapped_column(Boolean, nullable=False, server_default="false")
    error: Mapped[str | None]
    created_at: Mapped[datetime] = utcnow_column()


class LLMSpendDay(Base):
    """What one UTC day's LLM calls cost, per budget scope, kept by the ledger with each llm_calls row.

    The day budget reads it instead of summing the day's llm_calls rows, which took 173 ms at a
    million calls (bench/budget.py) and ran once a second in every worker. A row per ``backend``
    (the writing Postgres backend's pid): two transactions never update one row at once, so a commit
    never waits for another's, and the budget sums a few rows.
    """

    __tablename__ = "llm_spend_days"
    __table_args__ = (CheckConstraint("scope IN ('work', 'search')", name="scope"),)

    day: Mapped[date] = mapped_column(primary_key=True)
    scope: Mapped[str] = mapped_column(primary_key=True)  # worker.accounting.budget: work or search
    backend: Mapped[int] = mapped_column(primary_key=True)
    cost_usd: Mapped[Decimal] = mapped_column(Numeric(18, 6), nullable=False, server_default="0")


def _expire(table: str) -> str:
    # Oldest first, by ctid, SKIP LOCKED: as models.job.expire_jobs.
    return (
        f"DELETE FROM {table} WHERE ctid = ANY(ARRAY(SELECT ctid FROM {table}"
        " WHERE created_at < now() - :kept ORDER BY created_at LIMIT :limit FOR UPDATE SKIP LOCKED))"
    )


_EXPIRE_AUDIT = text(_expire("extraction_audit"))
# Not the calls a pending job's own budget counts (worker.accounting.budget.COUNTS_FOR_JOB_BUDGET: its
# calls since it last started over): a job paused for that budget longer than the ledger is kept had
# its spend deleted, found room, and spent its whole budget again every retention period.
_EXPIRE_CALLS = text(
    "DELETE FROM llm_calls WHERE ctid = ANY(ARRAY(SELECT c.ctid FROM llm_calls c"
    " WHERE c.created_at < now() - :kept AND (c.job_id IS NULL OR NOT EXISTS ("
    f"  SELECT 1 FROM jobs j WHERE j.id = c.job_id AND j.{PENDING}"
    "  AND c.created_at >= coalesce(j.budget_since, j.created_at)))"
    " ORDER BY c.created_at LIMIT :limit FOR UPDATE OF c SKIP LOCKED))"
)


def expire_ledger(session: Session, kept: timedelta, limit: int) -> tuple[int, int]:
    """Delete up to ``limit`` extraction_audit rows and then up to ``limit`` llm_calls rows older than
    ``kept``, oldest first, in the caller's transaction; returns how many of each went. Decisions and
    newer audit rows naming a deleted call keep their place with llm_call_id NULL. The day budgets read
    llm_spend_days, not these rows; a pending job's calls are kept (its own budget sums them)."""
    audit = session.execute(_EXPIRE_AUDIT, {"kept": kept, "limit": limit}).rowcount  # type: ignore[attr-defined]
    calls = session.execute(_EXPIRE_CALLS, {"kept": kept, "limit": limit}).rowcount  # type: ignore[attr-defined]
    return audit, calls
