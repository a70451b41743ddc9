"""Pages bounded by bytes as well as by count: how many of the leading rows one answer takes."""

from __future__ import annotations

from collections.abc import Sequence


def taken_within(sizes: Sequence[int], max_bytes: int) -> int:
    """How many of the leading ``sizes`` (each row's bytes, in page order) fit in ``max_bytes``: at
    least one, so a row larger than the budget still comes, alone (0 only when there are none)."""
    taken = total = 0
    for size in sizes:
        if taken and total + size > max_bytes:
            break
        taken, total = taken + 1, total + size
    return taken


__all__ = ["taken_within"]
