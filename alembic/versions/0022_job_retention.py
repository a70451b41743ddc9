"""jobs: an index on finished jobs by finished_at, for the retention the sweeper applies

Revision ID: 0022
Revises: 0021
Create Date: 2026-12-04

Every page delivery, compaction and recompute leaves a job row, and nothing removed them: the table
grew by a row per delivery for ever. With FACTMILL_JOB_RETENTION_DAYS set, the maintenance sweep
deletes the jobs that finished longer ago than that, oldest first, a batch at a time
(models.job.expire_jobs). The partial index finds them without reading the table; the index on
calibration_thresholds.job_id answers the foreign key's check when a job goes (without it, each
deleted job read the whole table).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "0022"
down_revision: str | None = "0021"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index(
        "ix_jobs_finished_at",
        "jobs",
        ["finished_at"],
        postgresql_where=sa.text("status IN ('succeeded', 'failed')"),
    )
    op.create_index("ix_calibration_thresholds_job_id", "calibration_thresholds", ["job_id"])


def downgrade() -> None:
    op.drop_index("ix_calibration_thresholds_job_id", table_name="calibration_thresholds")
    op.drop_index("ix_jobs_finished_at", table_name="jobs")
