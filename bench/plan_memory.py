"""Memory a backfill's plan holds per request until it is stored, against the way it was held before.

    .venv/bin/python bench/plan_memory.py [--requests 100000]

A backfill plans every request before it stores any (one transaction: a crash plans again from nothing).
The baseline, measured in the same run, holds them as the planner did before: unnamed, then named (two
lists), then one ORM object each in the session until the commit. The current way names each request as
it joins its batch and inserts them in chunks of plain rows. Python's allocations (tracemalloc), per
request; what the chunked INSERT sends is not counted (it is the same either way).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import tracemalloc
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from sqlalchemy.orm import Session  # noqa: E402

from models import BackfillRequest  # noqa: E402
from worker.extraction.backfill_rows import PlannedRequest  # noqa: E402

KEY = "fm1a2b3c4db12n0"


def unnamed(n: int) -> list[PlannedRequest]:
    """``n`` requests, 20 segments a page, as the planner makes them."""
    return [
        PlannedRequest(
            "",
            1000 + i // 20,
            f"conversations/page-{i // 20:06d}",
            i % 20 * 30,
            hashlib.sha256(b"%d" % i).hexdigest()[:32],
        )
        for i in range(n)
    ]


def named(r: PlannedRequest) -> PlannedRequest:
    return replace(r, custom_id=f"{KEY}-p{r.page_id}-m{r.end_message}")


def before(n: int) -> int:
    tracemalloc.start()
    first = unnamed(n)
    second = [named(r) for r in first]
    session = Session()
    session.add_all(
        BackfillRequest(
            batch_id=1,
            custom_id=r.custom_id,
            page_id=r.page_id,
            slug=r.slug,
            end_message=r.end_message,
            segment_hash=r.segment_hash,
        )
        for r in second
    )
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del first, second, session
    return held


def now(n: int, chunk: int = 5_000) -> int:
    tracemalloc.start()
    plan = [named(r) for r in unnamed(n)]
    rows = [
        {"batch_id": 1, "custom_id": r.custom_id, "page_id": r.page_id, "slug": r.slug,
         "end_message": r.end_message, "segment_hash": r.segment_hash}
        for r in plan[:chunk]
    ]  # fmt: skip
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del plan, rows
    return held


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=100_000)
    args = parser.parse_args()
    n = max(1, args.requests)
    baseline, current = before(n), now(n)
    print(f"a plan of {n:,} requests held until it is stored (tracemalloc, Python allocations):")
    print(f"  before (two lists + ORM objects): {baseline / n:6.0f} B a request, {baseline / 2**20:8.1f} MiB")
    print(f"  now (one list + a 5,000-row chunk): {current / n:4.0f} B a request, {current / 2**20:8.1f} MiB")
    print(f"  ratio {current / baseline:.2f}; a million requests: {current * 1e6 / n / 2**30:.2f} GiB "
          f"(before: {baseline * 1e6 / n / 2**30:.2f} GiB)")  # fmt: skip


if __name__ == "__main__":
    main()
