"""search: full-text search column and GIN index on facts; pgvector store when the server has it

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29

The tsvector is a generated column (``facts.search_vector``, in the models) so ranking reads it
instead of re-parsing every matching row. The vector store exists only on servers with the
``vector`` extension (pgvector), so it lives outside the models, in its own schema ``search``:
``search.fact_embeddings(fact_id, embedding vector(256))`` with an HNSW index, kept in step with
``facts.embedding`` (the canonical float array every server has) by triggers. A server without
pgvector gets the same models-visible schema, and vector search reports itself unavailable.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from alembic import op
from worker.search.vector_ddl import VECTOR_STORE_DDL

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

logger = logging.getLogger("alembic.runtime.migration")

# The column as 0003 built it; 0021 rebuilds it with accents folded (models.fact.SEARCH_VECTOR_SQL).
SEARCH_VECTOR_SQL = (
    "setweight(to_tsvector('simple'::regconfig, fact), 'A') || "
    "setweight(to_tsvector('simple'::regconfig, COALESCE(entity_slug, '')), 'B') || "
    "setweight(to_tsvector('simple'::regconfig, context), 'C')"
)


def upgrade() -> None:
    op.add_column(
        "facts",
        sa.Column(
            "search_vector",
            postgresql.TSVECTOR(),
            sa.Computed(SEARCH_VECTOR_SQL, persisted=True),
            nullable=True,
        ),
    )
    op.create_index("ix_facts_search_vector", "facts", ["search_vector"], postgresql_using="gin")

    bind = op.get_bind()
    available = bind.execute(sa.text("SELECT 1 FROM pg_available_extensions WHERE name = 'vector'")).first()
    if available is None:
        logger.warning(
            "pgvector is not installed on this Postgres server: vector search (vec:/hyde: lines) "
            "stays unavailable, lexical search works. Install it, then run `factmill embed`."
        )
        return
    try:
        # A savepoint: without the privilege to create the extension, the rest still applies.
        with bind.begin_nested():
            for statement in VECTOR_STORE_DDL:
                bind.exec_driver_sql(statement)
    except sa.exc.DBAPIError as exc:
        logger.warning("could not set up the pgvector store (%s); vector search stays unavailable", exc.orig)


def downgrade() -> None:
    # Dropping the schema drops the trigger function and, through it, the triggers on facts.
    op.execute("DROP SCHEMA IF EXISTS search CASCADE")
    op.drop_index("ix_facts_search_vector", table_name="facts", postgresql_using="gin")
    op.drop_column("facts", "search_vector")
