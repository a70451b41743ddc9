"""pages.source_id: the rows already there checked against 0037's constraint

Revision ID: 0038
Revises: 0037
Create Date: 2026-12-05

VALIDATE CONSTRAINT scans the pages holding SHARE UPDATE EXCLUSIVE only: webhooks, extraction commits
and searches go on meanwhile. Its own migration, so its transaction is not the one that took 0037's
ACCESS EXCLUSIVE lock (held to the end of a transaction, it would have kept them all waiting again).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op
from worker.db import MigrationRefusedError

revision: str = "0038"
down_revision: str | None = "0037"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    try:
        op.execute(sa.text("ALTER TABLE pages VALIDATE CONSTRAINT ck_pages_source_id"))
    except sa.exc.IntegrityError as exc:  # a row written between 0037's check and its constraint
        raise MigrationRefusedError(
            "some page has a source id holding '|' (written while 0037 ran); give it one without: UPDATE "
            "pages SET source_id = replace(source_id, '|', '-') WHERE strpos(source_id, '|') > 0, after "
            "checking no such source exists, then upgrade again"
        ) from exc


def downgrade() -> None:
    pass  # 0037's downgrade drops the constraint
