"""The benchmarks' check that no other database worked during a run (their Postgres CPU figures add up
every Postgres process on the machine)."""

from __future__ import annotations

from bench.pipeline import busy_elsewhere


def test_a_quiet_run_counts_what_was_committed_elsewhere() -> None:
    assert busy_elsewhere({1: 100, 2: 50}, {1: 103, 2: 50}) == (3, False)


def test_a_database_made_during_the_run_counts_all_its_commits() -> None:
    assert busy_elsewhere({1: 100}, {1: 100, 7: 40}) == (40, False)


def test_a_database_dropped_during_the_run_is_said_whatever_the_count() -> None:
    """Its commits leave the statistics with it: summed, the count went down and nothing was said."""
    assert busy_elsewhere({1: 100, 2: 5_000}, {1: 101}) == (1, True)
