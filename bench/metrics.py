"""What a /metrics scrape costs over big tables, and what keeping the running totals costs each commit.

    .venv/bin/python bench/metrics.py [--rows 1000000] [--scrapes 20] [--commits 600]

1. Reads: ``--rows`` facts, segment attempts (extraction_audit), LLM calls and consolidation
   decisions, a job and a checkpoint per eight segments (one page in a thousand with a skipped
   segment), a compaction per ten, and one backfill whose job made a quarter of the calls. The four
   scrape-time collectors of worker.api.metrics as they run now (the running totals of migration 0016)
   against the baseline: the same figures aggregated from the tables, as every scrape did before
   (worker/api/metrics.py at 43df1a0; the queries are written out below, and both give the same
   numbers, checked).
2. Writes: a segment's commit (three facts, its audit row, its LLM call through the ledger), and a
   job's heartbeat, each in its own transaction, into two new databases, one at migration 0016's
   schema (the running totals and their triggers) and one at 0015's (the baseline: no totals, no
   triggers), in alternating rounds: alike but for 0016 (HEAD's schema adds indexes and columns of
   later migrations, which a comparison with 0015 would charge to the totals).

Needs the local Postgres (127.0.0.1:5432); creates and drops its own database.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psycopg
from sqlalchemy import text
from sqlalchemy.orm import Session, sessionmaker

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.budget import pct, timed  # noqa: E402
from tests.service import at_least, fresh_database, stop_cleanly_on_termination  # noqa: E402
from worker import db  # noqa: E402
from worker.accounting import Ledger, LLMCallRecord  # noqa: E402
from worker.api.metrics import (  # noqa: E402
    LLM_LATENCY_BUCKETS_MS,
    BackfillCollector,
    CompactionCollector,
    ConsolidationCollector,
    StoreCollector,
)
from worker.llm.types import Usage  # noqa: E402

SERVER = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"

# What StoreCollector and ConsolidationCollector aggregated at every scrape before the running totals.
_LE = ", ".join(f"count(*) FILTER (WHERE latency_ms <= {ms})" for ms in LLM_LATENCY_BUCKETS_MS)
OLD_SCRAPE = (
    "SELECT status, kind, count(*), coalesce(sum(attempts), 0), coalesce(sum(worker_losses), 0) FROM jobs "
    "GROUP BY status, kind",
    "SELECT count(*) FROM facts WHERE is_audit IS false",
    "SELECT outcome, count(*) FROM extraction_audit GROUP BY outcome",
    "SELECT purpose, outcome, count(*), coalesce(sum(input_tokens), 0), coalesce(sum(output_tokens), 0), "
    "coalesce(sum(cost_usd), 0), coalesce(sum(cache_read_tokens), 0) FROM llm_calls "
    "GROUP BY purpose, outcome",
    f"SELECT purpose, {_LE}, count(*), coalesce(sum(latency_ms), 0) FROM llm_calls GROUP BY purpose",
    "SELECT status, count(*) FROM facts WHERE is_audit IS false GROUP BY status",
    "SELECT coalesce(sum(jsonb_array_length(skipped)), 0) FROM op_checkpoints",
    "SELECT decision, decided_by, count(*) FROM consolidation_decisions GROUP BY decision, decided_by",
    "SELECT status, count(*) FROM compactions GROUP BY status",
    "SELECT sum(tokens_before - tokens_after) FILTER (WHERE status = 'accepted') FROM compactions",
    "SELECT coalesce(sum(cost_usd), 0) FROM llm_calls WHERE job_id IN (SELECT job_id FROM backfills)",
)
NEW_SCRAPE = (
    "SELECT status, kind, sum(jobs), sum(attempts), sum(worker_losses) FROM job_totals GROUP BY status, kind",
    "SELECT sum(n) FROM row_counts WHERE counter = 'facts'",
    "SELECT label, sum(n) FROM row_counts WHERE counter = 'segments' GROUP BY label",
    "SELECT purpose, outcome, sum(calls), sum(input_tokens), sum(output_tokens), sum(cost_usd), "
    "sum(cache_read_tokens) FROM llm_call_totals GROUP BY purpose, outcome",
    None,  # the latency histogram: compared through the collector's output below
    "SELECT label, sum(n) FROM row_counts WHERE counter = 'facts' GROUP BY label",
    "SELECT coalesce(sum(jsonb_array_length(skipped)), 0) FROM op_checkpoints WHERE skipped <> '[]'::jsonb",
    "SELECT split_part(label, '/', 1), split_part(label, '/', 2), sum(n) FROM row_counts "
    "WHERE counter = 'decisions' GROUP BY label",
    "SELECT label, sum(n) FROM row_counts WHERE counter = 'compactions' GROUP BY label",
    "SELECT sum(n) FROM row_counts WHERE counter = 'compaction_tokens_saved'",
    "SELECT coalesce(sum(n), 0) / 1000000.0 FROM row_counts WHERE counter = 'backfill_cost_micro_usd'",
)


def fill(url: str, rows: int) -> None:
    with psycopg.connect(url.replace("+psycopg", ""), autocommit=True) as conn:
        conn.execute(
            "INSERT INTO jobs (kind, subject, status, attempts) SELECT 'extraction', 'page-' || g, "
            "CASE WHEN g %% 50 = 0 THEN 'failed' ELSE 'succeeded' END, 1 FROM generate_series(1, %s) g",
            (max(1, rows // 8),),
        )
        conn.execute(
            "INSERT INTO backfills (source_id, job_id) VALUES ('default', 1)"
        )  # a quarter of the calls
        conn.execute(
            "INSERT INTO extraction_audit (source_id, page_slug, segment_index, segment_start, segment_end, "
            "outcome, facts_count) SELECT 'default', 'page-' || (g / 8), g %% 8, '2024-01-01T00:00:00Z', "
            "'2024-01-01T00:10:00Z', CASE WHEN g %% 100 = 0 THEN 'provider_error' ELSE 'ok' END, 1 "
            "FROM generate_series(1, %s) g",
            (rows,),
        )
        conn.execute(
            "INSERT INTO facts (source_id, fact, kind, confidence, notability, source, source_session, "
            "source_markdown_slug, row_num, status) SELECT 'default', 'Alice moved to place ' || g, 'event', "
            "0.9, 'medium', 'bench', 'bench:' || (g / 8), 'page-' || (g / 8), g %% 8, "
            "CASE WHEN g %% 20 = 0 THEN 'superseded' ELSE 'current' END FROM generate_series(1, %s) g",
            (rows,),
        )
        conn.execute(
            "INSERT INTO llm_calls (provider, model, purpose, input_tokens, output_tokens, latency_ms, "
            "outcome, cost_usd, job_id) SELECT 'openai', 'gpt-4o-mini', "
            "CASE WHEN g %% 10 = 0 THEN 'embedding' ELSE 'extraction' END, 1500, 200, 200 + g %% 3000, "
            "'ok', 0.000345, "
            "CASE WHEN g %% 4 = 0 THEN 1 END FROM generate_series(1, %s) g",
            (rows,),
        )
        conn.execute(
            "INSERT INTO op_checkpoints (op, fingerprint, page_key, completed_key, messages_done, "
            "prefix_hash, next_row_num, skipped) SELECT 'extract', 'f', 'default|page-' || g, 'k', 8, "
            "'h', 8, CASE WHEN g %% 1000 = 0 THEN '[{\"segment_index\": 3}]'::jsonb ELSE '[]'::jsonb END "
            "FROM generate_series(1, %s) g",
            (max(1, rows // 8),),
        )
        conn.execute(
            "INSERT INTO consolidation_decisions (source_id, entity_key, decision, decided_by, reason) "
            "SELECT 'default', 'e' || (g %% 5000), CASE WHEN g %% 7 = 0 THEN 'duplicate' ELSE 'new' END, "
            "CASE WHEN g %% 11 = 0 THEN 'model' ELSE 'rule' END, 'r' FROM generate_series(1, %s) g",
            (rows,),
        )
        conn.execute(
            "INSERT INTO transcripts (id) SELECT 't' || g FROM generate_series(1, %s) g", (rows // 100,)
        )
        conn.execute(
            "INSERT INTO compactions (transcript_id, status, cut_seq, tokens_before, tokens_after, summary) "
            "SELECT 't' || (g %% %s + 1), CASE WHEN g %% 5 = 0 THEN 'rejected' ELSE 'accepted' END, g, "
            "20000, CASE WHEN g %% 5 = 0 THEN NULL ELSE 3000 END, "
            "CASE WHEN g %% 5 = 0 THEN NULL ELSE 's' END "
            "FROM generate_series(1, %s) g",
            (max(1, rows // 100), rows // 10),
        )
        conn.execute("VACUUM ANALYZE")


def samples(fn: Callable[[], object], times: int) -> list[float]:
    return timed(fn, times)[0]


def same_figures(factory: sessionmaker[Session]) -> None:
    """The totals say what the tables say (the histogram is checked through the collector)."""
    with factory() as session:
        for old, new in zip(OLD_SCRAPE, NEW_SCRAPE, strict=True):
            if new is not None:
                was, now = session.execute(text(old)).all(), session.execute(text(new)).all()
                assert sorted(map(tuple, was)) == sorted(map(tuple, now)), (old, was, now)
        old_histogram = {row[0]: list(row[1:]) for row in session.execute(text(OLD_SCRAPE[4]))}
    [histogram] = [m for m in StoreCollector(factory).collect() if m.name == "factmill_llm_latency_seconds"]
    for purpose, (*buckets, total, total_ms) in old_histogram.items():
        samples = [s for s in histogram.samples if s.labels.get("purpose") == purpose]
        counts = [s.value for s in samples if s.name.endswith("_bucket")]
        assert counts == [*buckets, total], (purpose, counts, buckets)
        assert [s.value for s in samples if s.name.endswith("_sum")] == [total_ms / 1000]


def reads(factory: sessionmaker[Session], scrapes: int) -> None:
    collectors = [
        C(factory) for C in (StoreCollector, CompactionCollector, ConsolidationCollector, BackfillCollector)
    ]

    def scrape() -> None:
        for collector in collectors:
            families = collector.collect()
            assert not any(m.name == "factmill_store_up" and m.samples[0].value == 0 for m in families)

    def old_aggregates() -> None:
        with factory() as session:
            for query in OLD_SCRAPE:
                session.execute(text(query)).all()

    same_figures(factory)
    scrape()  # warm both
    old_aggregates()
    base = samples(old_aggregates, max(3, scrapes // 4))
    new = samples(scrape, scrapes)
    print("1. a scrape (ms)")
    print(
        f"   the same figures aggregated from the tables (baseline) p50 {statistics.median(base):8.1f}  "
        f"p95 {pct(base, 0.95):8.1f}"
    )
    print(
        f"   all four collectors, running totals (HEAD)            p50 {statistics.median(new):8.1f}  "
        f"p95 {pct(new, 0.95):8.1f}   {statistics.median(base) / statistics.median(new):,.1f}x faster"
    )


def writes(head: sessionmaker[Session], base: sessionmaker[Session], commits: int) -> None:
    """The same writes into two databases alike but for migration 0016, alternating."""
    ledger = Ledger(lambda key: None)
    llm_call = LLMCallRecord(
        "extraction", "openai", "gpt-4o-mini", Usage(input_tokens=1500, output_tokens=200), 900, "ok"
    )
    counter = iter(range(10**9))
    for factory in (head, base):
        with factory.begin() as session:
            session.execute(
                text(
                    "INSERT INTO jobs (kind, subject) "
                    "SELECT 'extraction', 'hb-' || g FROM generate_series(1, 1000) g"
                )
            )

    def commit(factory: sessionmaker[Session]) -> Callable[[], None]:
        def run() -> None:
            page = f"w-{next(counter)}"
            with factory.begin() as session:
                session.execute(
                    text(
                        "INSERT INTO facts (source_id, fact, kind, confidence, notability, source, "
                        "source_session, source_markdown_slug, row_num) "
                        "SELECT 'default', 'w ' || g, 'event', 0.9, 'medium', 'w', 'w', :page, g "
                        "FROM generate_series(0, 2) g"
                    ),
                    {"page": page},
                )
                session.execute(
                    text(
                        "INSERT INTO extraction_audit (source_id, page_slug, segment_index, segment_start, "
                        "segment_end, outcome, facts_count) VALUES ('default', :page, 0, 'a', 'b', 'ok', 3)"
                    ),
                    {"page": page},
                )
                ledger.record(session, llm_call)

        return run

    def heartbeat(factory: sessionmaker[Session]) -> Callable[[], None]:
        def run() -> None:
            with factory.begin() as session:
                session.execute(
                    text("UPDATE jobs SET heartbeat_at = now() WHERE id = :id"),
                    {"id": next(counter) % 1000 + 1},
                )

        return run

    for label, write in (
        ("2a. a segment's commit (3 facts, its audit row, its LLM call)", commit),
        ("2b. a job's heartbeat (an UPDATE that moves no total)", heartbeat),
    ):
        alternate(label, write(head), write(base), commits)


def alternate(label: str, on: Callable[[], None], off: Callable[[], None], commits: int) -> None:
    timed(on, 20)
    timed(off, 20)
    with_totals: list[float] = []
    without: list[float] = []
    for _ in range(max(1, commits // 20)):
        without += samples(off, 20)
        with_totals += samples(on, 20)
    print(f"\n{label}, {len(with_totals)} each, alternating (ms)")
    print(
        f"   schema at 0015, no totals (baseline) p50 {statistics.median(without):6.3f}  "
        f"p95 {pct(without, 0.95):6.3f}"
    )
    print(
        f"   running totals kept (0016)           p50 {statistics.median(with_totals):6.3f}  "
        f"p95 {pct(with_totals, 0.95):6.3f}"
        f"   {statistics.median(with_totals) / statistics.median(without):.2f}x the baseline"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--rows",
        type=at_least(100, "the fill gives a transcript to each 100 rows and a compaction to each 10"),
        default=1_000_000,
        help="facts, segment attempts and LLM calls each",
    )
    parser.add_argument("--scrapes", type=int, default=20)
    parser.add_argument("--commits", type=int, default=600, help="commits of each kind in part 2")
    args = parser.parse_args()
    with fresh_database(SERVER, "bench") as url:
        db.upgrade(url)
        factory = sessionmaker(db.get_engine(url), expire_on_commit=False)
        started = time.perf_counter()
        fill(url, args.rows)
        print(
            f"bench/metrics.py: {args.rows:,} facts, segment attempts, LLM calls and decisions, "
            f"{args.rows // 8:,} jobs, {args.rows // 10:,} compactions "
            f"(filled in {time.perf_counter() - started:.1f} s)\n"
        )
        reads(factory, args.scrapes)
    with fresh_database(SERVER, "bench") as head_url, fresh_database(SERVER, "bench") as base_url:
        db.upgrade(head_url, "0016")
        db.upgrade(base_url, "0015")
        head = sessionmaker(db.get_engine(head_url), expire_on_commit=False)
        writes(head, sessionmaker(db.get_engine(base_url), expire_on_commit=False), args.commits)


if __name__ == "__main__":
    stop_cleanly_on_termination()
    main()
