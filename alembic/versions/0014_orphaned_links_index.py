"""facts: a partial index on the facts whose lifecycle link went (orphaned duplicates/supersessions)

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-01

Every extraction that commits facts asks which of its source's facts lost the fact they were linked
to; without this index that read scanned every fact of the source once per page (found by a py-spy
profile of bench/pipeline.py). The predicate is models.fact.ORPHANED_LINK_SQL, written out here as
migrations do not import the models.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ORPHANED_LINK_SQL = (
    "(status = 'superseded' AND superseded_by IS NULL) OR (status = 'duplicate' AND duplicate_of IS NULL)"
)


def upgrade() -> None:
    op.create_index(
        "ix_facts_orphaned_links", "facts", ["source_id"], postgresql_where=sa.text(ORPHANED_LINK_SQL)
    )


def downgrade() -> None:
    op.drop_index("ix_facts_orphaned_links", table_name="facts")
