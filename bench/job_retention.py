"""Finished jobs past their retention in a large table: one sweep's DELETE, with the partial index
on finished_at and without it.

    .venv/bin/python bench/job_retention.py [--jobs 1000000] [--batch 1000] [--rounds 5]

Fills ``jobs`` with ``--jobs`` finished jobs spread over 60 days (each named by two extraction audit
rows and two llm_calls rows, as a two-segment page leaves them), then times
``models.job.expire_jobs`` with 30 days kept (about half the jobs are past it) a batch of ``--batch``
at a time, each DELETE rolled back so every round sees the same table: first with the indexes of
migration 0022, then without the finished_at one (the baseline: what the DELETE costs reading the
whole table). Prints the median time of a DELETE and the ratio, and what a sweep clears per job.

Needs the local Postgres (127.0.0.1:5432); creates and drops its own database.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

from sqlalchemy.orm import sessionmaker

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from models.job import expire_jobs  # noqa: E402
from tests.service import (  # noqa: E402
    drop_index,
    fill_table,
    migrated_database,
    rolled_back_runs,
    stop_cleanly_on_termination,
)

SERVER = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
KEPT = timedelta(days=30)

JOBS = (
    "INSERT INTO jobs (id, kind, subject, status, created_at, finished_at) "
    "SELECT g, 'extraction', 'default|page-' || g, CASE WHEN g %% 20 = 0 THEN 'failed' ELSE 'succeeded' END, "
    "now() - (g::bigint * 5184000 / %(rows)s) * interval '1 s', "
    "now() - (g::bigint * 5184000 / %(rows)s) * interval '1 s' FROM generate_series(1, %(rows)s) g"
)
AUDIT = (
    "INSERT INTO extraction_audit (job_id, source_id, page_slug, segment_index, segment_start, segment_end, "
    "outcome, facts_count) SELECT 1 + g / 2, 'default', 'page-' || (1 + g / 2), g %% 2, 's', 'e', 'ok', 5 "
    "FROM generate_series(1, 2 * %(rows)s - 1) g"
)
CALLS = (
    "INSERT INTO llm_calls (job_id, provider, model, purpose, outcome) "
    "SELECT 1 + g / 2, 'simulator', 'm', 'extract', 'ok' FROM generate_series(1, 2 * %(rows)s - 1) g"
)


def rounds(factory: sessionmaker, batch: int, count: int) -> tuple[list[float], int]:
    """Milliseconds a sweep's DELETE took, each rolled back; and how many jobs one deleted."""
    times, deleted = rolled_back_runs(factory, count, lambda session: expire_jobs(session, KEPT, batch))
    return times, deleted if deleted is not None else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--jobs", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=1_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    with migrated_database(SERVER) as (url, factory):
        started = time.perf_counter()
        fill_table(url, "jobs", JOBS, rows=args.jobs)
        fill_table(url, "extraction_audit", AUDIT, rows=args.jobs)
        fill_table(url, "llm_calls", CALLS, rows=args.jobs)
        print(
            f"{args.jobs:,} finished jobs over 60 days, {2 * args.jobs:,} audit rows and LLM calls naming "
            f"them, loaded in {time.perf_counter() - started:.1f} s"
        )
        indexed, deleted = rounds(factory, args.batch, args.rounds)
        drop_index(factory, "ix_jobs_finished_at")
        scanned, _ = rounds(factory, args.batch, args.rounds)
    base, head = statistics.median(scanned), statistics.median(indexed)
    print(f"one sweep's DELETE of {deleted:,} jobs (30 days kept), median of {args.rounds}:")
    print(f"  {'without the finished_at index (baseline)':44} {base:9.1f} ms")
    print(f"  {'with it (migration 0022)':44} {head:9.1f} ms   {head / base:.2f}x")
    print(f"  {'a job, with the rows that named it':44} {head * 1000 / max(deleted, 1):9.1f} us")
    return 0


if __name__ == "__main__":
    stop_cleanly_on_termination()
    raise SystemExit(main())
