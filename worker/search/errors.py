"""The errors a search can raise, and why vector search may be unavailable."""

from __future__ import annotations

__all__ = [
    "UNAVAILABLE_NOT_SET_UP",
    "UNAVAILABLE_NO_EXTENSION",
    "SearchError",
    "VectorSearchUnavailableError",
]


class SearchError(ValueError):
    """A search that cannot run as asked; the message says what to change."""


class VectorSearchUnavailableError(SearchError):
    """vec:/hyde: lines on a database without the pgvector store."""


UNAVAILABLE_NO_EXTENSION = (
    "vector search unavailable: this Postgres server has no pgvector extension, so vec: and hyde: "
    "lines cannot run (lex: lines still work). Install pgvector on the server (see "
    "deploy/install-pgvector.sh), then run `factmill embed`."
)
UNAVAILABLE_NOT_SET_UP = (
    "vector search unavailable: the server has pgvector but this database has no vector store yet, "
    "so vec: and hyde: lines cannot run (lex: lines still work). Run `factmill embed` to set it up."
)
