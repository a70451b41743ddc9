"""Intent-aware search over facts: lexical and vector lists, fused, with snippets; fact embeddings.

The package: ``store`` (the SQL, owning its transactions), ``service`` (search on a store),
``embedding`` (fact embeddings), ``calls`` (the LLM calls of both, each accounted), ``entrypoints``
(the same from a sessionmaker, as callers use it), ``prompts`` (query expansion), ``values``,
``errors`` and ``vector_ddl`` (the pgvector store, shared with migration 0003). The pure pieces live
in ``worker.core.lexing``, ``worker.core.fusion`` and ``worker.core.embeddings``.
"""

from __future__ import annotations

from worker.core.embeddings import EMBEDDING_DIMENSIONS, fact_embedding_text
from worker.core.fusion import RRF_K, SearchLine, best_chunk, fuse
from worker.core.intent import QueryParseError
from worker.core.lexing import normalise_score, parse_expansion, parse_lex_query
from worker.search.calls import EMBEDDING_PURPOSE
from worker.search.entrypoints import (
    count_facts_to_embed,
    embed_facts,
    embed_new_facts,
    embed_pages_facts,
    enable_vector_search,
    expand_query,
    open_store,
    pages_with_late_facts,
    search,
    search_as,
)
from worker.search.errors import (
    BUDGET_SPENT,
    UNAVAILABLE_NO_EXTENSION,
    UNAVAILABLE_NOT_SET_UP,
    EmbeddingFailedError,
    SearchError,
    VectorSearchUnavailableError,
)
from worker.search.llm_source import LLMSource
from worker.search.prompts import EXPANSION_PURPOSE, EXPANSION_SYSTEM_PROMPT, expansion_request
from worker.search.store import SearchStore, vector_search_status
from worker.search.values import (
    DEFAULT_LIMIT,
    MAX_INTENT_CHARS,
    MAX_LIMIT,
    MAX_QUERY_CHARS,
    MAX_SEARCH_LINES,
    EmbedReport,
    SearchFilters,
    SearchOutcome,
    SearchResult,
)
from worker.search.vector_ddl import VECTOR_STORE_DDL

__all__ = [
    "BUDGET_SPENT",
    "DEFAULT_LIMIT",
    "EMBEDDING_DIMENSIONS",
    "EMBEDDING_PURPOSE",
    "EXPANSION_PURPOSE",
    "EXPANSION_SYSTEM_PROMPT",
    "MAX_INTENT_CHARS",
    "MAX_LIMIT",
    "MAX_QUERY_CHARS",
    "MAX_SEARCH_LINES",
    "RRF_K",
    "UNAVAILABLE_NOT_SET_UP",
    "UNAVAILABLE_NO_EXTENSION",
    "VECTOR_STORE_DDL",
    "EmbedReport",
    "EmbeddingFailedError",
    "LLMSource",
    "QueryParseError",
    "SearchError",
    "SearchFilters",
    "SearchLine",
    "SearchOutcome",
    "SearchResult",
    "SearchStore",
    "VectorSearchUnavailableError",
    "best_chunk",
    "count_facts_to_embed",
    "embed_facts",
    "embed_new_facts",
    "embed_pages_facts",
    "enable_vector_search",
    "expand_query",
    "expansion_request",
    "fact_embedding_text",
    "fuse",
    "normalise_score",
    "open_store",
    "pages_with_late_facts",
    "parse_expansion",
    "parse_lex_query",
    "search",
    "search_as",
    "vector_search_status",
]
