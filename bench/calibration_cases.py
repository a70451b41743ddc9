"""What counting one case per compaction adds to a calibration recompute's evaluation, at a million
observations: ``one_case_per_compaction`` against ``evaluate`` (which calls it, then splits and judges).

    .venv/bin/python bench/calibration_cases.py [--observations 1000000] [--runs 3]

Three shapes of the same count: labels of no compaction (CSV imports), one label a compaction (the
usual feedback), and three labels a compaction (a judge panel). Prints the medians of ``--runs`` and
the share of the whole evaluation the grouping takes. Pure computation: no database.
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from worker.core.calibration import Observation, evaluate, one_case_per_compaction  # noqa: E402


def median_ms(work: Callable[[], object], runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        work()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def shapes(count: int, draw: random.Random) -> dict[str, list[Observation]]:
    def made(compaction: Callable[[int], int | None]) -> list[Observation]:
        # Kept cases cover more than lost ones, as real labels do: a version can be computed.
        return [
            Observation(i, draw.random() * 0.6 + (0.4 if kept else 0.0), kept, compaction(i))
            for i in range(1, count + 1)
            for kept in (draw.random() < 0.7,)
        ]

    return {
        "no compaction named": made(lambda i: None),
        "one label a compaction": made(lambda i: i),
        "three labels a compaction": made(lambda i: i // 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--observations", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    draw = random.Random(7)
    print(f"{args.observations:,} observations; medians of {args.runs}")
    print(f"  {'shape':28} {'grouping':>11} {'evaluate (baseline)':>20} {'share':>7}")
    for name, observations in shapes(args.observations, draw).items():
        grouping = median_ms(functools.partial(one_case_per_compaction, observations), args.runs)
        judged = functools.partial(evaluate, observations, alpha=0.1, target_recall=0.9, min_observations=20)
        whole = median_ms(judged, args.runs)
        print(f"  {name:28} {grouping:8.0f} ms {whole:17.0f} ms {grouping / whole:7.2f}")


if __name__ == "__main__":
    main()
