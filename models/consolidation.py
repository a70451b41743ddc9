"""Consolidation's audit rows (one per decision, with its reason) and its per-entity checkpoints."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import BigInteger, CheckConstraint, DateTime, Float, ForeignKey, Index, Text, func
from sqlalchemy.orm import Mapped, mapped_column

from models.base import Base, count_column, utcnow_column
from worker.core.consolidation import DECIDERS, DECISIONS


def _in(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


class ConsolidationDecision(Base):
    """One decision about a fact: what it was found to be (new, a duplicate, an update of, in
    contradiction with, unrelated to another fact) or an operator's undo; who decided and why."""

    __tablename__ = "consolidation_decisions"
    __table_args__ = (
        CheckConstraint(_in("decision", DECISIONS), name="decision"),
        CheckConstraint(_in("decided_by", DECIDERS), name="decided_by"),
        Index("ix_consolidation_decisions_entity", "source_id", "entity_key"),
    )

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    job_id: Mapped[int | None] = mapped_column(ForeignKey("jobs.id", ondelete="SET NULL"), index=True)
    source_id: Mapped[str]
    entity_key: Mapped[str]
    # The fact decided about, and the other fact of the pair; an audit row outlives both (SET NULL).
    fact_id: Mapped[int | None] = mapped_column(
        BigInteger, ForeignKey("facts.id", ondelete="SET NULL"), index=True
    )
    other_fact_id: Mapped[int | None] = mapped_column(
        BigInteger, ForeignKey("facts.id", ondelete="SET NULL"), index=True
    )
    decision: Mapped[str]
    decided_by: Mapped[str]
    reason: Mapped[str]
    similarity: Mapped[float | None] = mapped_column(Float)
    # Indexed: deleting an llm_calls row (retention) finds the decisions naming it by this column.
    llm_call_id: Mapped[int | None] = mapped_column(
        ForeignKey("llm_calls.id", ondelete="SET NULL"), index=True
    )
    created_at: Mapped[datetime] = utcnow_column()


class ConsolidationCheckpoint(Base):
    """Where consolidation stands on one entity of a source: advanced, compare-and-set, in the
    transaction of every decision (as extraction's checkpoint is with every segment)."""

    __tablename__ = "consolidation_checkpoints"

    source_id: Mapped[str] = mapped_column(Text, primary_key=True)
    entity_key: Mapped[str] = mapped_column(Text, primary_key=True)
    facts_done: Mapped[int] = count_column()
    last_fact_id: Mapped[int | None] = mapped_column(BigInteger)
    updated_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now(), onupdate=func.now(), nullable=False
    )
