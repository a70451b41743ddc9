"""Vector and fused search at scale for bench/search.py: embeddings loaded with COPY, the HNSW index built
and sized, and every figure against the exact answer of a sequential scan (recall@10).

The facts get the simulator's embeddings (``worker.simulator.embeddings.embed_text`` of
``fact_embedding_text``, what ``factmill embed`` stores against the simulator), computed here, not over
HTTP, and written straight into ``search.fact_embeddings`` with COPY while the HNSW index is dropped;
the index is then built once and timed. Queries embed the same way.

The exact answer runs the very same SQL on connections with ``enable_indexscan = off``: the HNSW index
can only be used by an index scan, so the planner falls back to a sequential scan and a sort, while the
GIN index of the lexical lists (a bitmap scan) stays in use. Recall@10 is the share of the exact top 10
found in the indexed top 10. The embeddings are hashed bags of words, so equal distances are common; a
result at the exact 10th distance is as right as the one the scan happened to list, hence also the
tie-aware recall (results no farther than the exact 10th neighbour).
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from sqlalchemy import event, text
from sqlalchemy.orm import Session, sessionmaker

from worker import db
from worker.core.embeddings import fact_embedding_text
from worker.llm.types import ChatRequest, ChatResponse, EmbeddingResponse, LLMClient
from worker.search import search, vector_search_status
from worker.search.values import MIN_CANDIDATES, SearchFilters
from worker.simulator.embeddings import embed_text

HNSW_INDEX = "search.fact_embeddings_hnsw"


def vector_literal(vector: Sequence[float]) -> str:
    return "[" + ",".join("0" if v == 0.0 else f"{v:.6g}" for v in vector) + "]"


def load_embeddings(dsn: str, index_ddl: str) -> dict[str, float]:
    """Embed every fact, COPY the vectors in without the HNSW index, then build it: seconds and bytes."""
    figures: dict[str, float] = {}
    started = time.perf_counter()
    buffer = io.StringIO()
    with psycopg.connect(dsn) as conn:
        for fact_id, fact, entity in conn.execute("SELECT id, fact, entity_slug FROM facts ORDER BY id"):
            buffer.write(f"{fact_id}\t{vector_literal(embed_text(fact_embedding_text(fact, entity)))}\n")
        figures["embed_s"] = time.perf_counter() - started
        started = time.perf_counter()
        conn.execute(f"DROP INDEX IF EXISTS {HNSW_INDEX}")
        with conn.cursor().copy("COPY search.fact_embeddings (fact_id, embedding) FROM STDIN") as copy:
            copy.write(buffer.getvalue())
        conn.commit()
        figures["copy_s"] = time.perf_counter() - started
        conn.execute("SET maintenance_work_mem = '2GB'")
        started = time.perf_counter()
        conn.execute(index_ddl)
        conn.commit()
        figures["build_s"] = time.perf_counter() - started
        conn.autocommit = True
        conn.execute("VACUUM ANALYZE search.fact_embeddings")
        # Settle before measuring: the build leaves gigabytes of new pages for the checkpointer to
        # write, and the queries that follow would otherwise be timed against that write-out.
        try:
            conn.execute("CHECKPOINT")
        except psycopg.errors.InsufficientPrivilege:
            print("note: no CHECKPOINT (it needs superuser or pg_checkpoint); the queries may be slower")
        row = conn.execute(
            f"SELECT pg_relation_size('{HNSW_INDEX}'), pg_relation_size('search.fact_embeddings'), "
            "pg_size_bytes(current_setting('shared_buffers'))"
        ).fetchone()
        figures["index_bytes"], figures["table_bytes"], figures["shared_buffers"] = row if row else (0, 0, 0)
    return figures


def exact_factory(url: str) -> sessionmaker[Session]:
    """Sessions on which no index scan runs: the vector lists become sequential scans and sorts."""
    engine = db.get_engine(url + ("&" if "?" in url else "?") + "application_name=bench-exact")

    @event.listens_for(engine, "connect")
    def _no_index_scans(dbapi_connection: Any, _record: Any) -> None:
        with dbapi_connection.cursor() as cursor:
            cursor.execute("SET enable_indexscan = off")
        dbapi_connection.commit()

    return sessionmaker(engine, expire_on_commit=False)


@dataclass(frozen=True)
class Recall:
    strict: float  # share of the exact top 10 ids found
    tied: float  # share of the indexed top 10 no farther than the exact 10th neighbour


def recall_at_10(found: Sequence[tuple[int, float]], exact: Sequence[tuple[int, float]]) -> Recall:
    exact10, found10 = exact[:10], found[:10]
    if not exact10:
        return Recall(1.0, 1.0)
    strict = len({i for i, _ in found10} & {i for i, _ in exact10}) / len(exact10)
    bound = exact10[-1][1] + 1e-9
    tied = min(1.0, sum(1 for _, d in found10 if d <= bound) / len(exact10))
    return Recall(strict, tied)


def nearest(factory: sessionmaker[Session], vector: Sequence[float], limit: int) -> list[tuple[int, float]]:
    """The store's vector list (worker.search.store._vector_search's SQL and settings) as (id, distance)."""
    from worker.search.store import _vector_search

    with factory() as session:
        version = vector_search_status(session).extension_version or "0"
        hits = _vector_search(session, vector, SearchFilters(), limit, version)
    return [(h.fact_id, 1.0 - h.score) for h in hits]


def percentile(values: Sequence[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(p / 100 * (len(ordered) - 1))))]


def timed_ms(fn: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    result = fn()
    return (time.perf_counter() - started) * 1000, result


def vector_section(
    fast: sessionmaker[Session], exact: sessionmaker[Session], queries: Sequence[str], exact_queries: int
) -> dict[str, float]:
    """p50/p95 of the store's HNSW list at search()'s candidate count, and recall@10 against a scan."""
    vectors = [embed_text(q) for q in queries]
    for vector in vectors[:10]:
        nearest(fast, vector, MIN_CANDIDATES)  # warm the index into the cache
    fast_ms: list[float] = []
    found: list[list[tuple[int, float]]] = []
    for vector in vectors:
        elapsed, hits = timed_ms(lambda v=vector: nearest(fast, v, MIN_CANDIDATES))
        fast_ms.append(elapsed)
        found.append(hits)
    exact_ms: list[float] = []
    recalls: list[Recall] = []
    for vector, hits in list(zip(vectors, found, strict=True))[:exact_queries]:
        elapsed, truth = timed_ms(lambda v=vector: nearest(exact, v, MIN_CANDIDATES))
        exact_ms.append(elapsed)
        recalls.append(recall_at_10(hits, truth))
    return {
        "p50": percentile(fast_ms, 50),
        "p95": percentile(fast_ms, 95),
        "exact_p50": percentile(exact_ms, 50),
        "exact_p95": percentile(exact_ms, 95),
        "recall": sum(r.strict for r in recalls) / len(recalls),
        "recall_tied": sum(r.tied for r in recalls) / len(recalls),
        "queries": len(vectors),
        "exact_queries": len(recalls),
    }


class TimedLLM:
    """An LLM client that adds up the wall time spent inside its calls, so it can be taken out."""

    def __init__(self, inner: LLMClient) -> None:
        self.inner = inner
        self.provider, self.model = inner.provider, inner.model
        self.spent = 0.0

    def chat(self, request: ChatRequest) -> ChatResponse:
        started = time.perf_counter()
        try:
            return self.inner.chat(request)
        finally:
            self.spent += time.perf_counter() - started

    def embed(self, texts: list[str], *, purpose: str = "embedding") -> EmbeddingResponse:
        started = time.perf_counter()
        try:
            return self.inner.embed(texts, purpose=purpose)
        finally:
            self.spent += time.perf_counter() - started


def fused_section(
    fast: sessionmaker[Session], exact: sessionmaker[Session], llm: LLMClient, queries: Sequence[str]
) -> dict[str, float]:
    """Plain queries through search() (lexical probe, expansion, vec/hyde lines, fusion, snippets): p50/p95
    with the time inside LLM calls taken out, and recall@10 of the fused list against the exact run."""
    timed = TimedLLM(llm)
    search(fast, timed, queries[0])  # connect
    own_ms: list[float] = []
    strict: list[float] = []
    expanded = vector_lines = 0
    for query in queries:
        timed.spent = 0.0
        elapsed, outcome = timed_ms(lambda q=query: search(fast, timed, q))
        own_ms.append(elapsed - timed.spent * 1000)
        expanded += outcome.expanded
        vector_lines += any(line.type != "lex" for line in outcome.lines)
        truth = search(exact, timed, query)
        want = {r.fact_id for r in truth.results[:10]}
        got = {r.fact_id for r in outcome.results[:10]}
        strict.append(len(want & got) / len(want) if want else 1.0)
    return {
        "p50": percentile(own_ms, 50),
        "p95": percentile(own_ms, 95),
        "recall": sum(strict) / len(strict),
        "queries": len(queries),
        "expanded": expanded,
        "with_vector_lines": vector_lines,
    }


def report(facts: int, load: dict[str, float], vector: dict[str, float], fused: dict[str, float]) -> None:
    mib = 1024 * 1024
    print()
    print(
        f"vector store: {facts:,} embeddings (256 dims) computed in {load['embed_s']:.1f} s, COPY "
        f"{load['copy_s']:.1f} s; HNSW build {load['build_s']:.1f} s, "
        f"index {load['index_bytes'] / mib:.0f} MiB "
        f"(table {load['table_bytes'] / mib:.0f} MiB); server shared_buffers "
        f"{load['shared_buffers'] / mib:.0f} MiB (an index larger than that is read through the OS cache)"
    )
    print(f"  {'':44} {'p50 ms':>8} {'p95 ms':>8}  recall@10 (tie-aware)")
    print(
        f"  {'vector list, HNSW (' + str(int(vector['queries'])) + ' queries)':44} {vector['p50']:8.1f} "
        f"{vector['p95']:8.1f}  {vector['recall']:.3f} ({vector['recall_tied']:.3f}) "
        f"over {int(vector['exact_queries'])}"
    )
    print(
        f"  {'baseline: exact, sequential scan + sort':44} {vector['exact_p50']:8.1f} "
        f"{vector['exact_p95']:8.1f}  1 by definition"
    )
    print(f"  {'ratio exact / HNSW':44} {vector['exact_p50'] / vector['p50']:7.1f}× "
          f"{vector['exact_p95'] / vector['p95']:7.1f}×")  # fmt: skip
    print(
        f"  {'fused plain query minus LLM time':44} {fused['p50']:8.1f} {fused['p95']:8.1f}  "
        f"{fused['recall']:.3f} vs the same run without index scans ({int(fused['queries'])} queries, "
        f"{int(fused['expanded'])} expanded, {int(fused['with_vector_lines'])} with vector lines)"
    )
    verdict = "meets" if vector["p95"] <= 50 and vector["recall"] >= 0.95 else "MISSES"
    tied = "meets" if vector["p95"] <= 50 and vector["recall_tied"] >= 0.95 else "MISSES"
    print(f"  goal vector p95 <= 50 ms with recall@10 >= 0.95: {verdict} (tie-aware recall: {tied})")


def index_ddl(m: int, ef_construction: int) -> str:
    return (
        f"CREATE INDEX IF NOT EXISTS fact_embeddings_hnsw ON search.fact_embeddings "
        f"USING hnsw (embedding vector_cosine_ops) WITH (m = {m}, ef_construction = {ef_construction})"
    )


def has_vector_store(factory: sessionmaker[Session]) -> bool:
    with factory() as session:
        return bool(session.execute(text("SELECT to_regclass('search.fact_embeddings')")).scalar())
