"""pages.origin: the file `factmill ingest` stored a page from

Revision ID: 0043
Revises: 0042
Create Date: 2026-12-07

A page file's slug is its path below the folder named on the command line, so `ingest exports/2024-06`
and a later `ingest exports/2024-07`, both holding general.md, made one page: the second run stored
over the first month's page and its job replaced that month's facts, saying "ingested 1 page". The file
a page came from is kept, and an ingest of another file is refused while that one is still there
(``--replace`` stores it anyway); and a file stored as one page is not stored again as another (`ingest
notes`, then `ingest notes/2024/chat.md`, made "chat" beside "2024/chat": one conversation extracted
twice). The index finds a file's page; built CONCURRENTLY (pages is written by every delivery). Pages
stored before have no file, and are replaced as before.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op
from worker.index_builds import building_concurrently, create_index_concurrently

revision: str = "0043"
down_revision: str | None = "0042"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


_HAS_ORIGIN = "origin IS NOT NULL"


def upgrade() -> None:
    # IF NOT EXISTS: the index's build commits what came before it, so an upgrade cut short during the
    # build (a restart) finds the column at its next try, its version not yet stamped.
    op.execute("ALTER TABLE pages ADD COLUMN IF NOT EXISTS origin text")
    with building_concurrently(op):
        create_index_concurrently(op, "ix_pages_origin", f"ON pages (source_id, origin) WHERE {_HAS_ORIGIN}")


def downgrade() -> None:
    with building_concurrently(op):
        op.execute("DROP INDEX CONCURRENTLY IF EXISTS ix_pages_origin")
    op.drop_column("pages", "origin")
