"""The chaos suite at CI size: bench/chaos.py's own harness (its own Postgres and Redis, every service
a `factmill` process) over 30 pages with 4 worker SIGKILLs, a Redis FLUSHALL, a Postgres
restart, 30% simulator faults and duplicate webhook deliveries, compared page by page with a clean pass."""

from __future__ import annotations

import pytest

from bench.chaos import ChaosOptions, run_chaos

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


def test_chaos_at_ci_size_loses_nothing_duplicates_nothing_changes_nothing():
    result = run_chaos(
        ChaosOptions(
            pages=30, kills=4, workers=2, fault_rate=0.3, seed=12, redis_restart=False, progress=False
        )
    )
    print("\n".join([*result.notes, result.line()]))
    # Everything the suite is meant to inflict did happen...
    assert result.kills == 4
    assert result.events["redis flushall"] == 1
    assert result.events["postgres restart"] == 1
    assert result.events["duplicate deliveries"] >= 60
    assert sum(n for kind, n in result.events.items() if kind.startswith("LLM fault")) > 0
    # ...the planted permanent faults were the only skips, in both passes...
    assert result.skipped and not result.unexpected_skips, result.unexpected_skips
    # ...and the done-when counts are all zero.
    assert result.problems() == {}, "\n".join(
        [result.line(), *result.notes, *result.lost, *result.differ, *result.failed]
    )
