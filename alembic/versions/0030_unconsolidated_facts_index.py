"""facts: an index of the facts not yet consolidated, by when they were stored

Revision ID: 0030
Revises: 0029
Create Date: 2026-12-04

The maintenance sweep now requests consolidation for facts whose request was lost (an extraction's
follow-up thread dies with its worker: a deploy, a scale-in, an OOM kill). It reads the unconsolidated
facts of the last day, oldest first; without this index that read scanned every fact each sweep.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "0030"
down_revision: str | None = "0029"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

UNCONSOLIDATED = "consolidated_at IS NULL AND NOT is_audit"  # = models.fact.UNCONSOLIDATED_SQL


def upgrade() -> None:
    op.create_index(
        "ix_facts_unconsolidated", "facts", ["created_at"], postgresql_where=sa.text(UNCONSOLIDATED)
    )


def downgrade() -> None:
    op.drop_index("ix_facts_unconsolidated", table_name="facts")
