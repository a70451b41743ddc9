"""jobs: claimed_at, when a worker last took the job from a message

Revision ID: 0032
Revises: 0031
Create Date: 2026-12-05

The sweeper re-sent a queued job whose message was overdue only when its queue held fewer messages
than there were overdue jobs: a queue kept busy by newer work hid a lost message for as long as the
traffic lasted. A job claimed after its last send consumed that message; once a message sent after
an overdue job's has been consumed, the overdue job's (sent before it, FIFO) is gone. The column
starts empty (no claim since) and is indexed where set, for the sweeper's read of recent claims.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "0032"
down_revision: str | None = "0031"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("claimed_at", sa.DateTime(timezone=True), nullable=True))
    op.create_index(
        "ix_jobs_claimed_at", "jobs", ["claimed_at"], postgresql_where=sa.text("claimed_at IS NOT NULL")
    )


def downgrade() -> None:
    op.drop_index("ix_jobs_claimed_at", table_name="jobs")
    op.drop_column("jobs", "claimed_at")
