"""facts.search_vector: words indexed without their accents, so "zoe" finds "Zoë"

Revision ID: 0021
Revises: 0020
Create Date: 2026-12-04

Lexical search matched words exactly as written: "zoe", "sofia castillo" or "lodz" found nothing
where the facts say Zoë, Sofía Castillo, Łódź. ``search_fold(text)`` drops the combining marks of
the text's canonical decomposition (the U+0300 block: é, ñ, å, ü, Greek tonos...) and recomposes the
rest (Hangul, kana with dakuten stay whole), and turns ø, ł, đ into o, l, d; ASCII text is returned
as it is without that work. The generated column indexes the folded fact and entity (the context is
the segment's time range, ASCII by construction); the search folds each query item the same way
(worker.search.store), so both sides meet in one rule, in SQL. Built-in functions
only: the unaccent extension is not on every server (the embedded pgserver has none).

Rebuilding the column rewrites ``facts`` and its GIN index: about 3 s per 200,000 facts here.
Inserting a fact costs Postgres a few microseconds more when its text is ASCII and about 13 more when
it is not (bench/search_fold.py; BENCHMARKS.md, "Session of 2026-12-03 (23:33 UTC)").
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op
from worker.index_builds import rebuild_search_vector

revision: str = "0021"
down_revision: str | None = "0020"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

SEARCH_FOLD = r"""
CREATE FUNCTION search_fold(t text) RETURNS text
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
SELECT CASE WHEN octet_length(t) = char_length(t) THEN t
ELSE translate(normalize(regexp_replace(normalize(t, NFD), '[\u0300-\u036f]', '', 'g'), NFC),
               'øØłŁđĐ', 'oOlLdD') END
$$
"""

# Keep in step with models.fact.SEARCH_VECTOR_SQL.
FOLDED = (
    "setweight(to_tsvector('simple'::regconfig, search_fold(fact)), 'A') || "
    "setweight(to_tsvector('simple'::regconfig, search_fold(COALESCE(entity_slug, ''))), 'B') || "
    "setweight(to_tsvector('simple'::regconfig, context), 'C')"
)
AS_WRITTEN = (
    "setweight(to_tsvector('simple'::regconfig, fact), 'A') || "
    "setweight(to_tsvector('simple'::regconfig, COALESCE(entity_slug, '')), 'B') || "
    "setweight(to_tsvector('simple'::regconfig, context), 'C')"
)


def upgrade() -> None:
    op.execute(SEARCH_FOLD)
    rebuild_search_vector(op, FOLDED)


def downgrade() -> None:
    rebuild_search_vector(op, AS_WRITTEN)
    op.execute("DROP FUNCTION search_fold(text)")
