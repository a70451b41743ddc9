"""backfill_batches.limit_failures: how often the provider failed a batch whole for its queued-token limit

Revision ID: 0045
Revises: 0044
Create Date: 2026-12-07

OpenAI fails a whole batch ("token_limit_exceeded", none of its requests run) when the organisation's
queued tokens would pass its limit. Such a batch is planned again and sent again alone; a batch over the
limit by itself was sent again every ten minutes for good, uploading the pages' text each time. The
count bounds that (worker.extraction.backfill_limits). A constant default: no table rewrite.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "0045"
down_revision: str | None = "0044"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "backfill_batches", sa.Column("limit_failures", sa.Integer(), server_default="0", nullable=False)
    )


def downgrade() -> None:
    op.drop_column("backfill_batches", "limit_failures")
