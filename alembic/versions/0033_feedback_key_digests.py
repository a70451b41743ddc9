"""calibration_observations: idempotency keys kept as digests of their sender and key

Revision ID: 0033
Revises: 0032
Create Date: 2026-12-05

A feedback submission's Idempotency-Key was kept as sent ("key:<the key>") and scoped by nothing: two
senders (two API keys: two tenants) sending the same key collided, one's observation dropped as the
other's duplicate; and a key a client chose may name a person. The key is now kept as sha256 of
(sender, key) (worker.core.calibration.idempotency_dedupe_key); the keys kept before are rewritten as
the operator's own (sender ""), so a signed sender's replay of one still finds it.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "0033"
down_revision: str | None = "0032"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.execute(
        sa.text(
            "UPDATE calibration_observations "
            "SET dedupe_key = 'key:' "
            "|| encode(sha256(convert_to(chr(31) || substr(dedupe_key, 5), 'UTF8')), 'hex') "
            "WHERE dedupe_key LIKE 'key:%'"  # each kept as sent until now (a client's may be 64 hex)
        )
    )


def downgrade() -> None:
    pass  # the keys as sent are gone; the digests still deduplicate what they did
