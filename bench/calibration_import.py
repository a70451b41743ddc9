"""Importing a CSV of calibration observations (`factmill calibration import`), against reading and
checking the same file without storing it.

    .venv/bin/python bench/calibration_import.py [--rows 200000] [--rounds 3]

Writes a CSV of ``--rows`` observations (coverage, label), then times, in a fresh database each round,
``worker.calibration.import_csv`` (read, check, store 1,000 rows a statement, each row's key made from
the file) and, as the baseline, ``worker.core.calibration_csv.parse_observations_csv`` on the same bytes
(what importing costs before the database). Prints medians and the ratio, and the time per row.

Needs the local Postgres (127.0.0.1:5432); creates and drops its own databases.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.service import migrated_database, stop_cleanly_on_termination  # noqa: E402
from worker.calibration import import_csv  # noqa: E402
from worker.core.calibration_csv import parse_observations_csv  # noqa: E402

SERVER = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"


def write_csv(path: Path, rows: int) -> None:
    chooser = random.Random(7)
    lines = ["coverage,answer_kept"]
    lines += [f"{chooser.random():.6f},{chooser.choice(('true', 'false'))}" for _ in range(rows)]
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "observations.csv"
        write_csv(path, args.rows)
        parsed, stored = [], []
        for _ in range(args.rounds):
            started = time.perf_counter()
            read = parse_observations_csv(path.read_text(), default_origin="csv", file_digest="d")
            good, errors = read.good, read.errors
            parsed.append(time.perf_counter() - started)
            assert len(good) == args.rows and not errors
            with migrated_database(SERVER) as (_, factory):
                started = time.perf_counter()
                report = import_csv(factory, path, recompute_every=50)
                stored.append(time.perf_counter() - started)
                assert len(report.added) == args.rows, (len(report.added), report.errors[:3])
    base, head = statistics.median(parsed), statistics.median(stored)
    print(f"{args.rows:,} observations, median of {args.rounds}:")
    print(f"  {'read and check the CSV alone (baseline)':42} {base:8.2f} s")
    print(f"  {'import_csv (read, check, store)':42} {head:8.2f} s   {head / base:.2f}x")
    print(f"  {'a row, stored':42} {head * 1e6 / args.rows:8.1f} us")
    return 0


if __name__ == "__main__":
    stop_cleanly_on_termination()
    raise SystemExit(main())
