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
from worker.db import MigrationRefusedError

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
    # A call of a million dollars or more (what the upgrade admits) overflowed the narrowing midway.
    op.execute("LOCK TABLE llm_calls IN EXCLUSIVE MODE")  # no call recorded between count and narrowing
    too_large = (
        op.get_bind()
        .execute(sa.text("SELECT count(*) FROM llm_calls WHERE abs(cost_usd) >= 1000000"))
        .scalar_one()
    )
    if too_large:
        raise MigrationRefusedError(
            f"{too_large} LLM call(s) cost $1,000,000 or more, past what the schema before 0026 holds: "
            "correct or delete them (llm_calls.cost_usd) before downgrading past 0026"
        )
    _cost_column(sa.Numeric(12, 6), sa.Numeric(18, 6))
