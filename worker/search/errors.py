"""The errors a search can raise, and why vector search may be unavailable."""

from __future__ import annotations

from worker.llm.errors import LLMError

__all__ = [
    "BUDGET_SPENT",
    "UNAVAILABLE_NOT_SET_UP",
    "UNAVAILABLE_NO_EXTENSION",
    "UNCONFIGURED",
    "DeadlineExceededError",
    "EmbeddingFailedError",
    "SearchError",
    "VectorSearchUnavailableError",
    "refused_by_provider",
]

# What a search refused for a spent budget says (the API's 503, the MCP tool's refusal).
BUDGET_SPENT = "the search LLM budget for today is spent; lex: lines still work"


class SearchError(ValueError):
    """A search that cannot run as asked; the message says what to change."""


class DeadlineExceededError(SearchError):
    """A search's database work ran past its time (worker.search.values.SEARCH_SECONDS)."""


class VectorSearchUnavailableError(SearchError):
    """vec:/hyde: lines that cannot run here: no pgvector store, no embeddings API, or the provider
    refusing the deployment's embedding call."""


# A search that needs the model while the deployment's LLM settings are incomplete (FACTMILL_LLM=anthropic
# without its key): the reader is told that much, the server log names what to set.
UNCONFIGURED = (
    "vector search unavailable: the deployment's LLM settings are incomplete (the server log names what to "
    "set); lex: lines still work"
)


class EmbeddingFailedError(Exception):
    """The embedding call for a document's vec:/hyde: lines failed (the provider is down, or answered
    vectors the store cannot search with): the search cannot run as asked, through no fault of the
    query. A plain query's own vector line never raises it: that line is a bonus, skipped with a note."""

    @classmethod
    def of(cls, cause: LLMError) -> EmbeddingFailedError:
        status = f", HTTP {cause.status}" if cause.status else ""
        return cls(
            f"vector search failed: the embedding call did not succeed ({cause.outcome}{status}); "
            "try again shortly (lex: lines still work)"
        )


def refused_by_provider(cause: LLMError) -> str:
    """Why vector search is unavailable when the provider blamed the deployment (its key, its embedding
    model, its account): answered "try again shortly" with Retry-After, clients retried it for good."""
    return (
        f"vector search unavailable: the provider refused the deployment's embedding call ({cause.log_text}: "
        "its key, model or account; the server's operator must set it right); lex: lines still work"
    )


UNAVAILABLE_NO_EXTENSION = (
    "vector search unavailable: this Postgres server has no pgvector extension, so vec: and hyde: "
    "lines cannot run (lex: lines still work). Install pgvector on the server (see "
    "deploy/install-pgvector.sh), then run `factmill embed`."
)
UNAVAILABLE_NOT_SET_UP = (
    "vector search unavailable: the server has pgvector but this database has no vector store yet, "
    "so vec: and hyde: lines cannot run (lex: lines still work). Run `factmill embed` to set it up."
)
