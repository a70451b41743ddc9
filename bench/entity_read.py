"""What a consolidation run reads of a large entity: the pending facts' kinds only, against every fact.

    .venv/bin/python bench/entity_read.py [--facts 50000] [--kinds 5] [--pending 10] [--runs 3]

Fills a fresh database with ``--facts`` consolidated current facts of one entity (``--kinds`` kinds in
turn, each with a 256-dimension embedding) and ``--pending`` unconsolidated ones of the first kind, then
times ``ConsolidationStore.entity_facts`` and, as the baseline in the same run, the read it replaced:
every fact of the entity, its vector parsed by psycopg from the float8[] text, split into pending and
pool in Python; and that read with the vectors in binary (the change's other half). Prints the medians
and the ratios.

Needs the local Postgres (127.0.0.1:5432); creates and drops its own database.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy import or_, select

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from models import Fact  # noqa: E402
from tests.service import fill_table, migrated_database, rolled_back_ms, stop_cleanly_on_termination  # noqa: E402
from worker.accounting import Ledger  # noqa: E402
from worker.config_store import ConfigReader  # noqa: E402
from worker.consolidation.service import MAX_FACTS_PER_ROUND  # noqa: E402
from worker.consolidation.store import _ENTITY_FACTS, ConsolidationStore, _view  # noqa: E402
from worker.core.consolidation import CURRENT, FactView, said_at  # noqa: E402

SERVER = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
ENTITY = "people/alice-example"
KINDS = ("fact", "event", "preference", "commitment", "belief")
FILL = (
    "INSERT INTO facts (source_id, fact, kind, entity_slug, confidence, notability, source, source_session, "
    "source_markdown_slug, row_num, embedding, consolidated_at) "
    "SELECT 'default', 'Alice Example fact number ' || g, (%(kinds)s::text[])[1 + g %% %(k)s], %(entity)s, "
    "0.9, 'medium', 'bench', 'bench', 'page-' || (g / 100), g %% 100, "
    "(SELECT array_agg(random()) FROM generate_series(1, 256) d WHERE g > 0), "
    "CASE WHEN g <= %(pending)s THEN NULL ELSE now() END "
    "FROM generate_series(1, %(n)s) g"
)


def _text_view(row: Any) -> FactView:
    """A fact as the store built it before: its vector from psycopg's parse of the float8[] text."""
    vector = array("d", row.embedding) if row.embedding else None
    said = said_at(row.context, row.created_at)
    return FactView(row.id, row.fact, row.kind, row.valid_from, vector, row.id, said)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--facts", type=int, default=50_000)
    parser.add_argument("--kinds", type=int, default=5, choices=range(1, 6))
    parser.add_argument("--pending", type=int, default=10)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    with migrated_database(SERVER) as (url, factory):
        # The pending facts take kinds by g % k too; with --pending 10 and 5 kinds, all five appear:
        # make them all the first kind, as one page's facts about a person often are.
        fill_table(
            url,
            "facts",
            FILL,
            kinds=list(KINDS),
            k=args.kinds,
            entity=ENTITY,
            pending=args.pending,
            n=args.facts + args.pending,
        )
        with factory.begin() as session:
            session.query(Fact).filter(Fact.consolidated_at.is_(None)).update({"kind": KINDS[0]})
        store = ConsolidationStore(factory, Ledger(ConfigReader(factory, ttl=0).get))

        def everything(binary: bool) -> Callable[[Any], None]:
            """The read before: every fact of the entity; its vectors as psycopg parses float8[] text
            (``binary`` False, as it was) or in the binary format (the other half of the change)."""
            if binary:
                query = _ENTITY_FACTS.add_columns(Fact.status, Fact.consolidated_at)
                view = functools.partial(_view, model=None)
            else:
                columns = (Fact.id, Fact.fact, Fact.kind, Fact.valid_from, Fact.embedding, Fact.status)
                query = select(*columns, Fact.consolidated_at, Fact.context, Fact.created_at)
                query = query.where(~Fact.is_audit).order_by(Fact.id).execution_options(yield_per=1_000)
                view = _text_view
            query = query.where(
                Fact.source_id == "default",
                Fact.entity_slug == ENTITY,
                or_(Fact.consolidated_at.is_(None), Fact.status == CURRENT),
            )

            def read(session: Any) -> None:
                facts = [(view(row), row.status, row.consolidated_at) for row in session.execute(query)]
                pending = [fact for fact, _, at in facts if at is None]
                pool = [fact for fact, status, at in facts if at is not None and status == CURRENT]
                assert len(pending) == args.pending and pool

            return read

        def pending_kinds(_: Any) -> None:
            pending, pool = store.entity_facts("default", ENTITY)
            assert len(pending) == args.pending and pool

        def one_round(_: Any) -> None:
            """What a consolidation round reads now: the pending facts listed light, its own read whole."""
            pending, batch, _ = store.entity_round("default", ENTITY, MAX_FACTS_PER_ROUND)
            assert len(pending) == args.pending and len(batch) == min(args.pending, MAX_FACTS_PER_ROUND)

        base, binary, head, round_ms = (
            statistics.median(rolled_back_ms(factory, args.runs, work))
            for work in (everything(binary=False), everything(binary=True), pending_kinds, one_round)
        )
    print(
        f"{args.facts:,} current facts of one entity ({args.kinds} kinds, 256-dim vectors), "
        f"{args.pending} pending of one kind; medians of {args.runs}:"
    )
    print(f"  {'every fact, vectors as text (baseline)':44} {base:9.1f} ms")
    print(f"  {'every fact, vectors in binary':44} {binary:9.1f} ms   {binary / base:.2f}x")
    print(f"  {'the pending kinds only, in binary':44} {head:9.1f} ms   {head / base:.2f}x")
    label = f"one round of {MAX_FACTS_PER_ROUND} (HEAD)"
    print(f"  {label:44} {round_ms:9.1f} ms   {round_ms / base:.2f}x")
    return 0


if __name__ == "__main__":
    stop_cleanly_on_termination()
    raise SystemExit(main())
