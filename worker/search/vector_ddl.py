"""The pgvector store's DDL: run by migration 0003, and by `enable_vector_search` when pgvector comes later.

It imports nothing itself; the migration imports it from here, so there is one copy. Every statement
is idempotent. Changing it changes what migration 0003 builds on a new database: an existing one needs
a new migration.
"""

from __future__ import annotations

__all__ = ["VECTOR_STORE_DDL"]

VECTOR_STORE_DDL: tuple[str, ...] = (
    "CREATE EXTENSION IF NOT EXISTS vector",
    "CREATE SCHEMA IF NOT EXISTS search",
    """
    CREATE TABLE IF NOT EXISTS search.fact_embeddings (
        fact_id bigint PRIMARY KEY REFERENCES public.facts (id) ON DELETE CASCADE,
        embedding vector(256) NOT NULL
    )
    """,
    """
    CREATE INDEX IF NOT EXISTS fact_embeddings_hnsw
        ON search.fact_embeddings USING hnsw (embedding vector_cosine_ops)
    """,
    """
    CREATE OR REPLACE FUNCTION search.sync_fact_embedding() RETURNS trigger
    LANGUAGE plpgsql AS $$
    BEGIN
        IF NEW.embedding IS NULL OR NEW.is_audit OR cardinality(NEW.embedding) <> 256 THEN
            DELETE FROM search.fact_embeddings WHERE fact_id = NEW.id;
        ELSE
            -- float8[] -> vector is an assignment cast, so no type name (or search_path) is needed.
            INSERT INTO search.fact_embeddings (fact_id, embedding) VALUES (NEW.id, NEW.embedding)
            ON CONFLICT (fact_id) DO UPDATE SET embedding = EXCLUDED.embedding;
        END IF;
        RETURN NULL;
    END
    $$
    """,
    "DROP TRIGGER IF EXISTS facts_embedding_insert ON public.facts",
    """
    CREATE TRIGGER facts_embedding_insert AFTER INSERT ON public.facts
        FOR EACH ROW WHEN (NEW.embedding IS NOT NULL) EXECUTE FUNCTION search.sync_fact_embedding()
    """,
    "DROP TRIGGER IF EXISTS facts_embedding_update ON public.facts",
    """
    CREATE TRIGGER facts_embedding_update AFTER UPDATE OF embedding ON public.facts
        FOR EACH ROW EXECUTE FUNCTION search.sync_fact_embedding()
    """,
    """
    INSERT INTO search.fact_embeddings (fact_id, embedding)
    SELECT id, embedding FROM public.facts
    WHERE embedding IS NOT NULL AND NOT is_audit AND cardinality(embedding) = 256
    ON CONFLICT (fact_id) DO NOTHING
    """,
)
