"""backfill_batches.estimated_cost_usd: what a batch sent may cost, until its results are collected

Revision ID: 0029
Revises: 0028
Create Date: 2026-12-04

A batch's spend is recorded when its results are collected, hours after it was sent, so a backfill pass
that sent ten batches checked the budget against $0 spent ten times. Each batch now keeps the estimate
it was sent with (its prompt characters / 4 and its output caps, at the batch price); the batches in
flight count against the budget until their spend is known.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "0029"
down_revision: str | None = "0028"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("backfill_batches", sa.Column("estimated_cost_usd", sa.Numeric(18, 6), nullable=True))


def downgrade() -> None:
    op.drop_column("backfill_batches", "estimated_cost_usd")
