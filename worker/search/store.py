"""The SQL of search: lexical (Postgres FTS) and vector (pgvector) lists, result rows, embeddings, accounting.

``SearchStore`` owns its transactions: every method opens (and ends) its own, so no transaction is
ever held open across an LLM call. The module's functions that take a ``Session`` are the SQL the
store runs inside them; ``vector_search_status`` is also public for callers that hold a session,
and like the others it never commits.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from typing import Any

from sqlalchemy import Row, RowMapping, bindparam, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker

from models.packed import PackedFloats
from models.reads import read_only
from worker.accounting import Ledger, LLMCallRecord
from worker.consolidation.history import Lifecycle
from worker.core.embeddings import dimensions_problem, vector_literal, version_tuple
from worker.core.fusion import Hit
from worker.core.lexing import (
    BM25_B,
    BM25_K1,
    CONTEXT_ONLY_WEIGHT,
    TYPICAL_FACT_LEXEMES,
    LexItem,
    LexUnit,
    idf,
    lex_items,
    lex_units,
    normalise_score,
    parse_lex_query,
    rarest_first,
)
from worker.db import statement_timed_out
from worker.search.errors import UNAVAILABLE_NO_EXTENSION, UNAVAILABLE_NOT_SET_UP, SearchError
from worker.search.values import HNSW_EF_SEARCH, SearchFilters, VectorSearchStatus
from worker.search.vector_ddl import VECTOR_STORE_DDL

__all__ = ["FactToEmbed", "LineQuery", "SearchStore", "vector_search_status"]

# Document frequencies are counted exactly up to this many rows; above it the planner's estimate
# (from the column statistics) is used, so a very common term never costs a long count.
DF_EXACT_CAP = 1000
SMALL_TABLE_ROWS = 10_000
# Each statement of a lexical search stops after this (a search at a million facts takes tens of ms): a
# query that would score the whole table many times over is refused (400), not left to hold a
# connection and a core while the reader's next requests queue behind it.
LEX_STATEMENT_TIMEOUT = "5s"
# Facts either side of a result (same page, same segment) that its snippet may show.
SNIPPET_NEIGHBOURS = 3

# A search line as the store runs it: the text of a lex line, or the embedding of a vec/hyde line.
LineQuery = str | Sequence[float]
FactToEmbed = Row[Any]  # .id, .fact, .entity_slug

_STATUS = text(
    "SELECT to_regclass('search.fact_embeddings') IS NOT NULL, "
    "(SELECT extversion FROM pg_extension WHERE extname = 'vector'), "
    "EXISTS (SELECT 1 FROM pg_available_extensions WHERE name = 'vector')"
)
_PARSE_ITEMS = text(
    "SELECT u.i, CASE WHEN u.k = 'w' "
    "THEN array_to_string(tsvector_to_array(to_tsvector('simple', search_fold(u.t))), chr(31)) "
    "ELSE phraseto_tsquery('simple', search_fold(u.t))::text END "
    "FROM unnest(CAST(:kinds AS text[]), CAST(:texts AS text[])) WITH ORDINALITY AS u(k, t, i) "
    "ORDER BY u.i"
)
# Columns named as SearchResult's fields.
_RESULT_FACTS = text(
    "SELECT id AS fact_id, fact, kind, entity_slug AS entity, source_id, source_markdown_slug AS page_slug, "
    "context AS segment, row_num, confidence, notability, valid_from, "
    "status, valid_to, superseded_by, duplicate_of "
    "FROM facts WHERE id IN :ids AND NOT is_audit"
).bindparams(bindparam("ids", expanding=True))
# The neighbours a snippet quotes pass the search's own lifecycle clause ({lifecycle}): a superseded
# or duplicate line (or, as of a time, one not yet or no longer true) was quoted, and could be the
# line the snippet centred on.
_RESULT_NEIGHBOURS = (
    "SELECT r.id, n.row_num, n.fact FROM facts r JOIN facts n "
    "ON n.source_id = r.source_id AND n.source_markdown_slug = r.source_markdown_slug "
    "AND n.context = r.context AND NOT n.is_audit AND {lifecycle} "
    f"AND n.row_num BETWEEN r.row_num - {SNIPPET_NEIGHBOURS} AND r.row_num + {SNIPPET_NEIGHBOURS} "
    "WHERE r.id IN :ids ORDER BY r.id, n.row_num"
)
_TO_EMBED = (
    "SELECT id, fact, entity_slug FROM facts WHERE embedding IS NULL AND NOT is_audit AND {where} ORDER BY id"
)
_PAGES_TO_EMBED = text(
    _TO_EMBED.format(
        where="(source_id, source_markdown_slug) IN "
        "(SELECT * FROM unnest(CAST(:sources AS text[]), CAST(:slugs AS text[])))"
    )
)
# The vectors arrive end to end in one packed float8[] (models.packed): fact n's is its n-th slice.
_FILL_EMBEDDINGS = text(
    """
    UPDATE facts AS f SET embedding = (CAST(:vectors AS float8[]))[(v.n - 1) * :dim + 1 : v.n * :dim]
    FROM unnest(CAST(:ids AS bigint[])) WITH ORDINALITY AS v(id, n)
    WHERE f.id = v.id AND f.embedding IS NULL
    RETURNING f.id
    """
)


class SearchStore:
    """Search's database: each method runs in a transaction of its own.

    A read that sets transaction-local settings (the lexical query's planner switches, the vector
    query's ``hnsw.ef_search``) runs in a transaction that commits: a rollback would make psycopg
    forget every statement it prepared on the connection (see models.reads). Other reads run in
    autocommit (``read_only``).
    """

    def __init__(self, factory: sessionmaker[Session], ledger: Ledger) -> None:
        self._factory = factory
        self._ledger = ledger

    def status(self) -> VectorSearchStatus:
        with read_only(self._factory) as session:
            return vector_search_status(session)

    def enable_vector_search(self) -> VectorSearchStatus:
        """Create the pgvector store if the server has the extension and it is missing here (idempotent).

        Migration 0003 does this when it runs; this covers pgvector installed after the migration ran.
        """
        status = self.status()
        if status.available or status.reason == UNAVAILABLE_NO_EXTENSION:
            return status
        with self._factory.begin() as session:
            for statement in VECTOR_STORE_DDL:
                session.connection().exec_driver_sql(statement)
        return self.status()

    def lexical(self, query: str, filters: SearchFilters, limit: int) -> tuple[list[Hit], bool]:
        """(hits, whether they hold every word: False when words had to be dropped)."""
        with self._factory.begin() as session:  # commits: see the class docstring
            return _lexical(session, query, filters, limit)

    def search_lines(
        self, queries: Sequence[LineQuery], filters: SearchFilters, limit: int, extension_version: str
    ) -> list[list[Hit]]:
        """The hits of each line, in one transaction: lexical for a text, nearest facts for a vector."""
        with self._factory.begin() as session:  # commits: see the class docstring
            return [
                _lexical(session, query, filters, limit)[0]
                if isinstance(query, str)
                else _vector_search(session, query, filters, limit, extension_version)
                for query in queries
            ]

    def result_rows(
        self, ids: Sequence[int], lifecycle: Lifecycle | None = None
    ) -> tuple[dict[int, RowMapping], dict[int, list[tuple[int, str]]]]:
        """(each fact's row, named as SearchResult's fields; each fact's segment neighbours by row_num,
        those ``lifecycle`` lets through: the search's own)."""
        clause, params = (lifecycle or Lifecycle()).clause("n")
        neighbours_sql = text(_RESULT_NEIGHBOURS.format(lifecycle=clause or "TRUE")).bindparams(
            bindparam("ids", expanding=True)
        )
        with read_only(self._factory) as session:
            facts = {row["fact_id"]: row for row in session.execute(_RESULT_FACTS, {"ids": ids}).mappings()}
            neighbours: dict[int, list[tuple[int, str]]] = {}
            for result_id, row_num, fact in session.execute(neighbours_sql, {"ids": ids, **params}):
                neighbours.setdefault(result_id, []).append((row_num, fact))
        return facts, neighbours

    def facts_to_embed(self, *, after_id: int, limit: int) -> list[FactToEmbed]:
        """The next facts (audit rows excluded) with no embedding, in id order."""
        with read_only(self._factory) as session:
            sql = text(_TO_EMBED.format(where="id > :last") + " LIMIT :n")
            return list(session.execute(sql, {"last": after_id, "n": limit}).all())

    def pages_facts_to_embed(self, pages: Sequence[tuple[str, str]]) -> list[FactToEmbed]:
        """The facts with no embedding of these (source id, slug) pages, in id order (one query)."""
        if not pages:
            return []
        params = {"sources": [source for source, _ in pages], "slugs": [slug for _, slug in pages]}
        with read_only(self._factory) as session:
            return list(session.execute(_PAGES_TO_EMBED, params).all())

    def fill_embeddings(
        self, ids: Sequence[int], vectors: Sequence[Sequence[float]], *, call: LLMCallRecord | None = None
    ) -> int:
        """Store embeddings where a fact has none yet; returns how many were stored. ``call``, the
        embedding call that returned them, is recorded (costed by the ledger) in the same transaction."""
        if len(ids) != len(vectors):
            raise ValueError(f"{len(ids)} facts but {len(vectors)} embeddings")
        if not ids:
            return 0
        dim = len(vectors[0])
        if any(len(vector) != dim for vector in vectors):
            raise ValueError("the embeddings of one batch must all have the same number of dimensions")
        params = {"ids": list(ids), "dim": dim, "vectors": PackedFloats(chain.from_iterable(vectors))}
        with self._factory.begin() as session:
            if call is not None:
                self._ledger.record(session, call)
            # One statement for the whole batch (a round trip per fact made embedding dominate a worker's
            # time). Only fill a gap: a concurrent writer's embedding is as good as ours.
            return len(session.execute(_FILL_EMBEDDINGS, params).all())

    def record_llm_call(self, call: LLMCallRecord) -> None:
        """Account for a search-time LLM call in llm_calls, costed by the ledger (`llm.prices` applies)."""
        with self._factory.begin() as session:
            self._ledger.record(session, call)


def vector_search_status(session: Session) -> VectorSearchStatus:
    """Whether this database has the pgvector store (and, if not, why not)."""
    row = session.execute(_STATUS).one()
    if row[0] and row[1]:
        return VectorSearchStatus(True, row[1], None)
    return VectorSearchStatus(False, row[1], UNAVAILABLE_NOT_SET_UP if row[2] else UNAVAILABLE_NO_EXTENSION)


# --------------------------------------------------------------------------- filters


# SearchFilters field -> its clause; the value is bound as :f_<field>.
_FILTER_CLAUSES = (
    ("source_id", "{a}.source_id = :f_source_id"),
    ("entity", "{a}.entity_slug = :f_entity"),
    ("kind", "{a}.kind = :f_kind"),
    ("since", "COALESCE({a}.valid_from, {a}.created_at) >= :f_since"),
    ("source_ids", "{a}.source_id = ANY(:f_source_ids)"),
)


def _filter_sql(filters: SearchFilters, alias: str = "f") -> tuple[str, dict[str, Any]]:
    # Audit rows (the terminal EXTRACTION_COMPLETE markers) are bookkeeping: never a search result.
    clauses = [f"NOT {alias}.is_audit"]
    lifecycle, params = Lifecycle(filters.include_history, filters.as_of).clause(alias)
    if lifecycle is not None:
        clauses.append(lifecycle)
    for name, clause in _FILTER_CLAUSES:
        value = getattr(filters, name)
        if value is not None:
            clauses.append(clause.format(a=alias))
            params[f"f_{name}"] = list(value) if isinstance(value, tuple) else value
    return " AND ".join(clauses), params


# --------------------------------------------------------------------------- lexical search


def _lexical(session: Session, query: str, filters: SearchFilters, limit: int) -> tuple[list[Hit], bool]:
    """Facts matching ``query``, best first, with scores in [0, 1), and whether they hold every word.

    Facts holding every word and phrase come first. When no fact holds them all, words no fact
    holds are dropped, then the most common word, then the next, until some fact matches (the
    rarer words say more); a dropped word still adds to the score of the facts that hold it.
    """
    items = lex_items(parse_lex_query(query))
    units, excluded = lex_units(items, _parse_items(session, items)) if items else ([], [])
    if not units:
        return [], True
    # The planner prices a tsvector match like any operator and so prefers a sequential scan once a
    # term is in a few percent of the rows; the GIN bitmap scan is several times faster there.
    # Disabling a scan only adds a huge cost to it, and a statement that must scan anyway (counting a
    # small table's facts) then looks costly enough to JIT-compile: about 27 ms a search on a small
    # table, where the whole search takes 9. So JIT goes off with it.
    seqscan, jit, timeout = session.execute(
        text(
            "SELECT current_setting('enable_seqscan'), current_setting('jit'), "
            "current_setting('statement_timeout'), set_config('enable_seqscan', 'off', true), "
            "set_config('jit', 'off', true), set_config('statement_timeout', :limit, true)"
        ),
        {"limit": LEX_STATEMENT_TIMEOUT},
    ).one()[:3]
    try:
        hits = _ranked_matches(session, units, excluded, filters, limit)
    except DBAPIError as exc:  # the transaction is aborted, and its local settings with it
        if statement_timed_out(exc):
            raise SearchError(
                f"the lexical search ran past its {LEX_STATEMENT_TIMEOUT} limit; search for fewer or "
                "rarer words"
            ) from exc
        raise
    session.execute(
        text(
            "SELECT set_config('enable_seqscan', :seqscan, true), set_config('jit', :jit, true), "
            "set_config('statement_timeout', :timeout, true)"
        ),
        {"seqscan": seqscan, "jit": jit, "timeout": timeout},
    )
    return hits


def _parse_items(session: Session, items: Sequence[LexItem]) -> list[str | None]:
    """Each item through Postgres's own parser and accent folding (so "v1.2" or "alice-smith" split,
    and "Zoë" folds, exactly as the indexed text did): a word's lexemes joined by chr(31), a phrase's
    tsquery text."""
    rows = session.execute(
        _PARSE_ITEMS, {"kinds": [item.kind for item in items], "texts": [item.text for item in items]}
    ).all()
    return [value for _, value in rows]


def _document_frequencies(session: Session, units: Sequence[LexUnit]) -> tuple[list[float], float]:
    """(df of each unit, number of facts).

    On a small table every df is counted. On a large one the planner's estimate (from the column
    statistics ANALYZE keeps) stands for common units, and only units it expects to be rare are
    counted, so a common word never costs a long count.
    """
    estimated_rows = float(
        session.scalar(text("SELECT reltuples FROM pg_class WHERE oid = 'facts'::regclass")) or -1
    )
    small = estimated_rows < SMALL_TABLE_ROWS
    if small:
        total = float(session.scalar(text("SELECT count(*) FROM facts WHERE NOT is_audit")) or 0)
    else:
        total = estimated_rows
    dfs: list[float] = []
    to_count: list[int] = []
    for i, unit in enumerate(units):
        if small:
            dfs.append(0.0)
            to_count.append(i)
            continue
        plan = session.execute(
            text("EXPLAIN (FORMAT JSON) SELECT 1 FROM facts WHERE search_vector @@ CAST(:q AS tsquery)"),
            {"q": unit.match},
        ).scalar_one()
        estimate = float(plan[0]["Plan"]["Plan Rows"]) if isinstance(plan, list) else 0.0
        dfs.append(estimate)
        if estimate <= DF_EXACT_CAP:
            to_count.append(i)
    if to_count:
        cap = SMALL_TABLE_ROWS if small else DF_EXACT_CAP  # a small table's counts are all exact
        parts = [
            f"(SELECT count(*) FROM (SELECT 1 FROM facts WHERE search_vector @@ CAST(:q{i} AS tsquery) "
            f"AND NOT is_audit LIMIT {cap}) s{i})"
            for i in to_count
        ]
        counts = session.execute(
            text(f"SELECT {', '.join(parts)}"), {f"q{i}": units[i].match for i in to_count}
        ).one()
        for i, count in zip(to_count, counts, strict=True):
            dfs[i] = float(count) if count < cap else max(float(count), dfs[i])
    return dfs, max(total, max(dfs, default=0.0), 1.0)


def _visible_units(
    session: Session, units: Sequence[LexUnit], where: str, params: dict[str, Any]
) -> list[bool]:
    """Whether each unit is in some fact the search's filters let through (one query: an EXISTS each)."""
    if not units:
        return []
    parts = [
        f"EXISTS (SELECT 1 FROM facts f WHERE f.search_vector @@ CAST(:seen{i} AS tsquery) AND {where})"
        for i in range(len(units))
    ]
    row = session.execute(
        text(f"SELECT {', '.join(parts)}"), params | {f"seen{i}": unit.match for i, unit in enumerate(units)}
    ).one()
    return [bool(value) for value in row]


def _f8(value: float) -> str:
    return f"CAST({float(value)!r} AS float8)"


def _ranking_statements(
    units: Sequence[LexUnit], dfs: Sequence[float], total: float, where: str, params: dict[str, Any]
) -> tuple[Any, Any]:
    """(the ranked query through the index, the one a rare word drives), their unit parameters added to
    ``params``: each unit's idf-weighted match, exact words over prefixes, with BM25's length norm."""
    terms = []
    for i, unit in enumerate(units):
        params[f"strong{i}"] = unit.strong
        params[f"match{i}"] = unit.match
        params[f"idf{i}"] = idf(dfs[i], total)
        terms.append(
            f"(CAST(:idf{i} AS float8) * CASE WHEN f.search_vector @@ CAST(:strong{i} AS tsquery) "
            f"THEN {_f8(1.0)} WHEN f.search_vector @@ CAST(:match{i} AS tsquery) "
            f"THEN {_f8(CONTEXT_ONLY_WEIGHT)} ELSE {_f8(0.0)} END)"
        )
    length_norm = (
        f"({_f8(BM25_K1 + 1)} / ({_f8(1.0)} + {_f8(BM25_K1)} * ({_f8(1.0 - BM25_B)} + {_f8(BM25_B)} * "
        f"length(f.search_vector) / {_f8(TYPICAL_FACT_LEXEMES)})))"
    )
    scored = f"SELECT f.id, ({' + '.join(terms)}) * {length_norm} AS raw"
    ranking = "ORDER BY raw DESC, f.id LIMIT :limit"
    indexed = text(
        f"{scored} FROM facts f WHERE f.search_vector @@ CAST(:match AS tsquery) AND {where} {ranking}"
    )
    # A rare word drives: its few facts come through the index and the other words are checked on
    # each, instead of the index intersecting the common words' long posting lists (GIN merges a
    # prefix's lists in full: its fast scan skips only exact entries).
    driven = text(
        f"WITH driving AS MATERIALIZED (SELECT f.id, f.search_vector FROM facts f "
        f"WHERE f.search_vector @@ CAST(:drive AS tsquery) AND {where}) "
        f"{scored} FROM driving f WHERE f.search_vector @@ CAST(:match AS tsquery) {ranking}"
    )
    return indexed, driven


def _ranked_matches(
    session: Session, units: list[LexUnit], excluded: list[str], filters: SearchFilters, limit: int
) -> tuple[list[Hit], bool]:
    """The ranked search of ``_lexical``, exact words first.

    Facts holding the exact words are ranked first; only when they do not fill ``limit`` does the search
    widen to prefixes ("meet" finds "meetings"). Scores are the same either way (a prefix still counts
    in the score), so the exact pass answers the prefix search's ranking less the facts that hold only
    a longer word. A broad prefix (in a million facts, one word's prefix matched 59,196 of them) is
    then ranked only when the exact word is too rare to fill the list.
    """
    dfs, total = _document_frequencies(session, units)
    where, params = _filter_sql(filters)
    params["limit"] = limit
    indexed, driven = _ranking_statements(units, dfs, total, where, params)
    negation = "".join(f" & {x}" for x in excluded)
    order = rarest_first(dfs)

    def ranked(kept: list[int], exact: bool) -> list[Any]:
        matches = {i: units[i].exact if exact and units[i].exact else units[i].match for i in kept}
        match = " & ".join(matches.values()) + negation
        rarest = min(kept, key=lambda i: dfs[i])
        if len(kept) > 1 and dfs[rarest] < DF_EXACT_CAP:  # counted: at most DF_EXACT_CAP facts
            return list(session.execute(driven, params | {"match": match, "drive": matches[rarest]}))
        return list(session.execute(indexed, params | {"match": match}))

    def answer(keep: int, prefix_rows: list[Any] | None = None) -> list[Any]:
        """The rows of the rarest ``keep`` units: exact words first when they fill the list."""
        kept = sorted(order[:keep])
        if any(units[i].exact for i in kept):
            rows = ranked(kept, exact=True)
            if len(rows) >= limit:
                return rows
        return prefix_rows if prefix_rows is not None else ranked(kept, exact=False)

    # A unit no fact holds (df 0, counted) matches nothing with any others: they go first, all at once.
    present = sum(df > 0 for df in dfs)
    rows = answer(present) if present else []
    if rows or present == 0:
        return [Hit(row[0], normalise_score(row[1])) for row in rows], bool(rows) and present == len(units)
    # Nothing holds them all: from here on only the units some fact the caller may see holds, under
    # its filters (source, lifecycle, as_of, entity...). By the table-wide counts a word found only in
    # superseded facts, or only in another source, counted as present; halving kept it (the rarest) in
    # every try and the answer was empty, while a word found nowhere was dropped: an empty answer told
    # a key limited to one source that the word was in another's facts.
    visible = _visible_units(session, units, where, params)
    order = [i for i in order if visible[i]]
    tried_all = len(order) == present  # the first try held every visible unit (no hidden one)
    present = len(order)
    if present <= 1:
        rows = answer(present) if present else []
        return [Hit(row[0], normalise_score(row[1])) for row in rows], False
    # Dropping a unit only widens the match, so the most units that still match are found by halving:
    # a line of hundreds of words costs a few queries, not one (or two) a word.
    keep, found, low, high = 0, [], 1, present - 1 if tried_all else present
    while low <= high:
        middle = (low + high) // 2
        middle_rows = ranked(sorted(order[:middle]), exact=False)
        if middle_rows:
            keep, found, low = middle, middle_rows, middle + 1
        else:
            high = middle - 1
    rows = answer(keep, found) if keep else []
    return [Hit(row[0], normalise_score(row[1])) for row in rows], False


# --------------------------------------------------------------------------- vector search


def _vector_search(
    session: Session, vector: Sequence[float], filters: SearchFilters, limit: int, extension_version: str
) -> list[Hit]:
    """Nearest facts by cosine distance (HNSW), with scores 1 - distance clamped to [0, 1]."""
    problem = dimensions_problem([vector])
    if problem:
        raise SearchError(problem)
    where, params = _filter_sql(filters)
    # Filters are applied after the index scan: look at enough neighbours that a filtered search
    # still fills its list (pgvector >= 0.8 keeps scanning on its own with iterative scans).
    ef_search = min(1000, max(HNSW_EF_SEARCH, limit * 4))
    session.execute(text("SELECT set_config('hnsw.ef_search', :ef, true)"), {"ef": str(ef_search)})
    if version_tuple(extension_version) >= (0, 8):
        session.execute(text("SELECT set_config('hnsw.iterative_scan', 'relaxed_order', true)"))
    params |= {"qv": vector_literal(vector), "limit": limit}
    # ORDER BY the distance alone: the HNSW index can only yield that order, and any second sort key
    # (a tie-break on f.id) makes the planner scan and sort every vector instead (bench/search.py).
    # Ties are broken below, after the fetch.
    rows = session.execute(
        text(
            "SELECT f.id, e.embedding <=> CAST(:qv AS vector) AS distance "
            "FROM search.fact_embeddings e JOIN facts f ON f.id = e.fact_id "
            f"WHERE {where} ORDER BY e.embedding <=> CAST(:qv AS vector) LIMIT :limit"
        ),
        params,
    ).all()
    # Orthogonal or opposite vectors share nothing with the query: not a hit, however near in rank.
    hits = [Hit(row[0], min(1.0, 1.0 - float(row[1]))) for row in rows if float(row[1]) < 1.0]
    # relaxed_order may return neighbours slightly out of order.
    hits.sort(key=lambda h: (-h.score, h.fact_id))
    return hits
