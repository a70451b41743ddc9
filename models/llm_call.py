"""One row per LLM call: who was asked, for what, what it cost and how it ended; and each day's spend."""

from __future__ import annotations

from datetime import date, datetime, timedelta
from decimal import Decimal
from typing import Any, cast

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    ColumnElement,
    ForeignKey,
    Index,
    Interval,
    Numeric,
    Select,
    Table,
    any_,
    bindparam,
    delete,
    exists,
    func,
    literal_column,
    or_,
    select,
    text,
)
from sqlalchemy.orm import Mapped, Session, aliased, mapped_column

from models.base import Base, count_column, utcnow_column
from models.job import PENDING_STATUSES, Job


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


def counts_for_job_budget(call: type[LLMCall] = LLMCall) -> ColumnElement[bool]:
    """Which of a job's calls (``call`` joined to jobs) count against its own budget
    (llm.budget_job_usd): those since its budgets last started over (its creation, a rerun for new
    content, a retry). The budget's check, the job's reported spend and the ledger's retention read it."""
    return call.created_at >= func.coalesce(Job.budget_since, Job.created_at)


def _expire_calls() -> Any:
    # Not the calls a pending job's own budget counts: a job paused for that budget longer than the
    # ledger is kept had its spend deleted, found room, and spent its whole budget again every
    # retention period. Oldest first, by ctid, SKIP LOCKED, as _expire.
    old = aliased(LLMCall, name="c")
    budgeted = exists().where(
        Job.id == old.job_id, Job.status.in_(PENDING_STATUSES), counts_for_job_budget(old)
    )
    expired: Select[Any] = (
        select(literal_column("c.ctid"))
        .where(
            old.created_at < func.now() - bindparam("kept", type_=Interval),
            or_(old.job_id.is_(None), ~budgeted),
        )
        .order_by(old.created_at)
        .limit(bindparam("limit"))
        .with_for_update(of=old, skip_locked=True)
    )
    return delete(cast(Table, LLMCall.__table__)).where(
        literal_column("ctid") == any_(func.array(expired.scalar_subquery()))
    )


_EXPIRE_CALLS = _expire_calls()


def expire_ledger(session: Session, kept: timedelta, limit: int) -> tuple[int, int]:
    """Delete up to ``limit`` extraction_audit rows and then up to ``limit`` llm_calls rows older than
    ``kept``, oldest first, in the caller's transaction; returns how many of each went. Decisions and
    newer audit rows naming a deleted call keep their place with llm_call_id NULL. The day budgets read
    llm_spend_days, not these rows; a pending job's calls are kept (its own budget sums them)."""
    audit = session.execute(_EXPIRE_AUDIT, {"kept": kept, "limit": limit}).rowcount  # type: ignore[attr-defined]
    calls = session.execute(_EXPIRE_CALLS, {"kept": kept, "limit": limit}).rowcount  # type: ignore[attr-defined]
    return audit, calls
