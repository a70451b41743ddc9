"""Two lists in the order they are read: transcripts by last change, a subject's jobs newest first

Revision ID: 0048
Revises: 0047
Create Date: 2026-12-07

``GET /v1/transcripts`` and ``factmill transcripts list`` read the transcripts most recently changed
first (``updated_at DESC, id``): with no index in that order every call read and sorted the whole table
(one transcript per agent session: millions). ``ix_transcripts_updated_at`` serves it as written.

Listing pages reads each page's latest extraction job (``kind, subject ... ORDER BY id DESC LIMIT 1``):
``ix_jobs_subject (kind, subject)`` yields a subject's jobs in heap order, so each was read and sorted
(a chat page re-delivered every turn holds thousands). ``ix_jobs_subject_id (kind, subject, id)`` yields
them newest first, and serves every lookup the old index served, which it replaces. Built and dropped
CONCURRENTLY, outside a transaction: jobs and transcripts are written all the time.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op
from worker.index_builds import building_concurrently, create_index_concurrently

revision: str = "0048"
down_revision: str | None = "0047"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with building_concurrently(op):
        create_index_concurrently(op, "ix_transcripts_updated_at", "ON transcripts (updated_at DESC, id)")
        create_index_concurrently(op, "ix_jobs_subject_id", "ON jobs (kind, subject, id)")
        op.execute("DROP INDEX CONCURRENTLY IF EXISTS ix_jobs_subject")


def downgrade() -> None:
    with building_concurrently(op):
        create_index_concurrently(op, "ix_jobs_subject", "ON jobs (kind, subject)")
        op.execute("DROP INDEX CONCURRENTLY IF EXISTS ix_jobs_subject_id")
        op.execute("DROP INDEX CONCURRENTLY IF EXISTS ix_transcripts_updated_at")
