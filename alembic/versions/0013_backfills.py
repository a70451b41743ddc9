"""backfills: a batch extraction job's provider batches and their requests, stored before sending

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "backfills",
        sa.Column("id", sa.BigInteger(), nullable=False),
        sa.Column("source_id", sa.Text(), nullable=False),
        sa.Column("filters", postgresql.JSONB(astext_type=sa.Text()), server_default="{}", nullable=False),
        sa.Column("status", sa.Text(), server_default="planning", nullable=False),
        sa.Column("cancel_requested", sa.Boolean(), server_default="false", nullable=False),
        sa.Column("job_id", sa.BigInteger(), nullable=True),
        sa.Column("created_by", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint(
            "status IN ('planning', 'running', 'done', 'cancelled')", name=op.f("ck_backfills_status")
        ),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_backfills_job_id_jobs"), ondelete="SET NULL"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_backfills")),
    )
    op.create_index(op.f("ix_backfills_job_id"), "backfills", ["job_id"], unique=False)
    op.create_table(
        "backfill_batches",
        sa.Column("id", sa.BigInteger(), nullable=False),
        sa.Column("backfill_id", sa.BigInteger(), nullable=False),
        sa.Column("key", sa.Text(), nullable=False),
        sa.Column("provider", sa.Text(), nullable=False),
        sa.Column("model", sa.Text(), nullable=False),
        sa.Column("provider_batch_id", sa.Text(), nullable=True),
        sa.Column("status", sa.Text(), server_default="planned", nullable=False),
        sa.Column("provider_status", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("submit_started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("submitted_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("collected_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint(
            "status IN ('planned', 'submitting', 'submitted', 'collected', 'cancelled')",
            name=op.f("ck_backfill_batches_status"),
        ),
        sa.ForeignKeyConstraint(
            ["backfill_id"],
            ["backfills.id"],
            name=op.f("fk_backfill_batches_backfill_id_backfills"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_backfill_batches")),
        sa.UniqueConstraint("key", name=op.f("uq_backfill_batches_key")),
        sa.UniqueConstraint("provider_batch_id", name=op.f("uq_backfill_batches_provider_batch_id")),
    )
    op.create_index(
        op.f("ix_backfill_batches_backfill_id"), "backfill_batches", ["backfill_id"], unique=False
    )
    op.create_table(
        "backfill_requests",
        sa.Column("id", sa.BigInteger(), nullable=False),
        sa.Column("batch_id", sa.BigInteger(), nullable=False),
        sa.Column("custom_id", sa.Text(), nullable=False),
        sa.Column("page_id", sa.BigInteger(), nullable=False),
        sa.Column("slug", sa.Text(), nullable=False),
        sa.Column("end_message", sa.Integer(), nullable=False),
        sa.Column("segment_hash", sa.Text(), nullable=False),
        sa.Column("status", sa.Text(), server_default="pending", nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.CheckConstraint(
            "status IN ('pending', 'done', 'failed', 'discarded', 'expired', 'cancelled', 'dropped')",
            name=op.f("ck_backfill_requests_status"),
        ),
        sa.ForeignKeyConstraint(
            ["batch_id"],
            ["backfill_batches.id"],
            name=op.f("fk_backfill_requests_batch_id_backfill_batches"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_backfill_requests")),
        sa.UniqueConstraint("batch_id", "custom_id", name=op.f("uq_backfill_requests_batch_id_custom_id")),
    )
    op.create_index(
        "ix_backfill_requests_batch_id_status", "backfill_requests", ["batch_id", "status"], unique=False
    )


def downgrade() -> None:
    # A batch sent (or being sent) is at the provider with the pages' text: dropped, nothing would collect
    # its paid results or owe its delete. Locked first: a batch a live worker sends meanwhile would go
    # unsaid (as 0028's downgrade refuses while provider copies are owed).
    op.execute("LOCK TABLE backfill_batches IN EXCLUSIVE MODE")
    held = (
        op.get_bind()
        .execute(sa.text("SELECT count(*) FROM backfill_batches WHERE status IN ('submitting', 'submitted')"))
        .scalar_one()
    )
    if held:
        raise RuntimeError(
            f"{held} provider batch(es) of backfills are still at the provider: let the backfills collect "
            "them (or cancel them with `factmill backfill cancel`), then downgrade"
        )
    op.drop_index("ix_backfill_requests_batch_id_status", table_name="backfill_requests")
    op.drop_table("backfill_requests")
    op.drop_index(op.f("ix_backfill_batches_backfill_id"), table_name="backfill_batches")
    op.drop_table("backfill_batches")
    op.drop_index(op.f("ix_backfills_job_id"), table_name="backfills")
    op.drop_table("backfills")
