"""Whether a calibration recompute is due, asked by every feedback, at a million observations.

    .venv/bin/python bench/recompute_due.py [--observations 1000000] [--every 50] [--runs 7]

With no threshold version yet (or versions lagging: no worker on the calibration queue, its switch
off), every observation is newer than the last version. The baseline counts them all (what each
feedback did before); ``observations_since_last_version(session, every)`` counts only as far as the
question needs. Prints the median of each and the ratio.

Needs the local Postgres (127.0.0.1:5432); creates and drops its own database.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from sqlalchemy import func, select

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from models.tables import CALIBRATION_OBSERVATIONS  # noqa: E402
from tests.service import fill_table, migrated_database, stop_cleanly_on_termination  # noqa: E402
from worker.calibration.queries import observations_since_last_version  # noqa: E402

SERVER = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
FULL_COUNT = select(func.count()).select_from(CALIBRATION_OBSERVATIONS)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--observations", type=int, default=1_000_000)
    parser.add_argument("--every", type=int, default=50, help="FACTMILL_CALIBRATION_RECOMPUTE_EVERY")
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args(argv)
    with migrated_database(SERVER) as (url, factory):
        fill_table(
            url,
            "calibration_observations",
            "INSERT INTO calibration_observations (coverage, answer_kept, origin) "
            "SELECT random(), g %% 3 <> 0, 'bench' FROM generate_series(1, %(n)s) g",
            n=args.observations,
        )
        full, capped = [], []
        for _ in range(args.runs):
            with factory() as session:
                started = time.perf_counter()
                session.execute(FULL_COUNT).scalar_one()
                full.append((time.perf_counter() - started) * 1000)
                started = time.perf_counter()
                observations_since_last_version(session, args.every)
                capped.append((time.perf_counter() - started) * 1000)
    base, head = statistics.median(full), statistics.median(capped)
    print(f"{args.observations:,} observations, no threshold version; medians of {args.runs}:")
    print(f"  {'every observation counted (baseline)':40} {base:9.2f} ms")
    print(f"  {f'counted up to {args.every}':40} {head:9.2f} ms   {head / base:.3f}x")
    return 0


if __name__ == "__main__":
    stop_cleanly_on_termination()
    raise SystemExit(main())
