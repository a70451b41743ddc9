"""Byte-bounded pages (worker.core.paging): the rows one answer takes."""

from __future__ import annotations

import pytest

from worker.core.paging import taken_within


@pytest.mark.parametrize(
    ("sizes", "budget", "taken"),
    [
        ([], 10, 0),
        ([5, 5, 5], 10, 2),  # up to the budget exactly
        ([5, 6], 10, 1),
        ([50, 1], 10, 1),  # one over the budget still comes, alone
        ([1, 1, 1], 100, 3),
    ],
)
def test_a_page_takes_the_leading_rows_that_fit_and_at_least_one(
    sizes: list[int], budget: int, taken: int
) -> None:
    assert taken_within(sizes, budget) == taken
