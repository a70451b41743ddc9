"""Intent-aware search over facts on a SearchStore; every LLM call is accounted (``calls``).

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

Every LLM call (expansion, query embeddings) is recorded in llm_calls through the store's ledger
(``worker.search.calls``). Fact embeddings are ``worker.search.embedding``'s.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from worker.consolidation.history import Lifecycle
from worker.core.embeddings import vectors_problem
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
from worker.core.intent import StructuredQuery, has_strong_signal, parse_structured_query
from worker.core.lexing import parse_lex_query, plain_text, snippet_words
from worker.llm.deadline import call_deadline
from worker.llm.errors import BudgetExhaustedError, LLMError, NoEmbeddingsError
from worker.search.calls import EMBEDDING_PURPOSE, embed_texts, expand_query
from worker.search.errors import (
    UNAVAILABLE_NO_EXTENSION,
    DeadlineExceededError,
    EmbeddingFailedError,
    SearchError,
    VectorSearchUnavailableError,
    refused_by_provider,
)
from worker.search.llm_source import LLMSource, resolve_llm
from worker.search.store import LineQuery, SearchStore, SegmentLines
from worker.search.values import (
    MAX_INTENT_CHARS,
    MAX_LIMIT,
    MAX_QUERY_CHARS,
    MAX_SEARCH_LINES,
    MIN_CANDIDATES,
    SEARCH_LLM_SECONDS,
    SearchFilters,
    SearchOutcome,
    SearchRequest,
    SearchResult,
    VectorSearchStatus,
)

logger = logging.getLogger(__name__)

__all__ = ["LLMSource", "search"]

Lists = list[tuple[SearchLine, list[Hit]]]


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
    # The intent goes into the expansion prompt (paid from the readers' budget) and back in the answer:
    # held to its limit here, where the CLI's --intent and a document's intent: line meet the API's.
    for said in (intent, parsed.intent if parsed is not None else None):
        if said is not None and len(said) > MAX_INTENT_CHARS:
            raise SearchError(f"the intent is {len(said)} characters; keep it to {MAX_INTENT_CHARS}")
    if parsed is not None and len(parsed.searches) > MAX_SEARCH_LINES:
        raise SearchError(
            f"the query document has {len(parsed.searches)} search lines; at most {MAX_SEARCH_LINES} are "
            "searched in one request"
        )
    candidates = max(MIN_CANDIDATES, limit * 3)
    store = store.bounded()  # each read's statements end within SEARCH_SECONDS
    status = store.status()
    with call_deadline(SEARCH_LLM_SECONDS):
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
    said = (
        snippet_words(s.query) if s.type == "lex" else s.query for s in parsed.searches if s.type != "hyde"
    )
    snippet_query = " ".join(words for words in said if words) or " ".join(s.query for s in parsed.searches)
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
    # qmd's rule is the query's words as sent; a quoted phrase's marks and a -word are the search's
    # syntax, not words (as for a lex: line): '"performance' matched no line.
    gathered = _Gathered([(probe_line, probe)], snippet_words(plain) or plain, intent)
    top = probe[0].score if probe else 0.0
    second = probe[1].score if len(probe) > 1 else 0.0
    # A result that lacks some of the query's words is never "already clear".
    gathered.strong = complete and has_strong_signal(top, second, intent)
    extra: list[SearchLine] = []
    # A -word or -"phrase" is honoured by lexical lines alone: the query's vector line embedded it (its
    # nearest facts were those excluded) and an expansion's lines dropped it, so either could rank an
    # excluded fact first. Such a query is searched as written.
    excluding = bool(parse_lex_query(plain).excluded)
    if excluding and llm is not None and (status.available or (expand and not gathered.strong)):
        gathered.notes.append("searched lexically only: vector and expanded lines cannot exclude words")
    if status.available and llm is not None and not excluding:
        extra.append(SearchLine("vec", plain, "query", USER_LINE_WEIGHT))
    client = None
    if expand and not gathered.strong and not excluding:
        try:
            client = resolve_llm(llm)
        except VectorSearchUnavailableError:
            gathered.notes.append("query expansion skipped: the LLM settings are incomplete")
    if client is not None:
        expansion, note = expand_query(store, client, plain, intent)
        if note:
            gathered.notes.append(note)
        probed = parse_lex_query(plain).search_key
        for kind, body in expansion:
            if kind != "lex" and not status.available:
                continue  # no vector store: lexical expansions only
            if kind == "lex" and parse_lex_query(body).search_key == probed:
                continue  # the probe already ran exactly this search
            extra.append(SearchLine(kind, body, "expansion", EXPANSION_LINE_WEIGHT))
        gathered.expanded = bool(expansion)
    gathered.lists += _run_added(store, llm, extra, filters, candidates, status, gathered.notes)
    return gathered


def _run_added(
    store: SearchStore,
    llm: LLMSource,
    lines: list[SearchLine],
    filters: SearchFilters,
    candidates: int,
    status: VectorSearchStatus,
    notes: list[str],
) -> Lists:
    """The lines a plain query adds (its own vector line, the expansion's): a bonus, so the probe's
    answer stands when they fail, with a note. The vector lines go without budget, while the embedding
    provider fails, or where it has none, and the lexical ones still run; an expansion's lex: line
    slower than a search may be was a 400 that threw the user's own results away."""
    try:
        return _run_lines(store, llm, lines, filters, candidates, status)
    except (BudgetExhaustedError, EmbeddingFailedError, VectorSearchUnavailableError) as exc:
        why = {BudgetExhaustedError: "budget", VectorSearchUnavailableError: "unavailable"}
        notes.append(f"vector search skipped: {why.get(type(exc), 'the embedding call failed')}")
        lexical = [line for line in lines if line.type == "lex"]
        return _run_added(store, llm, lexical, filters, candidates, status, notes) if lexical else []
    except DeadlineExceededError:
        notes.append("the lines added to the query were skipped: the search ran out of time")
    except SearchError as exc:
        notes.append(f"the lines added to the query were skipped: {exc}")
    return []


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
            if exc.deployment_fault:  # a wrong key or model, a spent account: no retry helps the reader
                raise VectorSearchUnavailableError(refused_by_provider(exc)) from exc
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
        lines = neighbours.get(entry.fact_id) or SegmentLines([(row["row_num"], row["fact"])], 0, 1)
        snippet = segment_snippet(
            lines.rows,
            row["row_num"],
            snippet_query,
            intent,
            first_line=lines.first_place,
            of_lines=lines.total,
        )
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
