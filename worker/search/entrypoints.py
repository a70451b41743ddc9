"""Search as its callers (API, CLI, jobs, bench, tests) call it: from a sessionmaker, through a SearchStore.

Each entry point builds the store over ``factory`` and calls the service. LLM calls are costed by
``ledger`` when one is given (pass the runtime's, ``rt.ledger``); without one, by a ledger over the
config table behind ``factory``, so the `llm.prices` override applies either way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime

from sqlalchemy.orm import Session, sessionmaker

from worker.access import Principal, readable_sources
from worker.accounting import Ledger
from worker.config_store import ConfigReader
from worker.core.intent import SearchType
from worker.llm.types import LLMClient
from worker.runtime import Runtime
from worker.search import calls, embedding, service
from worker.search.llm_source import LLMSource
from worker.search.store import SearchStore
from worker.search.values import (
    DEFAULT_LIMIT,
    EmbedReport,
    SearchFilters,
    SearchOutcome,
    SearchRequest,
    VectorSearchStatus,
)

__all__ = [
    "count_facts_to_embed",
    "embed_facts",
    "embed_new_facts",
    "enable_vector_search",
    "expand_query",
    "open_store",
    "search",
    "search_as",
]


def open_store(factory: sessionmaker[Session], ledger: Ledger | None = None) -> SearchStore:
    """The store over ``factory``, recording LLM calls through ``ledger`` (default: one over its config)."""
    return SearchStore(factory, ledger if ledger is not None else Ledger(ConfigReader(factory).get))


def search(
    factory: sessionmaker[Session],
    llm: LLMSource,
    query: str,
    *,
    intent: str | None = None,
    filters: SearchFilters | None = None,
    limit: int = DEFAULT_LIMIT,
    expand: bool = True,
    ledger: Ledger | None = None,
) -> SearchOutcome:
    """Run a plain query or a structured query document over the facts (see worker.search.service)."""
    request = SearchRequest(query, intent, filters or SearchFilters(), limit, expand)
    return service.search(open_store(factory, ledger), llm, request)


def search_as(
    runtime: Runtime,
    principal: Principal | None,
    query: str,
    *,
    intent: str | None = None,
    source_id: str | None = None,
    entity: str | None = None,
    kind: str | None = None,
    since: datetime | None = None,
    limit: int | None = None,
    expand: bool = True,
    include_history: bool = False,
    as_of: datetime | None = None,
) -> SearchOutcome:
    """A reader's search as the API and the MCP server run it: only the sources ``principal`` may
    read (AccessRefusedError when ``source_id`` is another), the runtime's search LLM (the readers'
    budget; opened only when a line needs it), the configured default limit and expansion switch.
    Current facts only, unless ``include_history`` (the whole chain) or ``as_of`` (true then)."""
    settings = runtime.settings
    filters = SearchFilters(
        source_id=source_id,
        entity=entity,
        kind=kind,
        since=since,
        source_ids=readable_sources(principal, source_id),
        include_history=include_history,
        as_of=as_of,
    )
    return search(
        runtime.factory,
        lambda: runtime.search_llm,
        query,
        intent=intent,
        filters=filters,
        limit=limit or settings.search_default_limit,
        expand=expand and settings.search_expand,
        ledger=runtime.ledger,
    )


def expand_query(
    factory: sessionmaker[Session],
    llm: LLMClient,
    query: str,
    intent: str | None,
    *,
    ledger: Ledger | None = None,
) -> tuple[list[tuple[SearchType, str]], str | None]:
    """(expansion lines, note): an LLM failure yields no lines and a note, never an error."""
    return calls.expand_query(open_store(factory, ledger), llm, query, intent)


def embed_facts(
    factory: sessionmaker[Session],
    llm: LLMClient,
    batch_size: int = 64,
    *,
    progress: Callable[[EmbedReport], None] | None = None,
    set_up_vector_store: bool = True,
    ledger: Ledger | None = None,
    every: bool = False,
) -> EmbedReport:
    """Backfill embeddings for every fact that has none, or ``every`` fact (see
    worker.search.embedding.embed_facts)."""
    store = open_store(factory, ledger)
    return embedding.embed_facts(
        store, llm, batch_size, progress=progress, set_up_vector_store=set_up_vector_store, every=every
    )


def count_facts_to_embed(factory: sessionmaker[Session], *, every: bool = False) -> int:
    """How many facts ``embed_facts`` has to go through (a progress bar's total)."""
    return open_store(factory).count_facts_to_embed(every=every)


def embed_new_facts(
    factory: sessionmaker[Session],
    llm: LLMClient,
    source_id: str,
    slug: str,
    batch_size: int = 64,
    *,
    ledger: Ledger | None = None,
) -> int:
    """Embed a page's facts that have none yet; never raises (see worker.search.embedding.embed_new_facts)."""
    return embedding.embed_new_facts(open_store(factory, ledger), llm, source_id, slug, batch_size)


def embed_pages_facts(
    factory: sessionmaker[Session],
    llm: LLMClient,
    pages: Sequence[tuple[str, str]],
    batch_size: int = 64,
    *,
    ledger: Ledger | None = None,
    concurrency: int = 1,
) -> int:
    """Embed the facts of several pages that have none yet, batched across pages, up to
    ``concurrency`` batches at once; never raises."""
    return embedding.embed_pages_facts(
        open_store(factory, ledger), llm, pages, batch_size, concurrency=concurrency
    )


def pages_with_late_facts(
    factory: sessionmaker[Session], *, grace_seconds: float, window_seconds: float, scan: int
) -> list[tuple[str, str]]:
    """(source id, slug) of the pages whose facts stored between ``window_seconds`` and
    ``grace_seconds`` ago still have no embedding (the oldest ``scan`` such facts read)."""
    return open_store(factory).late_pages(
        grace_seconds=grace_seconds, window_seconds=window_seconds, scan=scan
    )


def enable_vector_search(factory: sessionmaker[Session]) -> VectorSearchStatus:
    """Create the pgvector store if the server has the extension and it is missing here (idempotent)."""
    return open_store(factory).enable_vector_search()
