"""jobs.budget_since: where a job's own LLM budget counts from

Revision ID: 0035
Revises: 0034
Create Date: 2026-12-05

A job's own budget (llm.budget_job_usd) summed every call of the job since its creation, and a rerun
for new content reuses the job: a page whose job paused for its own budget was frozen for good (each
later delivery merged into the paused job, an operator's retry paused again at once). The budget now
counts from budget_since, moved on when a rerun or a retry starts the job's budgets over. The jobs
there were keep it empty: they count from their creation, as before.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "0035"
down_revision: str | None = "0034"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Added empty (no table rewrite, however many finished jobs are kept): empty means "since its
    # creation", as before; new jobs get now().
    op.add_column("jobs", sa.Column("budget_since", sa.DateTime(timezone=True), nullable=True))
    op.alter_column("jobs", "budget_since", server_default=sa.func.now())


def downgrade() -> None:
    op.drop_column("jobs", "budget_since")
