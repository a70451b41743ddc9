"""webhook_deliveries: a GIN index on the kept answers, for an erasure to find those naming its page

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-03

A keyed page delivery's answer is kept a week and lists each page by source and slug. Erasing a page
now takes its slug out of those answers (models.webhook.forget_page_in_deliveries). Without an index
that reads every answer kept (1.2 s at a million, in an UPDATE, which Postgres never runs in
parallel); with this one it takes milliseconds, for about 10 microseconds more a delivery
(bench/forget_deliveries.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0019"
down_revision: str | None = "0018"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index(
        "ix_webhook_deliveries_response",
        "webhook_deliveries",
        ["response"],
        postgresql_using="gin",
        postgresql_ops={"response": "jsonb_path_ops"},
    )


def downgrade() -> None:
    op.drop_index("ix_webhook_deliveries_response", table_name="webhook_deliveries")
