"""Intent-aware search over facts, and fact embeddings, on a SearchStore; every LLM call is accounted.

A query is either a plain query or a structured query document (``lex:``/``vec:``/``hyde:``/``intent:``
lines, parsed by ``worker.core.intent.parse_structured_query``). Each search line yields a ranked list
of facts; reciprocal-rank fusion merges the lists; every result carries its provenance and a snippet
of its conversation segment chosen with the intent.

- ``lex``: full-text search over fact, entity and context (the generated ``facts.search_vector`` and
  its GIN index). Terms are ANDed (prefix matches; ``"quoted phrases"``; ``-term`` excludes), stop
  words are dropped from plain terms, and each match is scored BM25-style (idf of each term from its
  document frequency, a term matched in the fact or entity counts double one matched only in the
  context, shorter facts a little higher), normalised to [0, 1) as |x| / (1 + |x|).
- ``vec``: the line is embedded through the LLM gateway and searched with pgvector (cosine) over
  ``search.fact_embeddings``; ``hyde``: a hypothetical fact, embedded and searched the same way.
  Without pgvector these lines raise ``VectorSearchUnavailableError``; lexical search still works.
- A plain query is searched lexically first; unless ``has_strong_signal`` says the top hit is
  already clear (never when an intent is given), the LLM expands it into lex/vec/hyde lines.
- Fusion: RRF with k = 60, weight 2 for the user's own lines and 1 for expansions, plus a small
  bonus for a first (or second/third) place in any list.

Every LLM call (expansion, query and fact embeddings) is recorded in llm_calls through the store's
ledger, so the `llm.prices` override costs it; a failed record is logged, never raised.
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from worker.accounting import LLMCallRecord
from worker.consolidation.history import Lifecycle
from worker.core.embeddings import fact_embedding_text, vectors_problem
from worker.core.errors import error_summary
from worker.core.fusion import (
    EXPANSION_LINE_WEIGHT,
    USER_LINE_WEIGHT,
    Fused,
    Hit,
    SearchLine,
    bounded_terms,
    fuse,
    segment_range,
    segment_snippet,
)
from worker.core.intent import SearchType, StructuredQuery, has_strong_signal, parse_structured_query
from worker.core.lexing import parse_expansion, parse_lex_query, plain_text
from worker.llm.errors import BudgetExhaustedError, LLMError, NoEmbeddingsError
from worker.llm.retry import AttemptRecord, chat_with_tries
from worker.llm.types import ChatResponse, EmbeddingResponse, LLMClient
from worker.search.errors import (
    UNAVAILABLE_NO_EXTENSION,
    DeadlineExceededError,
    EmbeddingFailedError,
    SearchError,
    VectorSearchUnavailableError,
)
from worker.search.llm_source import LLMSource, resolve_llm, vector_model
from worker.search.prompts import EXPANSION_PURPOSE, expansion_request
from worker.search.store import FactToEmbed, LineQuery, SearchStore
from worker.search.values import (
    MAX_LIMIT,
    MAX_QUERY_CHARS,
    MAX_SEARCH_LINES,
    MIN_CANDIDATES,
    EmbedReport,
    SearchFilters,
    SearchOutcome,
    SearchRequest,
    SearchResult,
    VectorSearchStatus,
)

logger = logging.getLogger(__name__)

__all__ = [
    "EMBEDDING_PURPOSE",
    "FACT_EMBEDDING_PURPOSE",
    "LLMSource",
    "embed_facts",
    "embed_new_facts",
    "embed_texts",
    "expand_query",
    "search",
]

EMBEDDING_PURPOSE = "search_embedding"  # vec/hyde lines of a search
FACT_EMBEDDING_PURPOSE = "embedding"  # facts, by `factmill embed` and after extraction

Lists = list[tuple[SearchLine, list[Hit]]]


# --------------------------------------------------------------------------- accounting


def _record(store: SearchStore, call: LLMCallRecord) -> None:
    try:
        store.record_llm_call(call)
    except Exception as exc:  # accounting must never take search down
        logger.warning("could not record a %s LLM call: %s", call.purpose, error_summary(exc))
        logger.debug("traceback of the record's error", exc_info=exc)


def _record_failure(store: SearchStore, purpose: str, llm: LLMClient, exc: Exception, started: float) -> None:
    _record(store, LLMCallRecord.failed(purpose, llm, exc, int((time.perf_counter() - started) * 1000)))


def _record_tries(store: SearchStore, llm: LLMClient, tries: Sequence[AttemptRecord]) -> None:
    for failed in LLMCallRecord.failed_tries(EXPANSION_PURPOSE, llm, tries):
        _record(store, failed)


def _answered(purpose: str, response: ChatResponse | EmbeddingResponse, outcome: str) -> LLMCallRecord:
    return LLMCallRecord(
        purpose, response.provider, response.model, response.usage, response.latency_ms, outcome
    )


# --------------------------------------------------------------------------- LLM calls


def expand_query(
    store: SearchStore, llm: LLMClient, query: str, intent: str | None
) -> tuple[list[tuple[SearchType, str]], str | None]:
    """(expansion lines, note): an LLM failure yields no lines and a note, never an error."""
    started = time.perf_counter()
    try:
        response, tried = chat_with_tries(llm, expansion_request(query, intent))
    except BudgetExhaustedError:
        # No call was made; readers never see spend or budget figures.
        return [], "query expansion skipped: budget; searched the query alone"
    except Exception as exc:
        logger.warning("query expansion failed: %s", error_summary(exc))
        _record_tries(store, llm, getattr(exc, "attempts", ())[:-1])
        _record_failure(store, EXPANSION_PURPOSE, llm, exc, started)
        return [], "query expansion failed (the LLM did not answer); searched the query alone"
    _record_tries(store, llm, tried)  # each try the gateway retried is a call of its own
    outcome = "ok" if response.finish == "end" else response.finish
    _record(store, _answered(EXPANSION_PURPOSE, response, outcome))
    if response.finish == "refusal":
        return [], "query expansion was refused by the model; searched the query alone"
    return parse_expansion(response.text, query), None


def embed_texts(
    store: SearchStore, llm: LLMClient, texts: list[str], purpose: str
) -> tuple[list[list[float]], str]:
    """One embedding call for ``texts``, accounted under ``purpose``: (the vectors, their model)."""
    vectors, call = _call_embeddings(store, llm, texts, purpose)
    _record(store, call)
    return vectors, vector_model(call)


def _call_embeddings(
    store: SearchStore, llm: LLMClient, texts: list[str], purpose: str
) -> tuple[list[list[float]], LLMCallRecord]:
    """(the vectors, the answered call's record, for the caller to store). A failed call is recorded
    here and raised; the caller checks the vectors (``vectors_problem``)."""
    started = time.perf_counter()
    try:
        response = llm.embed(texts, purpose=purpose)
    except (BudgetExhaustedError, NoEmbeddingsError):
        raise  # refused before any request: nothing to record (a row per refused search, 60 a minute a key)
    except Exception as exc:
        _record_failure(store, purpose, llm, exc, started)
        raise
    return response.vectors, _answered(purpose, response, "ok")


# --------------------------------------------------------------------------- search


@dataclass
class _Gathered:
    """The ranked lists of one search, with what the snippets look for and how the lists came about."""

    lists: Lists
    snippet_query: str
    intent: str | None
    expanded: bool = False
    strong: bool = False
    notes: list[str] = field(default_factory=list)


def search(store: SearchStore, llm: LLMSource, request: SearchRequest) -> SearchOutcome:
    """Run a plain query or a structured query document over the facts. ``llm`` (a client, or a
    callable returning one, opened lazily) embeds vec/hyde lines and expands plain queries; with None,
    plain queries are searched lexically only. Raises ``QueryParseError`` for a bad query document,
    ``VectorSearchUnavailableError`` for vec:/hyde: lines without vector search, and ``SearchError``
    (``DeadlineExceededError``: past SEARCH_SECONDS) for other requests that cannot run."""
    started = time.perf_counter()
    query, limit, filters = request.query, request.limit, request.filters
    if not 1 <= limit <= MAX_LIMIT:
        raise SearchError(f"limit must be between 1 and {MAX_LIMIT}; got {limit}")
    if len(query) > MAX_QUERY_CHARS:
        raise SearchError(f"the query is {len(query)} characters; keep it under {MAX_QUERY_CHARS}")
    intent = request.intent.strip() if request.intent and request.intent.strip() else None
    parsed = parse_structured_query(query)
    if parsed is not None and len(parsed.searches) > MAX_SEARCH_LINES:
        raise SearchError(
            f"the query document has {len(parsed.searches)} search lines; at most {MAX_SEARCH_LINES} are "
            "searched in one request"
        )
    candidates = max(MIN_CANDIDATES, limit * 3)
    store = store.bounded()  # each read's statements end within SEARCH_SECONDS
    status = store.status()
    if parsed is not None:
        gathered = _structured_lists(store, llm, parsed, intent, filters, candidates, status)
    else:
        gathered = _plain_lists(store, llm, query, intent, filters, candidates, status, request.expand)
    fused = fuse(gathered.lists)[:limit]
    return SearchOutcome(
        query=query,
        intent=gathered.intent,
        structured=parsed is not None,
        expanded=gathered.expanded,
        strong_signal=gathered.strong,
        vector_search="available" if status.available else "unavailable",
        lines=tuple(line for line, _ in gathered.lists),
        results=tuple(_build_results(store, fused, gathered.snippet_query, gathered.intent, filters)),
        took_ms=(time.perf_counter() - started) * 1000,
        notes=tuple(gathered.notes),
    )


def _structured_lists(
    store: SearchStore,
    llm: LLMSource,
    parsed: StructuredQuery,
    intent: str | None,
    filters: SearchFilters,
    candidates: int,
    status: VectorSearchStatus,
) -> _Gathered:
    if intent and parsed.intent and intent != parsed.intent:
        raise SearchError("the query document has an intent: line and an intent was also given; give it once")
    user_lines = [SearchLine(s.type, s.query, "user", USER_LINE_WEIGHT, line=s.line) for s in parsed.searches]
    if not status.available and any(line.type != "lex" for line in user_lines):
        raise VectorSearchUnavailableError(status.reason or UNAVAILABLE_NO_EXTENSION)
    lists = _run_lines(store, llm, user_lines, filters, candidates, status)
    # Snippets look for the words the user searched with (hyde lines are prose, used last).
    snippet_query = " ".join(s.query for s in parsed.searches if s.type != "hyde") or " ".join(
        s.query for s in parsed.searches
    )
    return _Gathered(lists, snippet_query, parsed.intent or intent)


def _plain_lists(
    store: SearchStore,
    llm: LLMSource,
    query: str,
    intent: str | None,
    filters: SearchFilters,
    candidates: int,
    status: VectorSearchStatus,
    expand: bool,
) -> _Gathered:
    plain = plain_text(query)
    if not plain:
        raise SearchError("the query is empty; give some words to search for")
    probe, complete = store.lexical(plain, filters, candidates)
    probe_line = SearchLine("lex", plain, "query", USER_LINE_WEIGHT, hits=len(probe))
    gathered = _Gathered([(probe_line, probe)], plain, intent)
    top = probe[0].score if probe else 0.0
    second = probe[1].score if len(probe) > 1 else 0.0
    # A result that lacks some of the query's words is never "already clear".
    gathered.strong = complete and has_strong_signal(top, second, intent)
    extra: list[SearchLine] = []
    if status.available and llm is not None:
        extra.append(SearchLine("vec", plain, "query", USER_LINE_WEIGHT))
    client = None
    if expand and not gathered.strong:
        try:
            client = resolve_llm(llm)
        except VectorSearchUnavailableError:
            gathered.notes.append("query expansion skipped: the LLM settings are incomplete")
    if client is not None:
        expansion, note = expand_query(store, client, plain, intent)
        if note:
            gathered.notes.append(note)
        query_words = parse_lex_query(plain)
        for kind, body in expansion:
            if kind != "lex" and not status.available:
                continue  # no vector store: lexical expansions only
            if kind == "lex" and parse_lex_query(body) == query_words:
                continue  # the probe already ran exactly this search
            extra.append(SearchLine(kind, body, "expansion", EXPANSION_LINE_WEIGHT))
        gathered.expanded = bool(expansion)
    try:
        gathered.lists += _run_lines(store, llm, extra, filters, candidates, status)
    except DeadlineExceededError:  # the probe's answer stands
        gathered.notes.append("the lines added to the query were skipped: the search ran out of time")
    except (BudgetExhaustedError, EmbeddingFailedError, VectorSearchUnavailableError) as exc:
        # The vector lines a plain query adds are a bonus: without budget, while the embedding provider
        # fails, or where it has none, the lexical lines still run.
        why = {BudgetExhaustedError: "budget", VectorSearchUnavailableError: "unavailable"}
        gathered.notes.append(f"vector search skipped: {why.get(type(exc), 'the embedding call failed')}")
        lexical = [line for line in extra if line.type == "lex"]
        try:
            gathered.lists += _run_lines(store, llm, lexical, filters, candidates, status)
        except DeadlineExceededError:
            gathered.notes.append("the lines added to the query were skipped: the search ran out of time")
    return gathered


def _run_lines(
    store: SearchStore,
    llm: LLMSource,
    lines: list[SearchLine],
    filters: SearchFilters,
    candidates: int,
    status: VectorSearchStatus,
) -> Lists:
    """Run every line (vec/hyde texts embedded in one gateway call); each line comes back with its hits."""
    if not lines:
        return []
    vector_lines = [line for line in lines if line.type != "lex"]
    vectors: list[list[float]] = []
    model: str | None = None
    if vector_lines:
        client = resolve_llm(llm)
        if client is None:
            raise SearchError("vec: and hyde: lines need an LLM gateway to embed them; none is configured")
        try:
            texts = [line.query for line in vector_lines]
            vectors, model = embed_texts(store, client, texts, EMBEDDING_PURPOSE)
        except BudgetExhaustedError:
            raise
        except NoEmbeddingsError as exc:  # the deployment's, for good: unavailable, not failed (no retry)
            raise VectorSearchUnavailableError(
                f"vector search unavailable: {exc} (lex: lines still work)"
            ) from exc
        except LLMError as exc:  # recorded in llm_calls by embed_texts
            raise EmbeddingFailedError.of(exc) from exc
        problem = vectors_problem(vectors, len(texts))
        if problem:  # the deployment's model, not the query: no vector line can run
            raise EmbeddingFailedError(f"vector search failed: {problem}")
    by_line = iter(vectors)
    queries: list[LineQuery] = [line.query if line.type == "lex" else next(by_line) for line in lines]
    hits = store.search_lines(queries, filters, candidates, status.extension_version or "0", model)
    return [(replace(line, hits=len(found)), found) for line, found in zip(lines, hits, strict=True)]


def _build_results(
    store: SearchStore,
    fused: Sequence[Fused],
    snippet_query: str,
    intent: str | None,
    filters: SearchFilters,
) -> list[SearchResult]:
    if not fused:
        return []
    lifecycle = Lifecycle(filters.include_history, filters.as_of)
    facts, neighbours = store.result_rows([entry.fact_id for entry in fused], lifecycle)
    snippet_query, intent = bounded_terms(snippet_query) or "", bounded_terms(intent)
    results: list[SearchResult] = []
    for entry in fused:
        row = facts.get(entry.fact_id)
        if row is None:
            continue
        segment = neighbours.get(entry.fact_id) or [(row["row_num"], row["fact"])]
        snippet = segment_snippet(segment, row["row_num"], snippet_query, intent)
        start, end = segment_range(row["segment"])
        results.append(
            SearchResult(
                **row,
                score=entry.score,
                lex_score=entry.lex_score,
                vec_score=entry.vec_score,
                segment_start=start,
                segment_end=end,
                snippet=snippet.snippet,
                snippet_line=snippet.line,
                matched_by=tuple(entry.matched_by),
            )
        )
    return results


# --------------------------------------------------------------------------- embeddings


def _embed_rows(
    store: SearchStore, llm: LLMClient, rows: Sequence[FactToEmbed], report: EmbedReport, replace: bool
) -> str:
    texts = [fact_embedding_text(r.fact, r.entity_slug) for r in rows]
    vectors, call = _call_embeddings(store, llm, texts, FACT_EMBEDDING_PURPOSE)
    problem = vectors_problem(vectors, len(texts))
    if problem:
        _record(store, call)
        raise SearchError(problem)
    try:
        # The call's llm_calls row commits with the vectors it bought: one transaction, not two.
        ids = [row.id for row in rows]
        stored = store.fill_embeddings(ids, vectors, model=vector_model(call), call=call, replace=replace)
    except Exception:
        _record(store, call)  # the vectors could not be stored; the call was paid all the same
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
    # How many pages, not which (a slug can name a person: logs name none), and the error's class and
    # first line without the provider's body (error_summary).
    logger.warning(
        "could not embed the facts of %s page(s) (%s); `factmill embed` will fill them in",
        len(pages),
        error_summary(exc),
    )
