"""llm_calls.batch: the call was billed through a provider batch (OpenAI Batch API, Anthropic Message
Batches) at the batch discount, so reports can split batch from online spend

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-01

Existing rows are online calls (false): before this revision a batch call was told apart only by its
halved cost, which reports cannot read back.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("llm_calls", sa.Column("batch", sa.Boolean(), nullable=False, server_default="false"))


def downgrade() -> None:
    op.drop_column("llm_calls", "batch")
