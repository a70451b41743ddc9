"""Forgetting expired Idempotency-Key answers: a sweep's DELETE in a large table, with its index and without.

    .venv/bin/python bench/forget_deliveries.py [--rows 1000000] [--batch 10000] [--rounds 5]

Fills webhook_deliveries with ``--rows`` answers spread over 30 days, then times
``models.webhook.forget_deliveries`` (a week kept: about three quarters of the rows are past it) a
batch of ``--batch`` at a time, each DELETE rolled back so every round sees the same table: first
with the created_at index of migration 0017, then without it (the baseline: what the DELETE costs
reading the whole table). Prints the median time of a DELETE and the ratio.

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
from sqlalchemy.orm import sessionmaker

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from models.webhook import forget_deliveries  # noqa: E402
from tests.service import fill_table, fresh_database  # noqa: E402
from worker import db  # noqa: E402

SERVER = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
KEPT = timedelta(days=7)


def rounds(factory: sessionmaker, batch: int, count: int) -> tuple[list[float], int]:
    """Milliseconds a DELETE, each rolled back; and how many rows one deleted."""
    times, deleted = [], 0
    for _ in range(count):
        with factory() as session:
            started = time.perf_counter()
            deleted = forget_deliveries(session, KEPT, batch)
            times.append((time.perf_counter() - started) * 1000)
            session.rollback()
    return times, deleted


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    with fresh_database(SERVER, "bench") as url:
        db.upgrade(url)
        factory = db.session_factory(url)
        started = time.perf_counter()
        fill_table(
            url,
            "webhook_deliveries",
            "INSERT INTO webhook_deliveries (idempotency_key, body_hash, response, created_at) "
            "SELECT 'pages|default|delivery-' || g, md5(g::text), '{\"jobs\": [1]}', "
            "now() - (g::bigint * 2592000 / %(rows)s) * interval '1 second' "
            "FROM generate_series(1, %(rows)s) g",
            rows=args.rows,
        )
        print(f"{args.rows:,} answers over 30 days, loaded in {time.perf_counter() - started:.1f} s")
        indexed, deleted = rounds(factory, args.batch, args.rounds)
        with factory.begin() as session:
            session.execute(text("DROP INDEX ix_webhook_deliveries_created_at"))
        scanned, _ = rounds(factory, args.batch, args.rounds)
        db.get_engine(url).dispose()
    base, head = statistics.median(scanned), statistics.median(indexed)
    rows = (
        ("without the created_at index (baseline)", base, ""),
        ("with it (migration 0017)", head, head / base),
    )
    print(f"one sweep's DELETE of {deleted:,} answers (a week kept), median of {args.rounds}:")
    for label, ms, ratio in rows:
        print(f"  {label:40} {ms:9.1f} ms" + (f"   {ratio:.2f}x" if ratio else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
