"""llm_calls.cost_usd: numeric(18, 6), as the spend tables keep it

Revision ID: 0026
Revises: 0025
Create Date: 2026-12-04

numeric(12, 6) holds under a million dollars a call; a provider reporting a huge token count at a high
price overflowed it, and the segment's transaction (facts, audit, checkpoint) failed at every retry.
Widening a numeric's precision at the same scale changes no stored value, so Postgres rewrites nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "0026"
down_revision: str | None = "0025"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _cost_column(new: sa.Numeric, old: sa.Numeric) -> None:
    op.alter_column(
        "llm_calls",
        "cost_usd",
        type_=new,
        existing_type=old,
        existing_nullable=False,
        existing_server_default="0",
    )


def upgrade() -> None:
    _cost_column(sa.Numeric(18, 6), sa.Numeric(12, 6))


def downgrade() -> None:
    _cost_column(sa.Numeric(12, 6), sa.Numeric(18, 6))
