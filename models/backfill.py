"""Backfills: a batch extraction job's provider batches and their requests, stored before any is sent."""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    ColumnElement,
    ForeignKey,
    Index,
    Numeric,
    Text,
    UniqueConstraint,
    case,
    cast,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.ext.hybrid import hybrid_property
from sqlalchemy.orm import Mapped, mapped_column

from models.base import Base, count_column, utcnow_column

# planning: the job has not stored its batches yet; running: batches stored (some may be unsent or
# in flight); done / cancelled: every batch ended and was collected (or never went out).
BACKFILL_STATUSES = ("planning", "running", "done", "cancelled")
# planned: stored, never sent; submitting: a send began (the provider may hold it: look it up by key
# before sending again); submitted: the provider's id is stored; collected: its results are committed;
# cancelled: never sent (the backfill was cancelled first).
BATCH_STATUSES = ("planned", "submitting", "submitted", "collected", "cancelled")
# pending: waiting for its result; done / failed: its result was recorded (an llm_calls row) and
# committed through the segment transaction (failed: the reply was unusable); discarded: paid for but
# its page had moved on (edited, or an earlier segment did not complete); expired / cancelled: the
# batch ended without running it (the next run extracts it); dropped: its page changed before the
# batch was sent, so it was never sent.
REQUEST_STATUSES = ("pending", "done", "failed", "discarded", "expired", "cancelled", "dropped")


def _in(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


class Backfill(Base):
    __tablename__ = "backfills"
    __table_args__ = (CheckConstraint(_in("status", BACKFILL_STATUSES), name="status"),)

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    source_id: Mapped[str]
    # The selection as asked: since (ISO), slug_prefix, max_segments.
    filters: Mapped[dict[str, Any]] = mapped_column(JSONB, nullable=False, server_default="{}")
    status: Mapped[str] = mapped_column(server_default="planning")
    cancel_requested: Mapped[bool] = mapped_column(Boolean, nullable=False, server_default="false")
    # Selected pages left to an overlapping backfill that had requests out for them (planned or sent).
    pages_left_to_others: Mapped[int] = count_column()
    job_id: Mapped[int | None] = mapped_column(ForeignKey("jobs.id", ondelete="SET NULL"), index=True)
    created_by: Mapped[str | None]
    created_at: Mapped[datetime] = utcnow_column()
    finished_at: Mapped[datetime | None]


class BackfillBatch(Base):
    __tablename__ = "backfill_batches"
    __table_args__ = (CheckConstraint(_in("status", BATCH_STATUSES), name="status"),)

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    backfill_id: Mapped[int] = mapped_column(ForeignKey("backfills.id", ondelete="CASCADE"), index=True)
    # Unique across backfills; every request's custom id starts with it, and OpenAI batches carry it
    # in their metadata, so a send whose answer was lost is found at the provider, never sent again.
    key: Mapped[str] = mapped_column(unique=True)
    provider: Mapped[str]
    model: Mapped[str]
    provider_batch_id: Mapped[str | None] = mapped_column(unique=True)
    status: Mapped[str] = mapped_column(server_default="planned")
    provider_status: Mapped[str | None]
    created_at: Mapped[datetime] = utcnow_column()
    submit_started_at: Mapped[datetime | None]
    submitted_at: Mapped[datetime | None]
    collected_at: Mapped[datetime | None]
    # What it may cost (prompt characters / 4 and the output caps, at the batch price), set when it is
    # sent: counted against the budgets while it is in flight, as its spend is known only once collected.
    estimated_cost_usd: Mapped[Decimal | None] = mapped_column(Numeric(18, 6))
    # How often the provider failed it whole for its queued-token limit (it is then sent again, alone;
    # past worker.extraction.backfill_limits.MAX_LIMIT_FAILURES it is collected as failed).
    limit_failures: Mapped[int] = count_column()

    @hybrid_property
    def send_key(self) -> str:
        """The key its present copy is sent and looked up under: its key, then with the copy's number
        (``.2``, ``.3``) once the provider failed a copy for its queued-token limit, which OpenAI keeps
        listed under the key it was sent with: looked up by the key alone, a resend whose sender died
        was taken for that failed copy (counted as failing again, never sent). Request custom ids keep
        the key alone."""
        return f"{self.key}.{self.limit_failures + 1}" if self.limit_failures else self.key

    @send_key.inplace.expression
    @classmethod
    def _send_key(cls) -> ColumnElement[str]:
        copy = cls.key + "." + cast(cls.limit_failures + 1, Text)
        return case((cls.limit_failures > 0, copy), else_=cls.key)


class BackfillRequest(Base):
    __tablename__ = "backfill_requests"
    __table_args__ = (
        CheckConstraint(_in("status", REQUEST_STATUSES), name="status"),
        UniqueConstraint("batch_id", "custom_id"),
        Index("ix_backfill_requests_batch_id_status", "batch_id", "status"),
        Index("ix_backfill_requests_page_id", "page_id"),  # an erasure finds the page's requests
    )

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    batch_id: Mapped[int] = mapped_column(ForeignKey("backfill_batches.id", ondelete="CASCADE"))
    custom_id: Mapped[str]
    page_id: Mapped[int] = mapped_column(BigInteger)
    slug: Mapped[str]
    end_message: Mapped[
        int
    ]  # the message index just past the segment (where its commit moves the checkpoint)
    segment_hash: Mapped[str]  # the segment's messages as planned: a result commits only onto the same
    status: Mapped[str] = mapped_column(server_default="pending")
    updated_at: Mapped[datetime] = utcnow_column()


class ProviderCopy(Base):
    """A provider batch whose copy (its files: page text and the facts drawn from it) Factmill owes a
    delete: the delete after its results were committed failed, or the batch had not ended when its
    run gave up on it. Beat's backfill poll deletes it once the batch has ended, then drops the row."""

    __tablename__ = "provider_copies"
    __table_args__ = (UniqueConstraint("provider", "batch_id"),)

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    provider: Mapped[str]  # the FACTMILL_LLM that sent it: openai, anthropic, simulator
    batch_id: Mapped[str]  # the provider's batch id
    attempts: Mapped[int] = count_column()  # deletes tried by the poll (none yet: 0)
    last_error: Mapped[str | None]
    created_at: Mapped[datetime] = utcnow_column()
    tried_at: Mapped[datetime] = utcnow_column()  # the poll tries again once this is old enough
