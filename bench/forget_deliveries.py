"""Kept Idempotency-Key answers in a large table: a sweep's DELETE with its index and without, and an
erasure's rewrite of the answers that list its page.

    .venv/bin/python bench/forget_deliveries.py [--rows 1000000] [--batch 10000] [--rounds 5]

Fills webhook_deliveries with ``--rows`` answers spread over 30 days, then times
``models.webhook.forget_deliveries`` (a week kept: about three quarters of the rows are past it) a
batch of ``--batch`` at a time, each DELETE rolled back so every round sees the same table: first
with the created_at index of migration 0017, then without it (the baseline: what the DELETE costs
reading the whole table). Prints the median time of a DELETE and the ratio.

Then times ``models.webhook.forget_page_in_deliveries`` for one page (each rolled back) with the GIN
index of migration 0019 and without it (the baseline), and what the index costs an insert. The rolled-back
inserts leave dead rows: the table is vacuumed after them, so no later figure reads through them.

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

from models.webhook import forget_deliveries, forget_page_in_deliveries  # noqa: E402
from tests.service import (  # noqa: E402
    drop_index,
    fill_table,
    migrated_database,
    rolled_back_ms,
    rolled_back_runs,
    stop_cleanly_on_termination,
)

SERVER = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
KEPT = timedelta(days=7)
INSERTED = 100_000


def answers(rows: int, key: str, days: int | None = None) -> str:
    """An INSERT of ``rows`` answers as the page webhook keeps them (one page each; two answers name
    each page), spread over ``days`` or dated now."""
    column, dated = (
        (", created_at", f", now() - (g::bigint * {days * 86400} / {rows}) * interval '1 s'")
        if days
        else ("", "")
    )
    return (
        f"INSERT INTO webhook_deliveries (idempotency_key, body_hash, response{column}) "
        f"SELECT 'POST /v1/pages||{key}' || g, md5(g::text), jsonb_build_object('jobs', jsonb_build_array("
        "jsonb_build_object('job_id', g, 'source_id', 'default', 'slug', 'page-' || mod(g, 500000), "
        f"'created', true)), 'unchanged', '[]'::jsonb){dated} FROM generate_series(1, {rows}) g"
    )


def rounds(factory: sessionmaker, batch: int, count: int) -> tuple[list[float], int]:
    """Milliseconds a sweep's DELETE, each rolled back; and how many rows one deleted."""
    times, deleted = rolled_back_runs(factory, count, lambda session: forget_deliveries(session, KEPT, batch))
    return times, deleted if deleted is not None else 0


def vacuum(factory: sessionmaker) -> None:
    """VACUUM webhook_deliveries (outside a transaction, as VACUUM must run)."""
    engine = factory.kw["bind"]
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM webhook_deliveries"))


def erasure_rows(factory: sessionmaker, count: int) -> None:
    """An erasure's rewrite of the answers naming one page, and what inserting answers costs, with the
    GIN index of migration 0019 and without it."""
    changed = 0

    def forget(session: Session) -> None:
        nonlocal changed
        changed = forget_page_in_deliveries(session, "default", "page-4242", "erased:digest")

    def insert(session: Session) -> None:
        session.execute(text(answers(INSERTED, "more-")))

    def both() -> tuple[float, float]:
        times = (
            statistics.median(rolled_back_ms(factory, count, forget)),
            statistics.median(rolled_back_ms(factory, count, insert)),
        )
        vacuum(factory)  # the inserts rolled back: dead rows the next reads would go through
        return times

    indexed, inserts = both()
    with factory.begin() as session:
        session.execute(text("DROP INDEX ix_webhook_deliveries_response"))
    scanned, plain = both()
    print(f"an erasure's rewrite of the answers naming its page ({changed} of them), median of {count}:")
    print(f"  {'without the GIN index (baseline)':40} {scanned:9.1f} ms")
    print(f"  {'with it (migration 0019)':40} {indexed:9.1f} ms   {indexed / scanned:.4f}x")
    more = (inserts - plain) * 1000 / INSERTED
    print(f"what the index costs: {INSERTED:,} more answers inserted in one statement, median of {count}:")
    print(f"  {'without it (baseline)':40} {plain:9.1f} ms")
    print(f"  {'with it':40} {inserts:9.1f} ms   {inserts / plain:.2f}x, {more:.1f} us an answer more")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    with migrated_database(SERVER) as (url, factory):
        started = time.perf_counter()
        fill_table(url, "webhook_deliveries", answers(args.rows, "delivery-", days=30))
        print(f"{args.rows:,} answers over 30 days, loaded in {time.perf_counter() - started:.1f} s")
        erasure_rows(factory, args.rounds)
        indexed, deleted = rounds(factory, args.batch, args.rounds)
        drop_index(factory, "ix_webhook_deliveries_created_at")
        scanned, _ = rounds(factory, args.batch, args.rounds)
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
    stop_cleanly_on_termination()
    raise SystemExit(main())
