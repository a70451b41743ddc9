"""A write of one statement in a transaction of its own, against the same write in autocommit.

    .venv/bin/python bench/one_statement.py [--writes 2000] [--rounds 5]

The statement is the outbox's broker-sent mark (``UPDATE jobs SET enqueued_at = now() ...``), which
every webhook runs once its job is on the broker. ``factory.begin()`` (the baseline) sends BEGIN, the
UPDATE and COMMIT; ``models.reads.one_statement`` sends the UPDATE alone, which commits as it runs.
Prints the wall time and the client's CPU a write, medians of alternating rounds on one pooled
connection, and their ratios.

Needs the local Postgres (127.0.0.1:5432); creates and drops its own database.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

from sqlalchemy import text
from sqlalchemy.orm import Session, sessionmaker

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from models.reads import one_statement  # noqa: E402
from tests.service import fresh_database, stop_cleanly_on_termination  # noqa: E402
from worker import db  # noqa: E402
from worker.jobs.sending import _MARK_ENQUEUED  # noqa: E402
from worker.settings import Settings  # noqa: E402

SERVER = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"


def writes(unit: Callable[[], AbstractContextManager[Session]], count: int) -> tuple[float, float]:
    """(wall ms, client CPU ms) a mark, over ``count`` marks each in a unit of its own."""
    wall, cpu = time.perf_counter(), time.process_time()
    for n in range(count):
        with unit() as session:
            session.connection().execute(_MARK_ENQUEUED, {"ids": [1 + n % 100]})
    return (time.perf_counter() - wall) * 1e3 / count, (time.process_time() - cpu) * 1e3 / count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--writes", type=int, default=2000, help="marks a round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    with fresh_database(SERVER, "bench") as url:
        db.upgrade(url)
        engine = db.create_pooled_engine(url, settings=Settings(db_pool_size=1, db_max_overflow=0))
        try:
            factory = sessionmaker(engine)
            with factory.begin() as session:
                session.execute(
                    text(
                        "INSERT INTO jobs (kind, subject) "
                        "SELECT 'extraction', 'page-' || g FROM generate_series(1, 100) g"
                    )
                )
            units: dict[str, Callable[[], AbstractContextManager[Session]]] = {
                "factory.begin() (baseline)": factory.begin,
                "one_statement": lambda: one_statement(factory),
            }
            samples: dict[str, list[tuple[float, float]]] = {name: [] for name in units}
            writes(units["one_statement"], 200)  # warm: psycopg prepares the statement on its sixth run
            for _ in range(args.rounds):
                for name, unit in units.items():
                    samples[name].append(writes(unit, args.writes))
        finally:
            engine.dispose()
    print(f"the broker-sent mark, {args.writes} writes a round, {args.rounds} rounds alternating (medians)")
    print(f"  {'':28} {'wall ms':>9} {'client CPU ms':>14}")
    medians = {
        name: (statistics.median(w for w, _ in s), statistics.median(c for _, c in s))
        for name, s in samples.items()
    }
    for name, (wall, cpu) in medians.items():
        print(f"  {name:28} {wall:9.3f} {cpu:14.3f}")
    (base_wall, base_cpu), (wall, cpu) = medians.values()
    print(f"  one_statement / baseline: wall {wall / base_wall:.2f}x, client CPU {cpu / base_cpu:.2f}x")
    return 0


if __name__ == "__main__":
    stop_cleanly_on_termination()
    raise SystemExit(main())
