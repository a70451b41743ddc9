"""Facts extracted from pages, the terminal audit rows among them, and per-segment audit rows."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import (
    ARRAY,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import Mapped, mapped_column

from models.base import Base, utcnow_column

FACT_KINDS = ("event", "preference", "commitment", "belief", "fact")
NOTABILITY_LEVELS = ("high", "medium", "low")
SEGMENT_OUTCOMES = (
    "ok",
    "malformed_output",
    "truncated_output",
    "refusal",
    "provider_error",
    "budget_exhausted",
)


def _in(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


class Fact(Base):
    __tablename__ = "facts"
    __table_args__ = (
        UniqueConstraint("source_id", "source_markdown_slug", "row_num"),
        CheckConstraint(_in("kind", FACT_KINDS), name="kind"),
        CheckConstraint(_in("notability", NOTABILITY_LEVELS), name="notability"),
        CheckConstraint("confidence >= 0 AND confidence <= 1", name="confidence"),
        # Audit rows (the terminal EXTRACTION_COMPLETE marker) take negative row numbers so they never
        # collide with a page's facts; search filters them out with is_audit.
        CheckConstraint(
            "(is_audit AND row_num < 0) OR (NOT is_audit AND row_num >= 0)", name="audit_row_num"
        ),
        Index("ix_facts_source_session", "source_session"),
        Index("ix_facts_entity_slug", "entity_slug"),
    )

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    source_id: Mapped[str] = mapped_column(Text, nullable=False)
    fact: Mapped[str] = mapped_column(Text, nullable=False)
    kind: Mapped[str] = mapped_column(Text, nullable=False)
    entity_slug: Mapped[str | None] = mapped_column(Text)
    confidence: Mapped[float] = mapped_column(Float, nullable=False)
    notability: Mapped[str] = mapped_column(Text, nullable=False)
    context: Mapped[str] = mapped_column(Text, nullable=False, server_default="")
    valid_from: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    source: Mapped[str] = mapped_column(Text, nullable=False)
    source_session: Mapped[str] = mapped_column(Text, nullable=False)
    source_markdown_slug: Mapped[str] = mapped_column(Text, nullable=False)
    row_num: Mapped[int] = mapped_column(Integer, nullable=False)
    is_audit: Mapped[bool] = mapped_column(Boolean, nullable=False, server_default="false")
    claim_metric: Mapped[str | None] = mapped_column(Text)
    claim_value: Mapped[float | None] = mapped_column(Float)
    claim_unit: Mapped[str | None] = mapped_column(Text)
    claim_period: Mapped[str | None] = mapped_column(Text)
    # Filled by the embedding backfill once search lands; a float array keeps the first schema free
    # of the pgvector extension, which not every server has.
    embedding: Mapped[list[float] | None] = mapped_column(ARRAY(Float), nullable=True)
    created_at: Mapped[datetime] = utcnow_column()


class ExtractionAudit(Base):
    """One row per segment attempt: what was asked, what came back, how it ended."""

    __tablename__ = "extraction_audit"
    __table_args__ = (
        CheckConstraint(_in("outcome", SEGMENT_OUTCOMES), name="outcome"),
        Index("ix_extraction_audit_page", "source_id", "page_slug"),
    )

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    job_id: Mapped[int | None] = mapped_column(ForeignKey("jobs.id", ondelete="SET NULL"), index=True)
    source_id: Mapped[str] = mapped_column(Text, nullable=False)
    page_slug: Mapped[str] = mapped_column(Text, nullable=False)
    segment_index: Mapped[int] = mapped_column(Integer, nullable=False)
    segment_start: Mapped[str] = mapped_column(Text, nullable=False)
    segment_end: Mapped[str] = mapped_column(Text, nullable=False)
    attempt: Mapped[int] = mapped_column(Integer, nullable=False, server_default="1")
    outcome: Mapped[str] = mapped_column(Text, nullable=False)
    facts_count: Mapped[int] = mapped_column(Integer, nullable=False, server_default="0")
    error: Mapped[str | None] = mapped_column(Text)
    llm_call_id: Mapped[int | None] = mapped_column(ForeignKey("llm_calls.id", ondelete="SET NULL"))
    created_at: Mapped[datetime] = utcnow_column()
