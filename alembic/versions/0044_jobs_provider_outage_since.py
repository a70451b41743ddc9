"""jobs.provider_outage_since: when the LLM provider last stopped serving a job (the outage clock)

Revision ID: 0044
Revises: 0043
Create Date: 2026-12-07

A provider outage (429/5xx past the retry layer, unreachable, or the account's money spent) was a
worker loss: with 20 losses and backoffs of up to 5 minutes, an outage of about three quarters of an
hour failed every job in flight for good, each then needing an operator's retry, and an outage's
requeues counted as the crash loops the loss budget is there to stop. An outage now spends neither
budget: the job waits it out, and fails only once the provider has served it nothing for
FACTMILL_JOB_PROVIDER_OUTAGE_PATIENCE_SECONDS (a day by default). The column holds when that clock
started; empty while the provider serves the job. A column without a default: no table rewrite.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "0044"
down_revision: str | None = "0043"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("provider_outage_since", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    op.drop_column("jobs", "provider_outage_since")
