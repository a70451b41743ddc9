"""jobs: an index on a page job's source and id, for a source-limited key's job list

Revision ID: 0023
Revises: 0022
Create Date: 2026-12-04

`GET /v1/jobs` for a key limited to some sources keeps the page jobs whose subject (`source|slug`)
names one of them, newest first. Nothing indexed the source: the list read the table backwards until
it had found its page, so a source with few jobs, or none, read every job (312 and 263 ms at a million
jobs; bench/job_list.py). This partial index on the subject's source and the id answers it by the
source's own jobs.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "0023"
down_revision: str | None = "0022"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index(
        "ix_jobs_page_source",
        "jobs",
        [sa.text("split_part(subject, '|', 1)"), sa.text("id")],
        postgresql_where=sa.text("kind = 'extraction'"),
    )


def downgrade() -> None:
    op.drop_index("ix_jobs_page_source", table_name="jobs")
