"""backfill_requests: an index on page_id, for an erasure to find a page's requests

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-03

A backfill keeps one row per planned segment request, with its page's slug. Erasing a page now takes
the slug out of them too (worker.extraction.erase), as it does from the page's jobs; this index finds
a page's requests without reading the table.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0018"
down_revision: str | None = "0017"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_backfill_requests_page_id", "backfill_requests", ["page_id"])


def downgrade() -> None:
    op.drop_index("ix_backfill_requests_page_id", table_name="backfill_requests")
