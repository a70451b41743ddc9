"""facts: one index in the order an entity's facts are listed, (entity_slug, valid_from, id)

Revision ID: 0039
Revises: 0038
Create Date: 2026-12-06

An entity's facts are listed newest first and paged by a cursor (GET /v1/entities/{entity}/facts, the
MCP tool list_entity_facts). On the entity_slug index alone every page read and sorted all of the
entity's facts: an entity named in 200,000 facts cost that much per page. This index serves the list
in its order (each page reads its own rows) and every entity_slug lookup the old one served, which it
replaces. Built and dropped CONCURRENTLY, outside a transaction: facts is written by every segment
commit, and a plain CREATE INDEX would hold them all for the build.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import sqlalchemy as sa

from alembic import op

revision: str = "0039"
down_revision: str | None = "0038"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.get_context().autocommit_block(), _no_lock_timeout():
        # An attempt cut short (a restart) leaves an INVALID index of this name behind; a valid one stays.
        if op.get_bind().execute(sa.text(_INVALID), {"name": "ix_facts_entity_timeline"}).scalar():
            op.execute("DROP INDEX CONCURRENTLY ix_facts_entity_timeline")
        op.execute(
            "CREATE INDEX CONCURRENTLY IF NOT EXISTS ix_facts_entity_timeline "
            "ON facts (entity_slug, valid_from, id)"
        )
        op.execute("DROP INDEX CONCURRENTLY IF EXISTS ix_facts_entity_slug")


def downgrade() -> None:
    with op.get_context().autocommit_block(), _no_lock_timeout():
        if op.get_bind().execute(sa.text(_INVALID), {"name": "ix_facts_entity_slug"}).scalar():
            op.execute("DROP INDEX CONCURRENTLY ix_facts_entity_slug")
        op.execute("CREATE INDEX CONCURRENTLY IF NOT EXISTS ix_facts_entity_slug ON facts (entity_slug)")
        op.execute("DROP INDEX CONCURRENTLY IF EXISTS ix_facts_entity_timeline")


_INVALID = "SELECT NOT indisvalid FROM pg_index WHERE indexrelid = to_regclass(:name)"


@contextmanager
def _no_lock_timeout() -> Iterator[None]:
    """The upgrade's lock_timeout (worker.db: a few seconds, then try again) lifted for these: a
    concurrent build waits for every transaction older than it in the database, and cut short it left
    an INVALID index and built it all again at every try. Its lock holds no read or write back."""
    bind = op.get_bind()
    was = bind.execute(sa.text("SHOW lock_timeout")).scalar()
    bind.execute(sa.text("SET lock_timeout = 0"))
    try:
        yield
    finally:
        bind.execute(sa.text("SELECT set_config('lock_timeout', :was, false)"), {"was": was})
