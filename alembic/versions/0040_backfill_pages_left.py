"""backfills.pages_left_to_others: the selected pages a backfill left to an overlapping one

Revision ID: 0040
Revises: 0039
Create Date: 2026-12-06

A backfill leaves the pages another backfill still has requests out for to that one (two overlapping
backfills paid for the same segments twice). It said so only in a worker's log line: its report said
"done" with no count of the pages it left, and cancelling the other left them unextracted. The count is
stored with its plan and shown with its report. Backfills planned before keep 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "0040"
down_revision: str | None = "0039"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "backfills",
        sa.Column("pages_left_to_others", sa.Integer(), nullable=False, server_default="0"),
    )


def downgrade() -> None:
    op.drop_column("backfills", "pages_left_to_others")
