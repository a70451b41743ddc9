"""Planning one entity's consolidation against a large pool of its facts: each fact's normalized text,
words and vector norm worked out once (``FactView``'s cached properties) against once a pair.

    .venv/bin/python bench/consolidation_plan.py [--pool 50000] [--new 10] [--dims 256] [--runs 3] [--kinds 1]

Builds ``--pool`` current facts of one entity (short sentences over a small vocabulary, as a person's
facts are, each with a ``--dims`` embedding as ``facts.embedding`` holds it) and ``--new`` new facts,
then times ``plan_consolidation`` (every new fact triaged against the pool and the new facts before it)
and, as the baseline in the same run, the same pairs triaged by the public per-pair functions that
recompute both facts' words, normalized text and vector norms for every pair (what planning did
before); and planning as it was before the kind buckets and the matrix cosines (each new fact against
every kind's facts, a pure-Python cosine a pair, FactView's caches in use). Prints the medians and the
ratios, and the memory the pool takes (vectors as arrays of doubles, as the consolidation store keeps
them). Pure computation: no database, no model.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
import tracemalloc
from array import array
from datetime import UTC, datetime, timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from worker.core.consolidation import (  # noqa: E402
    FactView,
    candidates,
    cosine,
    entity_words,
    normalize_fact_text,
    order_key,
    word_overlap,
)
from worker.core.consolidation_plan import plan_consolidation  # noqa: E402

ENTITY = "people/alice-example"
VERBS = "lives works moved likes plans visited bought started joined prefers hates owns studies runs"
PLACES = "Lisbon Porto Berlin Kyoto Austin Paris Madrid Rome Oslo Lima Quito Cairo Accra Hanoi"


KINDS = ("fact", "event", "preference", "commitment", "belief")


def facts(count: int, dims: int, start: int, draw: random.Random, kinds: int = 1) -> list[FactView]:
    day = datetime(2026, 1, 1, tzinfo=UTC)
    return [
        FactView(
            start + n,
            f"Alice Example {draw.choice(VERBS.split())} {draw.choice(PLACES.split())} with group {n % 97}.",
            KINDS[n % kinds],
            day - timedelta(minutes=n),
            array("d", (draw.gauss(0.0, 1.0) for _ in range(dims))),  # as the store keeps them
            start + n,
        )
        for n in range(count)
    ]


def per_pair(pending: list[FactView], pool: list[FactView]) -> int:
    """The baseline: every pair's words, normalized text and norms recomputed (the old triage)."""
    ignore = entity_words(ENTITY)
    asked = 0
    for n, new in enumerate(pending):
        for old in [*pool, *pending[:n]]:
            overlap = word_overlap(new.text, old.text, ignore)
            vector = cosine(new.embedding, old.embedding)
            same = normalize_fact_text(new.text) == normalize_fact_text(old.text)
            asked += same or overlap >= 0.5 or (vector or 0.0) >= 0.8
    return asked


def whole_pool(pending: list[FactView], pool: list[FactView]) -> int:
    """Planning before the kind buckets and the matrix cosines: each new fact triaged against every
    fact of the entity (the other kinds' pairs computed, then dropped as unrelated), a pure-Python
    cosine a pair, FactView's caches in use."""
    ignore = entity_words(ENTITY)
    known = list(pool)
    asked = 0
    for new in sorted(pending, key=order_key):
        found = candidates(new, known, ignore=ignore)
        asked += len(found)
        known.append(new)
    return asked


def timed(work: object, runs: int) -> float:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        work()  # type: ignore[operator]
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--pool", type=int, default=50_000)
    parser.add_argument("--new", type=int, default=10)
    parser.add_argument("--dims", type=int, default=256)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--kinds",
        type=int,
        default=1,
        choices=range(1, 6),
        help="the pool's facts take this many kinds in turn",
    )
    args = parser.parse_args(argv)
    draw = random.Random(7)
    tracemalloc.start()
    pool = facts(args.pool, args.dims, 1, draw, args.kinds)
    held = tracemalloc.get_traced_memory()[0] / 2**20
    tracemalloc.stop()
    pending = facts(args.new, args.dims, 10**9, draw, args.kinds)
    print(
        f"{args.pool:,} stored facts of one entity ({args.dims}-dim vectors: {held:.0f} MiB as loaded), "
        f"{args.new} new, {args.kinds} kind(s); median of {args.runs}:"
    )
    base = timed(lambda: per_pair(pending, pool), args.runs)
    # Fresh views each run, so the cached properties are worked out inside the timing.
    whole = timed(lambda: whole_pool(facts_again(pending), facts_again(pool)), args.runs)
    head = timed(lambda: plan_consolidation(facts_again(pending), facts_again(pool), ENTITY), args.runs)
    print(f"  {'every pair recomputed (baseline)':40} {base:8.2f} s")
    print(f"  {'pair by pair, every kind (before)':40} {whole:8.2f} s   {whole / base:.2f}x")
    label = "own kind, cosines by matrix (HEAD)"
    print(f"  {label:40} {head:8.2f} s   {head / base:.2f}x   ({head / whole:.2f}x before)")
    return 0


def facts_again(views: list[FactView]) -> list[FactView]:
    return [FactView(v.id, v.text, v.kind, v.valid_from, v.embedding, v.created_order) for v in views]


if __name__ == "__main__":
    raise SystemExit(main())
