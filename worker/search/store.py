"""The SQL of search: lexical (Postgres FTS) and vector (pgvector) lists, result rows, embeddings, accounting.

``SearchStore`` owns its transactions: every method opens (and ends) its own, so no transaction is
ever held open across an LLM call. The module's functions that take a ``Session`` are the SQL the
store runs inside them; ``vector_search_status`` is also public for callers that hold a session,
and like the others it never commits.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

from sqlalchemy import Row, RowMapping, bindparam, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker

from models.packed import PackedFloats
from models.reads import read_only
from worker.accounting import Ledger, LLMCallRecord
from worker.consolidation.history import Lifecycle
from worker.core.embeddings import vector_literal, vectors_problem, version_tuple
from worker.core.fusion import Hit
from worker.db import made_again_on_deadlock, statement_timed_out
from worker.search.errors import UNAVAILABLE_NO_EXTENSION, UNAVAILABLE_NOT_SET_UP, SearchError
from worker.search.lexical import filter_sql, lexical_search
from worker.search.values import HNSW_EF_SEARCH, Deadline, SearchFilters, VectorSearchStatus
from worker.search.vector_ddl import VECTOR_STORE_DDL

__all__ = ["FactToEmbed", "LineQuery", "SearchStore", "SegmentLines", "vector_search_status"]

# Facts either side of a result (same page, same segment) that its snippet may show.
SNIPPET_NEIGHBOURS = 3


@dataclass
class SegmentLines:
    """A result's neighbours in its segment ((row_num, fact), in order), the first one's place among the
    segment's facts (0: the first) and how many facts the segment shows in all."""

    rows: list[tuple[int, str]]
    first_place: int
    total: int


# A search line as the store runs it: the text of a lex line, or the embedding of a vec/hyde line.
LineQuery = str | Sequence[float]
FactToEmbed = Row[Any]  # .id, .fact, .entity_slug

