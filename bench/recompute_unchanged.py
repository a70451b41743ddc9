"""The calibration schedule's recompute when no feedback came since the last version, at a million
observations: found out from Postgres's count, against loading every observation first.

    .venv/bin/python bench/recompute_unchanged.py [--observations 1000000] [--runs 5]

Fills a fresh database with ``--observations`` observations, computes a version, then times
``recompute`` again (outcome "unchanged") and, as the baseline in the same run, what that recompute did
before: load every observation into Python (``load_observations``) to compare its count and newest id.
Prints the medians, the ratio, and the Python memory each takes (tracemalloc's peak).

Needs the local Postgres (127.0.0.1:5432); creates and drops its own database.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.service import fill_table, migrated_database, rolled_back_ms, stop_cleanly_on_termination  # noqa: E402
from worker.calibration import recompute  # noqa: E402
from worker.calibration.queries import load_observations  # noqa: E402

SERVER = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
PARAMS: dict[str, Any] = {"alpha": 0.1, "target_recall": 0.9, "min_observations": 20}


def measured(factory: Any, work: Callable[[Any], object], runs: int) -> tuple[float, float]:
    """(median milliseconds of ``runs``, peak MiB of one more run under tracemalloc, which slows
    allocation-heavy work too much to be timed with it)."""
    times = rolled_back_ms(factory, runs, work)
    tracemalloc.start()
    rolled_back_ms(factory, 1, work)
    peak = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    return statistics.median(times), peak


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--observations", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args(argv)
    with migrated_database(SERVER) as (url, factory):
        fill_table(
            url,
            "calibration_observations",
            "INSERT INTO calibration_observations (coverage, answer_kept, origin) "
            "SELECT random(), random() < 0.8, 'bench' FROM generate_series(1, %(n)s) g",
            n=args.observations,
        )
        first = recompute(factory, **PARAMS)
        print(f"{args.observations:,} observations; version {first.version} {first.outcome}")

        def unchanged(_: Any) -> None:
            assert recompute(factory, **PARAMS).outcome == "unchanged"

        base, base_peak = measured(factory, load_observations, args.runs)
        head, head_peak = measured(factory, unchanged, args.runs)
    print(f"medians of {args.runs}:")
    print(f"  {'every observation loaded (baseline)':40} {base:9.1f} ms   {base_peak:7.1f} MiB")
    label = "recompute, nothing new (HEAD)"
    print(f"  {label:40} {head:9.1f} ms   {head_peak:7.1f} MiB   {head / base:.3f}x")
    return 0


if __name__ == "__main__":
    stop_cleanly_on_termination()
    raise SystemExit(main())
