"""Fact embeddings: `factmill embed` (every fact without one, or all after a model change) and the
follow-up that embeds a page's new facts after extraction commits them."""

from __future__ import annotations

import contextvars
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from worker.core.embeddings import fact_embedding_text, vectors_problem
from worker.core.errors import loggable
from worker.llm.types import LLMClient
from worker.search.calls import FACT_EMBEDDING_PURPOSE, call_embeddings, record
from worker.search.errors import SearchError
from worker.search.llm_source import vector_model
from worker.search.store import FactToEmbed, SearchStore
from worker.search.values import EmbedReport

logger = logging.getLogger(__name__)


def _embed_rows(
    store: SearchStore, llm: LLMClient, rows: Sequence[FactToEmbed], report: EmbedReport, replace: bool
) -> str:
    texts = [fact_embedding_text(r.fact, r.entity_slug) for r in rows]
    vectors, call = call_embeddings(store, llm, texts, FACT_EMBEDDING_PURPOSE)
    problem = vectors_problem(vectors, len(texts))
    if problem:
        record(store, call)
        raise SearchError(problem)
    try:
        # The call's llm_calls row commits with the vectors it bought: one transaction, not two.
        ids = [row.id for row in rows]
        stored = store.fill_embeddings(ids, vectors, model=vector_model(call), call=call, replace=replace)
    except Exception:
        record(store, call)  # the vectors could not be stored; the call was paid all the same
        raise
    report.embedded += stored
    report.skipped += len(rows) - stored
    report.batches += 1
    return vector_model(call)


def embed_facts(
    store: SearchStore,
    llm: LLMClient,
    batch_size: int = 64,
    *,
    progress: Callable[[EmbedReport], None] | None = None,
    set_up_vector_store: bool = True,
    every: bool = False,
) -> EmbedReport:
    """Backfill embeddings for every fact that has none (``every``: every fact, replacing what it has:
    after a change of embedding model), audit rows excluded, in id order.

    First sets up the pgvector store (unless told not to) when the server has the extension but
    this database has no store yet. Embeddings land in ``facts.embedding``; triggers copy them to
    the store.
    """
    if batch_size < 1:
        raise SearchError("batch size must be at least 1")
    status = store.enable_vector_search() if set_up_vector_store else store.status()
    report = EmbedReport(vector_search="available" if status.available else "unavailable")
    last_id = 0
    model: str | None = None
    while rows := store.facts_to_embed(after_id=last_id, limit=batch_size, every=every, model=model):
        model = _embed_rows(store, llm, rows, report, replace=every)
        last_id = rows[-1].id
        if progress is not None:
            progress(report)
    return report


def embed_new_facts(
    store: SearchStore, llm: LLMClient, source_id: str, slug: str, batch_size: int = 64
) -> int:
    """Embed a page's facts that have no embedding yet; the hook extraction calls after a commit.

    Never raises: a failed embedding call is logged and left to `factmill embed` to fill later,
    because the facts themselves are already safely stored. Returns how many facts were embedded.
    """
    return embed_pages_facts(store, llm, [(source_id, slug)], batch_size)


def embed_pages_facts(
    store: SearchStore,
    llm: LLMClient,
    pages: Sequence[tuple[str, str]],
    batch_size: int = 64,
    *,
    concurrency: int = 1,
) -> int:
    """Embed the facts of several pages ((source id, slug) each) that have no embedding yet, in
    batches that may span pages (fewer embedding calls), up to ``concurrency`` batches at once. Never
    raises, as ``embed_new_facts``: a failed batch is logged and no other starts after it."""
    try:
        rows = store.pages_facts_to_embed(pages)
    except Exception as exc:
        _could_not_embed(pages, exc)
        return 0
    batches = [rows[start : start + batch_size] for start in range(0, len(rows), batch_size)]
    failed = threading.Event()  # after a failure no new batch starts: the gateway may be down

    def embed(batch: Sequence[FactToEmbed]) -> int:
        report = EmbedReport()
        if not failed.is_set():
            try:
                # Not a fact an erasure removed since they were read (a large page's backlog takes
                # minutes): after the erasure returns, only a batch already checked (in flight, or
                # checked a moment before) may still carry its text to the provider. The first batch
                # was read a moment ago: a page of one batch (most pages) pays no second read.
                if batch is not batches[0]:
                    there = store.still_unembedded(row.id for row in batch)
                    batch = [row for row in batch if row.id in there]
                if batch:
                    _embed_rows(store, llm, batch, report, False)
            except Exception as exc:
                failed.set()
                _could_not_embed(pages, exc)
        return report.embedded

    if concurrency <= 1 or len(batches) <= 1:
        return sum(embed(batch) for batch in batches)
    # A large page's backlog (thousands of facts): its calls wait on the model and its vectors' index
    # inserts on Postgres, so several at once shorten the vectors' lag (bench/pipeline.py, one page of
    # 4,000 segments). Each task runs in a copy of this thread's context, as the caller's call would
    # (taken here: copy_context() inside the task copied the pool thread's own, empty one).
    caller = contextvars.copy_context()
    with ThreadPoolExecutor(min(concurrency, len(batches)), thread_name_prefix="embed") as pool:
        return sum(pool.map(lambda batch: caller.copy().run(embed, batch), batches))


def _could_not_embed(pages: Sequence[tuple[str, str]], exc: Exception) -> None:
    # How many pages, not which (a slug can name a person: logs name none), and the error by its status
    # and code, never the provider's words (loggable).
    logger.warning(
        "could not embed the facts of %s page(s) (%s); the maintenance sweep tries them again",
        len(pages),
        loggable(exc),
    )
