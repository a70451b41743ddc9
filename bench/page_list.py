"""Listing stored pages (GET /v1/pages, `factmill pages list`) on a large store, against reading the
same pages' rows alone.

    .venv/bin/python bench/page_list.py [--pages 100000] [--facts-per-page 10] [--reads 50]

Fills a scratch database with ``--pages`` pages (one extraction job each) and ``--facts-per-page``
current facts a page, by SQL, then times ``worker.extraction.catalog.list_pages`` (100 pages with their
current facts counted and their last job) at the start of the store, deep in it (a cursor past the
middle) and under a slug prefix, each next to the baseline: the same 100 page rows read by the same
keyset without the counts and the job. Prints medians of ``--reads`` reads and the ratio.

Needs the local Postgres (127.0.0.1:5432); creates and drops its own database.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from sqlalchemy import select, text, tuple_
from sqlalchemy.orm import Session, sessionmaker

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from models.tables import PAGES  # noqa: E402
from tests.service import at_least, migrated_database, stop_cleanly_on_termination  # noqa: E402
from worker.extraction.catalog import list_pages  # noqa: E402

SERVER = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
LIMIT = 100

FILL = [
    "INSERT INTO pages (source_id, slug, type, title, content_hash) "
    "SELECT 'default', 'chats/' || lpad(g::text, 7, '0'), 'conversation', 'chat ' || g, md5(g::text) "
    "FROM generate_series(1, :pages) g",
    "INSERT INTO jobs (kind, subject, status) "
    "SELECT 'extraction', 'default|' || slug, 'succeeded' FROM pages",
    "INSERT INTO facts (source_id, fact, kind, confidence, notability, context, source, source_session, "
    "source_markdown_slug, row_num) "
    "SELECT 'default', 'fact ' || n || ' of ' || p.slug, 'fact', 0.9, 'medium', 'ctx', 'cli', 'cli', "
    "p.slug, n "
    "FROM pages p CROSS JOIN generate_series(0, :facts - 1) n",
    "ANALYZE",
]


def baseline(session: Session, after: tuple[str, str] | None, prefix: str | None) -> int:
    query = select(PAGES.c.source_id, PAGES.c.slug, PAGES.c.type, PAGES.c.title, PAGES.c.updated_at)
    if after is not None:
        query = query.where(tuple_(PAGES.c.source_id, PAGES.c.slug) > tuple_(*after))
    if prefix:
        query = query.where(PAGES.c.slug.startswith(prefix))
    return len(session.execute(query.order_by(PAGES.c.source_id, PAGES.c.slug).limit(LIMIT)).all())


def listing(session: Session, after: tuple[str, str] | None, prefix: str | None) -> int:
    return len(list_pages(session, limit=LIMIT, after=after, slug_prefix=prefix).pages)


def median_ms(factory: sessionmaker[Session], read: Callable[[Session], int], reads: int) -> float:
    times = []
    with factory() as session:
        for _ in range(reads):
            started = time.perf_counter()
            assert read(session) == LIMIT
            times.append((time.perf_counter() - started) * 1e3)
            session.rollback()
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--pages", type=at_least(2 * LIMIT, f"a read past the middle lists {LIMIT} pages"), default=100_000
    )
    parser.add_argument("--facts-per-page", type=at_least(0, "a count"), default=10)
    parser.add_argument("--reads", type=at_least(1, "a median needs a sample"), default=50)
    args = parser.parse_args(argv)
    with migrated_database(SERVER) as (_, factory):
        started = time.perf_counter()
        with factory.begin() as session:
            for statement in FILL:
                session.execute(text(statement), {"pages": args.pages, "facts": args.facts_per_page})
        print(
            f"{args.pages:,} pages, {args.pages * args.facts_per_page:,} facts "
            f"(filled in {time.perf_counter() - started:.0f} s); medians of {args.reads} reads of {LIMIT}"
        )
        middle = f"chats/{args.pages // 2:07d}"
        cases = {
            "the first pages": (None, None),
            "past the middle": (("default", middle), None),
            "under a prefix": (None, "chats/00"),
        }
        for name, (after, prefix) in cases.items():
            base = median_ms(factory, partial(baseline, after=after, prefix=prefix), args.reads)
            listed = median_ms(factory, partial(listing, after=after, prefix=prefix), args.reads)
            print(
                f"  {name:16} rows alone {base:6.2f} ms · list_pages {listed:6.2f} ms ({listed / base:.1f}x)"
            )
    return 0


if __name__ == "__main__":
    stop_cleanly_on_termination()
    raise SystemExit(main())
