"""webhook_deliveries: keep the digest of each delivery's key, never the key a sender chose

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-03

A sender's Idempotency-Key is theirs to choose and may name a person (``alice-chat-2024-03-15``);
erasing a page cannot know which keys do. The service now stores sha256 (hex) of the scoped key
(route|subject|key, worker.api.deliveries.scoped_key) and looks answers up by it. This turns the keys
already kept into their digests, so a delivery repeated across the upgrade is still replayed. The
table holds a week of keys at most (FACTMILL_IDEMPOTENCY_KEY_HOURS). There is no way back to the
clear keys, so the downgrade leaves the digests (an older service then treats a repeat as new).
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0020"
down_revision: str | None = "0019"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # A digest is 64 hex characters; a clear scoped key always holds '|', so no row is hashed twice.
    op.execute(
        "UPDATE webhook_deliveries "
        "SET idempotency_key = encode(sha256(convert_to(idempotency_key, 'UTF8')), 'hex') "
        "WHERE idempotency_key LIKE '%|%'"
    )


def downgrade() -> None:
    pass
