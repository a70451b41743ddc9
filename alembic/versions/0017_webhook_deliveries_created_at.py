"""webhook_deliveries: an index on created_at, for forgetting the answers kept past their window

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-03

Every delivery with an Idempotency-Key keeps its answer in webhook_deliveries, and nothing removed
them: the table grew by a row per keyed delivery for ever. The maintenance sweep now deletes the
answers older than FACTMILL_IDEMPOTENCY_KEY_HOURS (models.webhook.forget_deliveries), oldest first,
a batch at a time; this index finds them without reading the table.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_webhook_deliveries_created_at", "webhook_deliveries", ["created_at"])


def downgrade() -> None:
    op.drop_index("ix_webhook_deliveries_created_at", table_name="webhook_deliveries")