_STATUS = text(
    "SELECT to_regclass('search.fact_embeddings') IS NOT NULL, "
    "(SELECT extversion FROM pg_extension WHERE extname = 'vector')"
)
# Asked only when the store is missing: pg_available_extensions reads every extension's control file
# from the server's disk, and every search asked it.
_INSTALLABLE = text("SELECT EXISTS (SELECT 1 FROM pg_available_extensions WHERE name = 'vector')")
# The results read again pass the search's lifecycle clause ({lifecycle}) too: a fact superseded while
# the search waited on the LLM (seconds) came back marked superseded in a search of current facts.
_RESULT_FACTS = (
    "SELECT id AS fact_id, fact, kind, entity_slug AS entity, source_id, source_markdown_slug AS page_slug, "
    "context AS segment, row_num, confidence, notability, valid_from, "
    "status, valid_to, superseded_by, duplicate_of "
    "FROM facts WHERE id IN :ids AND NOT is_audit AND {lifecycle}"
)
# A segment's facts are one reply's (at most 10), written together under consecutive row numbers: a
# result's are read within SEGMENT_SPAN rows either side (the page's unique key bounds the scan; a page
# of 4,000 segments has 20,000 facts).
SEGMENT_SPAN = 100
# The neighbours a snippet quotes pass the search's own lifecycle clause ({lifecycle}): a superseded
# or duplicate line (or, as of a time, one not yet or no longer true) was quoted, and could be the
# line the snippet centred on. With each its place among the segment's facts the clause lets through,
# and their count: a snippet's lines count from the start of its segment (qmd's rule), not from the
# window read (one fact had two line numbers in two results of one segment).
_RESULT_NEIGHBOURS = (
    "SELECT id, row_num, fact, place, total FROM (SELECT r.id, r.row_num AS own, n.row_num, n.fact, "
    "row_number() OVER (PARTITION BY r.id ORDER BY n.row_num) - 1 AS place, "
    "count(*) OVER (PARTITION BY r.id) AS total FROM facts r JOIN facts n "
    "ON n.source_id = r.source_id AND n.source_markdown_slug = r.source_markdown_slug "
    f"AND n.row_num BETWEEN r.row_num - {SEGMENT_SPAN} AND r.row_num + {SEGMENT_SPAN} "
    "AND n.context = r.context AND NOT n.is_audit AND {lifecycle} WHERE r.id IN :ids) AS segment "
    f"WHERE row_num BETWEEN own - {SNIPPET_NEIGHBOURS} AND own + {SNIPPET_NEIGHBOURS} ORDER BY id, row_num"
)
_TO_EMBED = (
    "SELECT id, fact, entity_slug FROM facts WHERE embedding IS NULL AND NOT is_audit AND {where} ORDER BY id"
)
_STILL_UNEMBEDDED = text("SELECT id FROM facts WHERE id = ANY(CAST(:ids AS bigint[])) AND embedding IS NULL")
_LATE_PAGES = text(
    "SELECT DISTINCT source_id, source_markdown_slug FROM (SELECT source_id, source_markdown_slug FROM facts"
    " WHERE embedding IS NULL AND NOT is_audit AND created_at < now() - make_interval(secs => :grace)"
    " AND created_at > now() - make_interval(secs => :window) ORDER BY created_at LIMIT :scan) AS late"
    " ORDER BY 1, 2"
)
# Every fact again, but those the current model already made (known after the first call: a --reembed
# run stopped part way starts over at the first fact, then skips what it did).
_TO_REEMBED = (
    "SELECT id, fact, entity_slug FROM facts WHERE NOT is_audit AND id > :last "
    "AND (CAST(:model AS text) IS NULL OR embedding_model IS DISTINCT FROM :model) ORDER BY id LIMIT :n"
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
    UPDATE facts AS f SET embedding = (CAST(:vectors AS float8[]))[(v.n - 1) * :dim + 1 : v.n * :dim],
        embedding_model = :model
    FROM unnest(CAST(:ids AS bigint[])) WITH ORDINALITY AS v(id, n)
    WHERE f.id = v.id AND (f.embedding IS NULL OR :replace)
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

    def __init__(self, factory: sessionmaker[Session], ledger: Ledger, *, bounded: bool = False) -> None:
        self._factory = factory
        self._ledger = ledger
        self._bounded = bounded  # each read's statements end within values.SEARCH_SECONDS

    def bounded(self) -> SearchStore:
        """This store for a search: each read (the probe; every line together) ends within
        SEARCH_SECONDS, or raises DeadlineExceededError."""
        return SearchStore(self._factory, self._ledger, bounded=True)

    def _deadline(self) -> Deadline | None:
        return Deadline.after() if self._bounded else None

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
            return lexical_search(session, query, filters, limit, self._deadline())

    def search_lines(
        self,
        queries: Sequence[LineQuery],
        filters: SearchFilters,
        limit: int,
        extension_version: str,
        model: str | None = None,
    ) -> list[list[Hit]]:
        """The hits of each line, in one transaction: lexical for a text, nearest facts for a vector."""
        deadline = self._deadline()
        with self._factory.begin() as session:  # commits: see the class docstring
            return [
                lexical_search(session, query, filters, limit, deadline)[0]
                if isinstance(query, str)
                else _vector_search(session, query, filters, limit, extension_version, model, deadline)
                for query in queries
            ]

    def result_rows(
        self, ids: Sequence[int], lifecycle: Lifecycle | None = None
    ) -> tuple[dict[int, RowMapping], dict[int, SegmentLines]]:
        """(each fact's row, named as SearchResult's fields; each fact's segment neighbours by row_num,
        those ``lifecycle`` lets through: the search's own, with their place in the segment)."""
        lifecycle = lifecycle or Lifecycle()
        clause, params = lifecycle.clause("n")
        neighbours_sql = text(_RESULT_NEIGHBOURS.format(lifecycle=clause or "TRUE")).bindparams(
            bindparam("ids", expanding=True)
        )
        facts_sql = text(_RESULT_FACTS.format(lifecycle=lifecycle.clause("facts")[0] or "TRUE")).bindparams(
            bindparam("ids", expanding=True)
        )
        with read_only(self._factory) as session:
            facts = {
                row["fact_id"]: row for row in session.execute(facts_sql, {"ids": ids, **params}).mappings()
            }
            neighbours: dict[int, SegmentLines] = {}
            for result_id, row_num, fact, place, total in session.execute(
                neighbours_sql, {"ids": ids, **params}
            ):
                lines = neighbours.setdefault(result_id, SegmentLines([], place, total))
                lines.rows.append((row_num, fact))
        return facts, neighbours

    def facts_to_embed(
        self, *, after_id: int, limit: int, every: bool = False, model: str | None = None
    ) -> list[FactToEmbed]:
        """The next facts (audit rows excluded) with no embedding (``every``: embedded or not, but not
        by ``model``), in id order."""
        with read_only(self._factory) as session:
            sql = text(_TO_REEMBED if every else _TO_EMBED.format(where="id > :last") + " LIMIT :n")
            return list(session.execute(sql, {"last": after_id, "n": limit, "model": model}).all())

    def count_facts_to_embed(self, *, every: bool = False) -> int:
        """How many facts ``facts_to_embed`` would go through (``every``: every fact: at most)."""
        missing = "" if every else " AND embedding IS NULL"
        with read_only(self._factory) as session:
            return int(session.scalar(text(f"SELECT count(*) FROM facts WHERE NOT is_audit{missing}")) or 0)

    def still_unembedded(self, fact_ids: Iterable[int]) -> set[int]:
        """Which of ``fact_ids`` still exist without an embedding: an erasure removes a page's facts
        under its embedding, and another embedder (the sweep's hand-off beside a slow follow-up in
        another process) may have filled them since they were read (its vectors kept, a second call
        for them was paid for nothing)."""
        wanted = sorted(set(fact_ids))
        if not wanted:
            return set()
        with read_only(self._factory) as session:
            return {row[0] for row in session.execute(_STILL_UNEMBEDDED, {"ids": wanted})}

    def pages_facts_to_embed(self, pages: Sequence[tuple[str, str]]) -> list[FactToEmbed]:
        """The facts with no embedding of these (source id, slug) pages, in id order (one query)."""
        if not pages:
            return []
        params = {"sources": [source for source, _ in pages], "slugs": [slug for _, slug in pages]}
        with read_only(self._factory) as session:
            return list(session.execute(_PAGES_TO_EMBED, params).all())

    def late_pages(self, *, grace_seconds: float, window_seconds: float, scan: int) -> list[tuple[str, str]]:
        """(source id, slug) of the pages of the facts stored between ``window_seconds`` and
        ``grace_seconds`` ago still without an embedding, the oldest ``scan`` of them
        (ix_facts_unembedded): what an embedding follow-up left out."""
        params = {"grace": grace_seconds, "window": window_seconds, "scan": scan}
        with read_only(self._factory) as session:
            return [(row[0], row[1]) for row in session.execute(_LATE_PAGES, params)]

    def fill_embeddings(
        self,
        ids: Sequence[int],
        vectors: Sequence[Sequence[float]],
        *,
        model: str,
        call: LLMCallRecord | None = None,
        replace: bool = False,
    ) -> int:
        """Store embeddings of ``model`` where a fact has none yet (``replace``: in place of any);
        returns how many were stored. ``call``, the embedding call that returned them, is recorded
        (costed by the ledger) in the same transaction."""
        if len(ids) != len(vectors):
            raise ValueError(f"{len(ids)} facts but {len(vectors)} embeddings")
        if not ids:
            return 0
        dim = len(vectors[0])
        if any(len(vector) != dim for vector in vectors):
            raise ValueError("the embeddings of one batch must all have the same number of dimensions")
        params = {
            "ids": list(ids),
            "dim": dim,
            "vectors": PackedFloats(chain.from_iterable(vectors)),
            "model": model,
            "replace": replace,
        }

        def fill() -> int:
            with self._factory.begin() as session:
                if call is not None:
                    self._ledger.record(session, call)
                # One statement for the whole batch (a round trip per fact made embedding dominate a
                # worker's time). Only fill a gap: a concurrent writer's embedding is as good as ours.
                return len(session.execute(_FILL_EMBEDDINGS, params).all())

        # Its facts are locked in the join's order, not an entity's: against a consolidation commit or an
        # erasure taking some of them the other way round, Postgres could end it (`factmill embed`
        # aborted, a follow-up's vectors were lost). Made again: the vectors are in hand, nothing is asked
        # of the model twice.
        return made_again_on_deadlock(fill)

    def record_llm_call(self, call: LLMCallRecord) -> None:
        """Account for a search-time LLM call in llm_calls, costed by the ledger (`llm.prices` applies)."""
        with self._factory.begin() as session:
            self._ledger.record(session, call)


# Whether pgvector could be installed, by server, for a minute: on a lexical-only deployment the store is
# always missing, and every search read every extension's control file to say why.
INSTALLABLE_SECONDS = 60.0
_installable: dict[str, tuple[float, bool]] = {}


def vector_search_status(session: Session) -> VectorSearchStatus:
    """Whether this database has the pgvector store (and, if not, why not)."""
    set_up, version = session.execute(_STATUS).one()
    if set_up and version:
        return VectorSearchStatus(True, version, None)
    server = session.get_bind().engine.url.render_as_string(hide_password=True)
    known = _installable.get(server)
    if known is None or time.monotonic() - known[0] > INSTALLABLE_SECONDS:
        known = (time.monotonic(), bool(session.scalar(_INSTALLABLE)))
        _installable[server] = known
    installable = known[1]
    return VectorSearchStatus(
        False, version, UNAVAILABLE_NOT_SET_UP if installable else UNAVAILABLE_NO_EXTENSION
    )


# --------------------------------------------------------------------------- vector search


def _vector_search(
    session: Session,
    vector: Sequence[float],
    filters: SearchFilters,
    limit: int,
    extension_version: str,
    model: str | None = None,
    deadline: Deadline | None = None,
) -> list[Hit]:
    """Nearest facts by cosine distance (HNSW), with scores 1 - distance clamped to [0, 1]: among the
    facts whose vector ``model`` made (or whose model was not kept); another model's vectors are not
    comparable, whatever their dimension."""
    problem = vectors_problem([vector])
    if problem:
        raise SearchError(problem)
    try:
        return _nearest(session, vector, filters, limit, extension_version, model, deadline)
    except DBAPIError as exc:
        if deadline is not None and statement_timed_out(exc):
            raise deadline.passed() from exc
        raise


# The exact read's own limit where the search has none (the CLI, a test): over a large store it is a
# scan and a sort of every vector the filters keep.
EXACT_STATEMENT_TIMEOUT_MS = 5_000
# The two settings the exact read changes, set (and put back) in one statement.
_SETTINGS = text("SELECT set_config('statement_timeout', :t, true), set_config('enable_indexscan', :i, true)")


def _exactly(session: Session, nearest: Any, params: dict[str, Any], deadline: Deadline | None) -> list[Any]:
    """``nearest`` without the index (the filters' own indexes, then a sort): exact over the facts the
    filters keep. In a savepoint, with half the search's time left (or EXACT_STATEMENT_TIMEOUT_MS): one
    that runs out answers nothing and leaves the transaction, and the rest of the search, as they were."""
    if deadline is not None:
        deadline.check()
    budget = EXACT_STATEMENT_TIMEOUT_MS if deadline is None else max(1, deadline.remaining_ms() // 2)
    prior = session.execute(
        text("SELECT current_setting('statement_timeout'), current_setting('enable_indexscan')")
    ).one()
    savepoint = session.begin_nested()
    rows: list[Any] = []
    try:
        session.execute(_SETTINGS, {"t": f"{budget}ms", "i": "off"})
        rows = list(session.execute(nearest, params).all())
        # Put back and released, not rolled back: a rollback (even to a savepoint) makes psycopg forget
        # the connection's prepared statements, and every later statement was planned again.
        session.execute(_SETTINGS, {"t": prior[0], "i": prior[1]})
    except DBAPIError as exc:
        savepoint.rollback()  # (its settings go with it; the rows read before a failed restore are kept)
        if not statement_timed_out(exc):
            raise
        return rows
    savepoint.commit()
    return rows


def _nearest(
    session: Session,
    vector: Sequence[float],
    filters: SearchFilters,
    limit: int,
    extension_version: str,
    model: str | None,
    deadline: Deadline | None,
) -> list[Hit]:
    if deadline is not None:
        deadline.check()
        timeout = f"{deadline.remaining_ms()}ms"
        session.execute(text("SELECT set_config('statement_timeout', :t, true)"), {"t": timeout})
    where, params = filter_sql(filters)
    # Filters are applied after the index scan: look at enough neighbours that a filtered search
    # still fills its list (pgvector >= 0.8 keeps scanning on its own with iterative scans).
    ef_search = min(1000, max(HNSW_EF_SEARCH, limit * 4))
    session.execute(text("SELECT set_config('hnsw.ef_search', :ef, true)"), {"ef": str(ef_search)})
    iterative = version_tuple(extension_version) >= (0, 8)
    if iterative:
        session.execute(text("SELECT set_config('hnsw.iterative_scan', 'relaxed_order', true)"))
    params |= {"qv": vector_literal(vector), "limit": limit, "model": model}
    where += " AND (f.embedding_model IS NULL OR CAST(:model AS text) IS NULL OR f.embedding_model = :model)"
    # ORDER BY the distance alone: the HNSW index can only yield that order, and any second sort key
    # (a tie-break on f.id) makes the planner scan and sort every vector instead (bench/search.py).
    # Ties are broken below, after the fetch.
    nearest = text(
        "SELECT f.id, e.embedding <=> CAST(:qv AS vector) AS distance "
        "FROM search.fact_embeddings e JOIN facts f ON f.id = e.fact_id "
        f"WHERE {where} ORDER BY e.embedding <=> CAST(:qv AS vector) LIMIT :limit"
    )
    rows = session.execute(nearest, params).all()
    if len(rows) < limit and not iterative:
        # Before pgvector 0.8 the index yields its ef_search nearest and no more: a filter keeping a few
        # percent of the facts (one source of many) found few of them, or none.
        rows = _exactly(session, nearest, params, deadline) or rows
    # Orthogonal or opposite vectors share nothing with the query: not a hit, however near in rank.
    hits = [Hit(row[0], min(1.0, 1.0 - float(row[1]))) for row in rows if float(row[1]) < 1.0]
    # relaxed_order may return neighbours slightly out of order.
    hits.sort(key=lambda h: (-h.score, h.fact_id))
    return hits
