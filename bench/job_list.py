"""A source-limited key's job list (GET /v1/jobs) on a large jobs table, with the index of migration
0023 and without it.

    .venv/bin/python bench/job_list.py [--jobs 1000000] [--reads 20]

Fills ``jobs`` with ``--jobs`` page jobs over 100 sources (the oldest 20 in a source of their own),
then times ``worker.jobs.queries.list_jobs`` (50 jobs, newest first) for a key limited to: a common
source, the rare source, a source with no job, and three sources; next to the unfiltered list an
admin reads (the baseline). Then drops ix_jobs_page_source and times the same lists again. Prints
medians of ``--reads`` reads (enough to reach psycopg's prepared statements, whose generic plans must
still use the index).

Needs the local Postgres (127.0.0.1:5432); creates and drops its own database.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Collection
from pathlib import Path

from sqlalchemy.orm import sessionmaker

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.service import drop_index, fill_table, migrated_database, stop_cleanly_on_termination  # noqa: E402
from worker.jobs.queries import list_jobs  # noqa: E402

SERVER = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
FILL = (
    "INSERT INTO jobs (kind, subject, status, finished_at) SELECT 'extraction', "
    "CASE WHEN g <= 20 THEN 'rare' ELSE 's' || (g %% 100) END || '|page-' || g, 'succeeded', now() "
    "FROM generate_series(1, %(rows)s) g"
)
KEYS: dict[str, Collection[str] | None] = {
    "admin, every job (baseline)": None,
    "one common source": {"s7"},
    "the rare source (20 old jobs)": {"rare"},
    "a source with no job": {"none-yet"},
    "three sources": {"s7", "s8", "rare"},
}


def medians(factory: sessionmaker, reads: int) -> dict[str, float]:
    out = {}
    with factory() as session:
        for label, sources in KEYS.items():
            times = []
            for _ in range(reads):
                started = time.perf_counter()
                list_jobs(session, limit=50, source_ids=sources)
                times.append((time.perf_counter() - started) * 1000)
            out[label] = statistics.median(times)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--jobs", type=int, default=1_000_000)
    parser.add_argument("--reads", type=int, default=20)
    args = parser.parse_args(argv)
    with migrated_database(SERVER) as (url, factory):
        started = time.perf_counter()
        fill_table(url, "jobs", FILL, rows=args.jobs)
        print(f"{args.jobs:,} page jobs over 101 sources, loaded in {time.perf_counter() - started:.1f} s")
        medians(factory, 3)  # warm the cache: each figure below is read from memory
        indexed = medians(factory, args.reads)
        drop_index(factory, "ix_jobs_page_source")
        scanned = medians(factory, args.reads)
    print(f"50 jobs newest first, median of {args.reads} reads (ms):")
    print(f"  {'key limited to':32} {'before (no index)':>18} {'with it (0023)':>15}")
    for label in KEYS:
        before, after = scanned[label], indexed[label]
        print(f"  {label:32} {before:18.2f} {after:15.2f}   {after / before:.3f}x")
    return 0


if __name__ == "__main__":
    stop_cleanly_on_termination()
    raise SystemExit(main())
