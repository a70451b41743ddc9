"""jobs.worker_losses: a job's second budget (runs its worker never finished)

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01

``attempts`` now counts only runs that reached a verdict of their own; a lost worker (SIGKILL, OOM,
a stale lease, the database going away) counts here instead. Existing rows start at 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("worker_losses", sa.Integer(), server_default="0", nullable=False))


def downgrade() -> None:
    op.drop_column("jobs", "worker_losses")
