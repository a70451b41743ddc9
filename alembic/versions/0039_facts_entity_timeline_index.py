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

from collections.abc import Sequence

from alembic import op
from worker.index_builds import building_concurrently, create_index_concurrently

revision: str = "0039"
down_revision: str | None = "0038"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with building_concurrently(op):
        create_index_concurrently(op, "ix_facts_entity_timeline", "ON facts (entity_slug, valid_from, id)")
        op.execute("DROP INDEX CONCURRENTLY IF EXISTS ix_facts_entity_slug")


def downgrade() -> None:
    with building_concurrently(op):
        create_index_concurrently(op, "ix_facts_entity_slug", "ON facts (entity_slug)")
        op.execute("DROP INDEX CONCURRENTLY IF EXISTS ix_facts_entity_timeline")
