"""llm_spend_days: each UTC day's LLM spend per budget scope, kept by the ledger with every llm_calls row

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-02

The day budget summed the day's llm_calls rows once a second in every worker: 173 ms at a million
calls (bench/budget.py). The ledger now adds each call's cost to this table in the statement that
inserts the call (a row per day, scope and writing backend, so commits never wait on one counter
row), and the budget reads a few rows. Existing days are filled from llm_calls here, as backend 0.
The scope rule is worker.accounting.budget.SEARCH_PURPOSES, written out here as migrations do not
import the application.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "llm_spend_days",
        sa.Column("day", sa.Date(), nullable=False),
        sa.Column("scope", sa.Text(), nullable=False),
        sa.Column("backend", sa.Integer(), nullable=False),
        sa.Column("cost_usd", sa.Numeric(18, 6), server_default="0", nullable=False),
        sa.CheckConstraint("scope IN ('work', 'search')", name=op.f("ck_llm_spend_days_scope")),
        sa.PrimaryKeyConstraint("day", "scope", "backend", name=op.f("pk_llm_spend_days")),
    )
    op.execute(
        """
        INSERT INTO llm_spend_days (day, scope, backend, cost_usd)
        SELECT (created_at AT TIME ZONE 'UTC')::date,
               CASE WHEN purpose IN ('search_expansion', 'search_embedding') THEN 'search' ELSE 'work' END,
               0,
               sum(cost_usd)
        FROM llm_calls
        WHERE cost_usd > 0
        GROUP BY 1, 2
        """
    )


def downgrade() -> None:
    op.drop_table("llm_spend_days")
