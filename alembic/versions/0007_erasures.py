"""erasures: one content-free row per erased page (DELETE /v1/pages/..., `factmill pages erase`)

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01

Also an index on op_checkpoints.page_key: erasure finds a page's checkpoints by page alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _count(name: str) -> sa.Column[int]:
    return sa.Column(name, sa.Integer(), server_default="0", nullable=False)


def upgrade() -> None:
    op.create_table(
        "erasures",
        sa.Column("id", sa.BigInteger(), nullable=False),
        sa.Column("source_id", sa.Text(), nullable=False),
        sa.Column("slug_sha256", sa.Text(), nullable=False),
        sa.Column("requested_by", sa.Text(), nullable=False),
        _count("facts_removed"),
        _count("embeddings_removed"),
        _count("checkpoints_removed"),
        _count("audit_rows_removed"),
        _count("jobs_cancelled"),
        sa.Column("erased_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_erasures")),
    )
    op.create_index(op.f("ix_erasures_slug_sha256"), "erasures", ["slug_sha256"])
    # Erasure and store_page look a page's checkpoints up by page_key alone (the key's last column).
    op.create_index(op.f("ix_op_checkpoints_page_key"), "op_checkpoints", ["page_key"])


def downgrade() -> None:
    op.drop_index(op.f("ix_op_checkpoints_page_key"), table_name="op_checkpoints")
    op.drop_index(op.f("ix_erasures_slug_sha256"), table_name="erasures")
    op.drop_table("erasures")
