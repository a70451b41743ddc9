"""facts.search_vector: a word of Chinese, Japanese or Korean is found inside the sentence that holds it

Revision ID: 0049
Revises: 0048
Create Date: 2026-12-07

Postgres's parser reads a run of ideographs, kana or Hangul with no space in it as one word: "李雷住在东京。"
was indexed as the single lexeme 李雷住在东京, so "东京" (or "李雷") found it only where it began the run
and equalled it whole, and a Korean word with a particle attached ("서울에") never matched "서울".
``search_words(text)`` is ``search_fold`` with a space put around each character of those scripts (the
ranges of worker.core.folding.UNSPACED_SCRIPT_RANGES, which a test holds equal to this one): each is a
lexeme of its own, and a query word holding one is searched by the overlapping pairs of its characters
(worker.core.lexing), so "东京" matches 东 followed by 京 anywhere. ASCII text is returned as it is.

Rebuilding the column rewrites ``facts`` and its GIN index under an ACCESS EXCLUSIVE lock, as 0021 did:
about 3 s per 200,000 facts here; run it when a pause of that length is acceptable.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op
from worker.index_builds import rebuild_search_vector

revision: str = "0049"
down_revision: str | None = "0048"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Hiragana and Katakana, CJK ideographs (extension A, the unified block, compatibility), Hangul syllables.
UNSPACED = r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff]"
# What folding may turn into those (decomposed Hangul's jamo compose into syllables, the compatibility
# supplement's ideographs normalize into the unified block): asked of the text before it is folded.
BECOMES_UNSPACED = UNSPACED[:-1] + r"\u1100-\u11ff\U0002f800-\U0002fa1f]"
# search_fold's expression (0021) written out, not called: a SQL function calling another is not inlined
# into the generated column, and each call cost a fact's insert 2.5 times search_fold's own time
# (bench/search_fold.py). tests/integration/test_search.py holds the two equal on text without CJK.
FOLD = (
    "translate(normalize(regexp_replace(normalize(t, NFD), '[\\u0300-\\u036f]', '', 'g'), NFC), "
    "'øØłŁđĐ', 'oOlLdD')"
)
SEARCH_WORDS = f"""
CREATE FUNCTION search_words(t text) RETURNS text
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
SELECT CASE WHEN octet_length(t) = char_length(t) THEN t
WHEN t !~ '{BECOMES_UNSPACED}' THEN {FOLD}
ELSE regexp_replace({FOLD}, '({UNSPACED})', ' \\1 ', 'g') END
$$
"""

# Keep in step with models.fact.SEARCH_VECTOR_SQL.
SPACED = (
    "setweight(to_tsvector('simple'::regconfig, search_words(fact)), 'A') || "
    "setweight(to_tsvector('simple'::regconfig, search_words(COALESCE(entity_slug, ''))), 'B') || "
    "setweight(to_tsvector('simple'::regconfig, context), 'C')"
)
FOLDED = (  # 0021's
    "setweight(to_tsvector('simple'::regconfig, search_fold(fact)), 'A') || "
    "setweight(to_tsvector('simple'::regconfig, search_fold(COALESCE(entity_slug, ''))), 'B') || "
    "setweight(to_tsvector('simple'::regconfig, context), 'C')"
)


def upgrade() -> None:
    op.execute(SEARCH_WORDS)
    rebuild_search_vector(op, SPACED)
    # The new column has no statistics, and a rewrite does not count as changed rows for autovacuum's
    # ANALYZE: every word's frequency was the planner's default guess, and the rarest-first fallback
    # and the ranking's idf could not tell a rare name from a common word.
    op.execute("ANALYZE facts")


def downgrade() -> None:
    rebuild_search_vector(op, FOLDED)
    op.execute("ANALYZE facts")
    op.execute("DROP FUNCTION search_words(text)")
