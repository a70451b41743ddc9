"""Facts extracted from pages, the terminal audit rows among them, and per-segment audit rows."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

from sqlalchemy import (
    ARRAY,
    BigInteger,
    Boolean,
    CheckConstraint,
    Computed,
    Float,
    ForeignKey,
    Index,
    UniqueConstraint,
    any_,
    bindparam,
    select,
    text,
)
from sqlalchemy.dialects.postgresql import TSVECTOR
from sqlalchemy.orm import Mapped, Session, mapped_column

from models.base import Base, count_column, utcnow_column
from worker.core.consolidation import DUPLICATE, FACT_STATUSES, SUPERSEDED
from worker.core.facts import (  # owned by the pure core, which cannot import models
    FACT_KINDS,
    NOTABILITY_LEVELS,
)

SEGMENT_OUTCOMES = (
    "ok",
    "malformed_output",
    "truncated_output",
    "refusal",
    "provider_error",
    "budget_exhausted",
    # Not an attempt: the row that marks a poison segment skipped (worker.extraction.poison).
    "skipped",
)


# Search: what full-text search reads (fact text weighted A, entity B, segment context C), accents of
# the fact and entity folded and spaced by the SQL function search_words (search_fold's accents, a space
# around each CJK character; the context is the segment's ASCII time range); a generated column so
# ranking never re-parses rows. Keep in step with alembic/versions/0049_search_words_unspaced_scripts.py,
# which creates search_words (the drift test compares).
SEARCH_VECTOR_SQL = (
    "setweight(to_tsvector('simple'::regconfig, search_words(fact)), 'A') || "
    "setweight(to_tsvector('simple'::regconfig, search_words(COALESCE(entity_slug, ''))), 'B') || "
    "setweight(to_tsvector('simple'::regconfig, context), 'C')"
)


# Lifecycle: a fact marked duplicate or superseded whose link went (re-extraction or erasure deleted
# the fact it pointed to). Every extraction that commits facts asks for these, so they have a partial
# index of their own; the query states the same text so the planner can use it (a bound parameter in
# place of a status would hide the match from a generic plan). Keep in step with
# alembic/versions/0014_orphaned_links_index.py.
UNCONSOLIDATED_SQL = "consolidated_at IS NULL AND NOT is_audit"
# Keep in step with alembic/versions/0042_unembedded_facts_index.py.
UNEMBEDDED_SQL = "embedding IS NULL AND NOT is_audit"
ORPHANED_LINK_SQL = (
    f"(status = '{SUPERSEDED}' AND superseded_by IS NULL) OR "
    f"(status = '{DUPLICATE}' AND duplicate_of IS NULL)"
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
        CheckConstraint(_in("status", FACT_STATUSES), name="status"),
        Index("ix_facts_source_session", "source_session"),
        # Lifecycle: a consolidation job reads one entity's facts of one source.
        Index("ix_facts_source_id_entity", "source_id", "entity_slug"),
        # An entity's facts in the order they are listed (newest first, by a cursor); entity lookups too.
        Index("ix_facts_entity_timeline", "entity_slug", "valid_from", "id"),
        Index("ix_facts_orphaned_links", "source_id", postgresql_where=text(ORPHANED_LINK_SQL)),
        Index("ix_facts_search_vector", "search_vector", postgresql_using="gin"),  # Search
        # The sweep's catch-up of consolidation requests that were lost (worker.consolidation).
        Index("ix_facts_unconsolidated", "created_at", postgresql_where=text(UNCONSOLIDATED_SQL)),
        # The sweep's catch-up of vectors a follow-up left out (worker.extraction.job).
        Index("ix_facts_unembedded", "created_at", postgresql_where=text(UNEMBEDDED_SQL)),
    )

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    source_id: Mapped[str]
    fact: Mapped[str]
    kind: Mapped[str]
    entity_slug: Mapped[str | None]
    confidence: Mapped[float]
    notability: Mapped[str]
    context: Mapped[str] = mapped_column(server_default="")
    valid_from: Mapped[datetime | None]
    source: Mapped[str]
    source_session: Mapped[str]
    source_markdown_slug: Mapped[str]
    row_num: Mapped[int]
    is_audit: Mapped[bool] = mapped_column(Boolean, nullable=False, server_default="false")
    claim_metric: Mapped[str | None]
    claim_value: Mapped[float | None]
    claim_unit: Mapped[str | None]
    claim_period: Mapped[str | None]
    # Filled by the embedding backfill once search lands; a float array keeps the first schema free
    # of the pgvector extension, which not every server has.
    embedding: Mapped[list[float] | None] = mapped_column(ARRAY(Float), nullable=True)
    # The model that made it: a search compares a query only with vectors of its own model (empty:
    # made before models were kept, compared with any).
    embedding_model: Mapped[str | None]
    # Search: generated by Postgres, never written; deferred so loading facts does not fetch it.
    search_vector: Mapped[str | None] = mapped_column(
        TSVECTOR, Computed(SEARCH_VECTOR_SQL, persisted=True), nullable=True, deferred=True
    )
    created_at: Mapped[datetime] = utcnow_column()
    # Lifecycle (worker.consolidation): consolidation never deletes a fact, it closes or links it.
    # valid_to: when it stopped being true (set when a later fact superseded it); status current |
    # superseded | duplicate; the links to the fact that superseded it or that it repeats.
    valid_to: Mapped[datetime | None]
    status: Mapped[str] = mapped_column(server_default="current")
    superseded_by: Mapped[int | None] = mapped_column(
        BigInteger, ForeignKey("facts.id", ondelete="SET NULL"), index=True
    )
    duplicate_of: Mapped[int | None] = mapped_column(
        BigInteger, ForeignKey("facts.id", ondelete="SET NULL"), index=True
    )
    # When its consolidation decision committed (NULL: not yet consolidated; the job's work list).
    consolidated_at: Mapped[datetime | None]


class ExtractionAudit(Base):
    """One row per segment attempt: what was asked, what came back, how it ended."""

    __tablename__ = "extraction_audit"
    __table_args__ = (
        CheckConstraint(_in("outcome", SEGMENT_OUTCOMES), name="outcome"),
        Index("ix_extraction_audit_page", "source_id", "page_slug"),
        # FACTMILL_LEDGER_RETENTION_DAYS deletes the oldest rows first (models.llm_call.expire_ledger).
        Index("ix_extraction_audit_created_at", "created_at"),
    )

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    job_id: Mapped[int | None] = mapped_column(ForeignKey("jobs.id", ondelete="SET NULL"), index=True)
    source_id: Mapped[str]
    page_slug: Mapped[str]
    segment_index: Mapped[int]
    segment_start: Mapped[str]
    segment_end: Mapped[str]
    attempt: Mapped[int] = mapped_column(server_default="1")
    outcome: Mapped[str]
    facts_count: Mapped[int] = count_column()
    error: Mapped[str | None]
    # The segment's messages digested (worker.core.checkpoint.segment_hash): its identity across runs.
    segment_hash: Mapped[str | None]
    # This attempt ended its segment's try with a permanent failure (a refusal, malformed after the
    # repair turn, truncated after the retry, a rejected request): counted towards the skip.
    permanent: Mapped[bool] = mapped_column(Boolean, nullable=False, server_default="false")
    # What the model said on a failed attempt (capped), for whoever reads why a segment was skipped.
    reply: Mapped[str | None]
    # Indexed: deleting an llm_calls row (retention) finds the rows naming it by this column.
    llm_call_id: Mapped[int | None] = mapped_column(
        ForeignKey("llm_calls.id", ondelete="SET NULL"), index=True
    )
    created_at: Mapped[datetime] = utcnow_column()


def existing_fact_ids(session: Session, fact_ids: Iterable[int]) -> set[int]:
    """Which of ``fact_ids`` still exist: an erasure or a re-extraction removes facts under a run, and
    their text goes to no provider after the erasure returned (consolidation's and embedding's asks)."""
    wanted = sorted(set(fact_ids))
    if not wanted:
        return set()
    ids = bindparam("ids", wanted, type_=ARRAY(BigInteger))
    return set(session.scalars(select(Fact.id).where(Fact.id == any_(ids))))
