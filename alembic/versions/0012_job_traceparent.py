"""jobs.traceparent: the W3C trace context of the request that created the job

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-01

Set only while tracing is on (FACTMILL_OTEL_ENDPOINT). A job the sweeper re-sends is sent inside this
context, so its Celery task joins the trace of the webhook that asked for it. Existing rows get none.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("traceparent", sa.Text(), nullable=True))


def downgrade() -> None:
    op.drop_column("jobs", "traceparent")
