"""facts: an index of the facts still without an embedding, by when they were stored

Revision ID: 0042
Revises: 0041
Create Date: 2026-12-07

The maintenance sweep now embeds the facts an extraction's embedding follow-up left without a vector
(the day's budget spent, the embedding model down, the worker gone): only `factmill embed` filled them
in, and until then vector search never found them. It reads the recent ones, oldest first; without this
index that read scanned every fact each sweep. Built CONCURRENTLY: facts is written by every segment.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op
from worker.index_builds import building_concurrently, create_index_concurrently

revision: str = "0042"
down_revision: str | None = "0041"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

UNEMBEDDED = "embedding IS NULL AND NOT is_audit"  # = models.fact.UNEMBEDDED_SQL


def upgrade() -> None:
    with building_concurrently(op):
        create_index_concurrently(op, "ix_facts_unembedded", f"ON facts (created_at) WHERE {UNEMBEDDED}")


def downgrade() -> None:
    with building_concurrently(op):
        op.execute("DROP INDEX CONCURRENTLY IF EXISTS ix_facts_unembedded")
