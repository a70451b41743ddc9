"""pages.source_id: no '|', checked by the database too

Revision ID: 0037
Revises: 0036
Create Date: 2026-12-05

A page's jobs, checkpoints and erasure digests join its source and slug with '|' (``source|slug``), so a
source id holding one names two pages at once. Every route and command refuses it
(worker.core.labels.check_source_id); a row written around them (a restore, a script) was not.

The constraint goes on NOT VALID here (a moment's lock, no scan: every row written from now on is
checked) and 0038 validates the rows already there, a scan that lets reads and writes go on (checked
while adding it, the scan held every webhook, commit and search on the pages). A database that already
holds such a row is refused first, with what to do.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op
from worker.db import MigrationRefusedError

revision: str = "0037"
down_revision: str | None = "0036"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    held = op.get_bind().scalar(
        sa.text("SELECT EXISTS (SELECT 1 FROM pages WHERE strpos(source_id, '|') > 0)")
    )
    if held:
        raise MigrationRefusedError(
            "some page has a source id holding '|', which Factmill cannot tell apart from its "
            "source|slug keys; give them a source id without one (UPDATE pages SET source_id = "
            "replace(source_id, '|', '-') WHERE strpos(source_id, '|') > 0, after checking no such "
            "source exists), then upgrade again"
        )
    op.execute(
        sa.text(
            "ALTER TABLE pages ADD CONSTRAINT ck_pages_source_id CHECK (strpos(source_id, '|') = 0) NOT VALID"
        )
    )


def downgrade() -> None:
    op.drop_constraint("source_id", "pages", type_="check")
