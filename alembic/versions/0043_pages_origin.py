"""pages.origin: the file `factmill ingest` stored a page from

Revision ID: 0043
Revises: 0042
Create Date: 2026-12-07

A page file's slug is its path below the folder named on the command line, so `ingest exports/2024-06`
and a later `ingest exports/2024-07`, both holding general.md, made one page: the second run stored
over the first month's page and its job replaced that month's facts, saying "ingested 1 page". The file
a page came from is kept, and an ingest of another file is refused while that one is still there
(``--replace`` stores it anyway). Pages stored before have none, and are replaced as before.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "0043"
down_revision: str | None = "0042"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("pages", sa.Column("origin", sa.Text(), nullable=True))


def downgrade() -> None:
    op.drop_column("pages", "origin")
