"""One page of an entity's facts (GET /v1/entities/{entity}/facts) in the middle of a large entity.

    .venv/bin/python bench/entity_page.py [--facts 200000] [--limit 50] [--runs 5]

Fills a fresh database with ``--facts`` current facts of one entity (one in ten undated), then times,
at a cursor half-way down the list and at one among the undated: ``read_entity_facts`` as it runs now
(two reads bounded by the page, in the order of ix_facts_entity_timeline, merged; plus the entity's
count, shown apart), and, as the baseline in the same run, what it did before: the same count and one
ordered read, undated last, past the cursor (the statement written out below, as
worker/extraction/facts.py had it at 1ee540e). Prints the medians and the ratios.

Needs the local Postgres (127.0.0.1:5432); creates and drops its own database.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

from sqlalchemy import and_, func, or_, select

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from models import Fact  # noqa: E402
from tests.service import fill_table, migrated_database, rolled_back_ms, stop_cleanly_on_termination  # noqa: E402
from worker.extraction.facts import _entity_cursor, _entity_page, entity_cursor, read_entity_facts  # noqa: E402

SERVER = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
ENTITY = "people/alice-example"
FILL = (
    "INSERT INTO facts (source_id, fact, kind, entity_slug, confidence, notability, source, source_session, "
    "source_markdown_slug, row_num, valid_from) "
    "SELECT 'default', 'Alice Example fact number ' || g, 'fact', %(entity)s, 0.9, 'medium', 'bench', "
    "'bench', 'page-' || (g / 100), g %% 100, "
    "CASE WHEN g %% 10 = 0 THEN NULL ELSE timestamptz '2020-01-01' + g * interval '1 minute' END "
    "FROM generate_series(1, %(n)s) g"
)


def _baseline(after: str, limit: int) -> Any:
    """The read before: one ordered read past the cursor, undated last (no index has that order)."""
    when, last_id = _entity_cursor(after)
    if when is None:
        past = and_(Fact.valid_from.is_(None), Fact.id < last_id)
    else:
        past = or_(
            Fact.valid_from < when,
            and_(Fact.valid_from == when, Fact.id < last_id),
            Fact.valid_from.is_(None),
        )
    return (
        select(Fact)
        .where(Fact.entity_slug == ENTITY, Fact.is_audit.is_(False), Fact.status == "current", past)
        .order_by(Fact.valid_from.desc().nulls_last(), Fact.id.desc())
        .limit(limit + 1)
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--facts", type=int, default=200_000)
    parser.add_argument("--limit", type=int, default=50)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args(argv)
    with migrated_database(SERVER) as (url, factory):
        fill_table(url, "facts", FILL, entity=ENTITY, n=args.facts)
        with factory() as session:
            newest_first = (Fact.valid_from.desc(), Fact.id.desc())
            dated = session.scalars(
                select(Fact).where(Fact.valid_from.is_not(None)).order_by(*newest_first)
                .offset(args.facts * 9 // 20).limit(1)
            ).one()  # fmt: skip
            undated = session.scalars(
                select(Fact).where(Fact.valid_from.is_(None)).order_by(Fact.id.desc())
                .offset(args.facts // 20).limit(1)
            ).one()  # fmt: skip
            cursors = {
                "half-way down the dated": entity_cursor(dated),
                "among the undated": entity_cursor(undated),
            }
        current = [Fact.entity_slug == ENTITY, Fact.is_audit.is_(False), Fact.status == "current"]
        count = select(func.count()).select_from(Fact).where(*current)
        print(f"{args.facts:,} current facts of one entity (one in ten undated), pages of {args.limit}; "
              f"medians of {args.runs}:")  # fmt: skip
        for where, after in cursors.items():

            def now(session: Any, after: str = after) -> None:
                page = read_entity_facts(session, ENTITY, limit=args.limit, after=after)
                assert len(page.facts) == args.limit

            def before(session: Any, after: str = after) -> None:
                session.scalar(count)  # read_entity_facts counted the entity then too
                assert len(list(session.scalars(_baseline(after, args.limit)))) == args.limit + 1

            def page_now(session: Any, after: str = after) -> None:
                assert (
                    len(list(session.scalars(_entity_page(current, after, 0, args.limit)))) == args.limit + 1
                )

            def page_before(session: Any, after: str = after) -> None:
                assert len(list(session.scalars(_baseline(after, args.limit)))) == args.limit + 1

            base, head, alone_before, alone_now, counted = (
                statistics.median(rolled_back_ms(factory, args.runs, work))
                for work in (before, now, page_before, page_now, lambda s: s.scalar(count))
            )
            print(f"  a cursor {where}:")
            print(f"    {'count + one ordered read (baseline)':40} {base:9.1f} ms")
            print(f"    {'read_entity_facts (HEAD)':40} {head:9.1f} ms   {head / base:.3f}x")
            print(f"    {'the count of the entity alone':40} {counted:9.1f} ms")
            print(f"    {'the page statement alone, baseline':40} {alone_before:9.1f} ms")
            ratio = alone_now / alone_before
            print(f"    {'the page statement alone, HEAD':40} {alone_now:9.1f} ms   {ratio:.3f}x")
    return 0


if __name__ == "__main__":
    stop_cleanly_on_termination()
    raise SystemExit(main())
