"""compactions.head_capped: the run summarized only the part of the head that fit the summarizer

Revision ID: 0046
Revises: 0045
Create Date: 2026-12-07

A head too long for the summarizer's input is compacted in parts, each accepted part asking for the
next. When that next run found the agent's turn still in flight (its newest message a tool result) it
ended with nothing to compact, and the accepted part, which left the context over its threshold, read
as a summary that cannot fit: every append then waited FACTMILL_COMPACTION_RETRIGGER_SECONDS, told to
lower keep_recent_tokens. The column says a row was such a part, so no wait follows it. A constant
default: no table rewrite (Postgres 11+ keeps it in the catalog); existing rows read false.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "0046"
down_revision: str | None = "0045"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "compactions", sa.Column("head_capped", sa.Boolean(), nullable=False, server_default=sa.text("false"))
    )


def downgrade() -> None:
    op.drop_column("compactions", "head_capped")
