"""compactions: an index on previous_id, the one foreign key no index led

Revision ID: 0031
Revises: 0030
Create Date: 2026-12-05

compactions.previous_id points at the compaction whose summary a later one folded in, ON DELETE SET
NULL. Erasing a transcript deletes its compactions, and Postgres then looks for the rows pointing at
each one: without an index, a scan of the whole compactions table per compaction erased, inside the
erasure's transaction.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0031"
down_revision: str | None = "0030"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index(
        "ix_compactions_previous_id",
        "compactions",
        ["previous_id"],
        postgresql_where="previous_id IS NOT NULL",
    )


def downgrade() -> None:
    op.drop_index("ix_compactions_previous_id", table_name="compactions")
