"""provider_copies: the provider batches whose files Factmill still owes a delete

Revision ID: 0028
Revises: 0027
Create Date: 2026-12-04

A batch's files at the provider hold the pages' text (an erased page's too) and the facts drawn from
it. They were deleted once the results were committed, and a delete that failed was only logged: the
copy stayed at the provider for good. Each owed delete is now a row, retried by beat's backfill poll.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "0028"
down_revision: str | None = "0027"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "provider_copies",
        sa.Column("id", sa.BigInteger(), nullable=False),
        sa.Column("provider", sa.Text(), nullable=False),
        sa.Column("batch_id", sa.Text(), nullable=False),
        sa.Column("attempts", sa.Integer(), server_default="0", nullable=False),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
        sa.Column("tried_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_provider_copies")),
        sa.UniqueConstraint("provider", "batch_id", name=op.f("uq_provider_copies_provider_batch_id")),
    )


def downgrade() -> None:
    # Each row is a provider batch whose files (the pages' text, maybe of pages since erased) are owed
    # a delete: dropped, they stayed at the provider for good, and nothing said so.
    # Locked first: a row a live worker adds between the count and the drop would go unsaid.
    op.execute("LOCK TABLE provider_copies IN EXCLUSIVE MODE")
    owed = op.get_bind().execute(sa.text("SELECT count(*) FROM provider_copies")).scalar_one()
    if owed:
        raise RuntimeError(
            f"{owed} provider batch(es) still owe their delete (provider_copies): run the maintenance "
            "sweep until none is left (or delete the rows knowingly), then downgrade"
        )
    op.drop_table("provider_copies")
