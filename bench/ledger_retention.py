"""llm_calls and extraction_audit rows past their retention in large tables: one sweep's DELETE, with
the indexes of migration 0027 and without them.

    .venv/bin/python bench/ledger_retention.py [--calls 1000000] [--batch 10000] [--rounds 5]

Fills ``llm_calls`` with ``--calls`` calls spread over 60 days (a job a hundred, one job in a hundred
still pending, whose calls the sweep keeps), each named by one extraction audit row of the same age and
every tenth by a consolidation decision, then times
``models.llm_call.expire_ledger`` with 30 days kept (about half the rows are past it), each DELETE
rolled back so every round sees the same tables: first with migration 0027's indexes, then without
them (the baseline: every deleted call's ON DELETE SET NULL reads extraction_audit and the decisions
whole, and the oldest rows are found by a sort of the table). The baseline's batch is a hundredth of
``--batch`` (a full one takes minutes); the figure compared is the time a row. Also what the indexes
cost the writes: 10,000 audit rows inserted one statement each (as segments commit them), with the
indexes and without.

Needs the local Postgres (127.0.0.1:5432); creates and drops its own database.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

from sqlalchemy import text
from sqlalchemy.orm import Session, sessionmaker

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from models.llm_call import expire_ledger  # noqa: E402
from tests.service import (  # noqa: E402
    at_least,
    drop_index,
    fill_table,
    migrated_database,
    rolled_back_ms,
    rolled_back_runs,
    stop_cleanly_on_termination,
)

SERVER = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
KEPT = timedelta(days=30)
AGE = "now() - (g::bigint * 5184000 / %(rows)s) * interval '1 s'"  # row g of n, spread over 60 days

# A job a hundred calls, one in a hundred of them still pending (paused for its budget): the sweep
# keeps a pending job's calls (its own budget sums them), asked of jobs for every call it deletes.
JOBS = (
    "INSERT INTO jobs (id, kind, subject, status, pause_reason) SELECT g, 'extraction', 'default|p-' || g, "
    "CASE WHEN g %% 100 = 0 THEN 'paused' ELSE 'succeeded' END, CASE WHEN g %% 100 = 0 THEN 'budget' END "
    "FROM generate_series(1, %(rows)s / 100 + 1) g"
)
CALLS = (
    "INSERT INTO llm_calls (id, provider, model, purpose, outcome, input_tokens, output_tokens, cost_usd, "
    f"job_id, created_at) SELECT g, 'openai', 'gpt-4o-mini', 'extraction', 'ok', 900, 120, 0.0002, "
    f"g / 100 + 1, {AGE} FROM generate_series(1, %(rows)s) g"
)
AUDIT = (
    "INSERT INTO extraction_audit (source_id, page_slug, segment_index, segment_start, segment_end, "
    f"outcome, facts_count, llm_call_id, created_at) SELECT 'default', 'page-' || g / 8, g %% 8, 's', 'e', "
    f"'ok', 3, g, {AGE} FROM generate_series(1, %(rows)s) g"
)
DECISIONS = (
    "INSERT INTO consolidation_decisions (source_id, entity_key, decision, decided_by, reason, llm_call_id, "
    f"created_at) SELECT 'default', 'e-' || g, 'new', 'model', 'r', g, {AGE} "
    "FROM generate_series(1, %(rows)s, 10) g"
)
INDEXES = (
    "ix_extraction_audit_created_at",
    "ix_extraction_audit_llm_call_id",
    "ix_consolidation_decisions_llm_call_id",
)


ONE_AUDIT_ROW = text(
    "INSERT INTO extraction_audit (source_id, page_slug, segment_index, segment_start, segment_end, "
    "outcome, facts_count, llm_call_id) VALUES ('default', 'new', 0, 's', 'e', 'ok', 3, :call)"
)
WRITES = 10_000


def writes(factory: sessionmaker, count: int) -> list[float]:
    """Milliseconds ``WRITES`` single-row audit inserts took, each round rolled back."""

    def insert(session: Session) -> None:
        for call in range(1, WRITES + 1):
            session.execute(ONE_AUDIT_ROW, {"call": call})

    return rolled_back_ms(factory, count, insert)


def rounds(factory: sessionmaker, batch: int, count: int) -> tuple[list[float], tuple[int, int]]:
    """Milliseconds a sweep's DELETE took, each rolled back; and how many rows of each one deleted."""
    times, deleted = rolled_back_runs(factory, count, lambda session: expire_ledger(session, KEPT, batch))
    return times, deleted if deleted is not None else (0, 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--calls", type=at_least(WRITES, f"the audit inserts name calls 1 to {WRITES:,}"), default=1_000_000
    )
    parser.add_argument("--batch", type=at_least(1, "a sweep deletes at least one row"), default=10_000)
    parser.add_argument("--rounds", type=at_least(1, "a median needs a sample"), default=5)
    args = parser.parse_args(argv)
    small = max(1, args.batch // 100)
    with migrated_database(SERVER) as (url, factory):
        started = time.perf_counter()
        fill_table(url, "jobs", JOBS, rows=args.calls)
        fill_table(url, "llm_calls", CALLS, rows=args.calls)
        fill_table(url, "extraction_audit", AUDIT, rows=args.calls)
        fill_table(url, "consolidation_decisions", DECISIONS, rows=args.calls)
        print(
            f"{args.calls:,} LLM calls over 60 days, as many audit rows and a tenth as many decisions "
            f"naming them, loaded in {time.perf_counter() - started:.1f} s"
        )
        indexed, deleted = rounds(factory, args.batch, args.rounds)
        written = writes(factory, args.rounds)
        for name in INDEXES:
            drop_index(factory, name)
        scanned, small_deleted = rounds(factory, small, args.rounds)
        written_before = writes(factory, args.rounds)
    head = statistics.median(indexed) / max(sum(deleted), 1)
    base = statistics.median(scanned) / max(sum(small_deleted), 1)
    print(f"one sweep's DELETE (30 days kept), median of {args.rounds}, per row deleted:")
    audit, calls = small_deleted
    print(
        f"  {'without the indexes (baseline)':34} {base * 1000:9.1f} us   "
        f"({statistics.median(scanned):.1f} ms for {audit:,} audit rows and {calls:,} calls)"
    )
    print(
        f"  {'with migration 0027s indexes':34} {head * 1000:9.1f} us   {head / base:.4f}x   "
        f"({statistics.median(indexed):.1f} ms for {deleted[0]:,} audit rows and {deleted[1]:,} calls)"
    )
    before, after = statistics.median(written_before), statistics.median(written)
    print(f"{WRITES:,} audit rows written one statement each, median of {args.rounds}:")
    print(f"  {'without the indexes (baseline)':34} {before * 1000 / WRITES:9.1f} us a row")
    print(f"  {'with them':34} {after * 1000 / WRITES:9.1f} us a row   {after / before:.2f}x")
    return 0


if __name__ == "__main__":
    stop_cleanly_on_termination()
    raise SystemExit(main())
