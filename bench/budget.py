"""The day budget's check at a busy day's scale, and what keeping the day's spend costs each recorded call.

    .venv/bin/python bench/budget.py [--calls 1000000] [--backends 500] [--checks 200] [--writes 400]

1. Reads: ``--calls`` llm_calls rows dated today (one in twenty a search purpose), and llm_spend_days
   as the ledger would have left it after ``--backends`` connections wrote them. ``Budget.spent_today``
   (what a worker runs once a second, per scope) against the baseline: the sum over the day's
   llm_calls rows that the budget ran before (the same totals, checked).
2. Writes: the ledger's statement (the calls and their day's spend, one round trip) against the same
   INSERT without the spend, each in its own transaction of three calls (a segment commit's), in
   alternating rounds.

Needs the local Postgres (127.0.0.1:5432); creates and drops its own database.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path

import psycopg
from sqlalchemy import TextClause, text
from sqlalchemy.orm import sessionmaker

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from models.bulk import BulkInsert  # noqa: E402
from models.tables import LLM_CALLS  # noqa: E402
from tests.service import at_least, fresh_database, stop_cleanly_on_termination  # noqa: E402
from worker import db  # noqa: E402
from worker.accounting import SEARCH_PURPOSES, Budget, Ledger, LLMCallRecord  # noqa: E402
from worker.accounting.ledger import _COLUMNS  # noqa: E402
from worker.llm.types import Usage  # noqa: E402

SERVER = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
SEARCH = ", ".join(f"'{p}'" for p in SEARCH_PURPOSES)


def old_day_sum(search: bool) -> TextClause:
    """The day budget's query before llm_spend_days (worker/accounting/budget.py at 247d363)."""
    return text(
        "SELECT coalesce(sum(cost_usd), 0) FROM llm_calls "
        "WHERE created_at >= date_trunc('day', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC' "
        f"AND purpose {'' if search else 'NOT'} IN ({SEARCH})"
    )


def fill(url: str, calls: int, backends: int) -> None:
    """Today's calls, and the day's spend as ``backends`` connections would have written it."""
    with psycopg.connect(url.replace("+psycopg", ""), autocommit=True) as conn:
        conn.execute(
            "INSERT INTO llm_calls (provider, model, purpose, input_tokens, output_tokens, latency_ms,"
            " outcome, cost_usd, created_at)"
            " SELECT 'openai', 'gpt-4o-mini',"
            " CASE WHEN g %% 20 = 0 THEN 'search_embedding' ELSE 'extraction' END, 1500, 200, 900, 'ok',"
            " 0.000345, date_trunc('day', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'"
            " + (g %% 36000) * interval '1 millisecond' FROM generate_series(1, %s) g",
            (calls,),
        )
        conn.execute(
            "INSERT INTO llm_spend_days (day, scope, backend, cost_usd) "
            f"SELECT (created_at AT TIME ZONE 'UTC')::date, CASE WHEN purpose IN ({SEARCH}) THEN 'search' "
            "ELSE 'work' END, id %% %s, sum(cost_usd) FROM llm_calls GROUP BY 1, 2, 3",
            (backends,),
        )
        conn.execute("VACUUM ANALYZE llm_calls")
        conn.execute("VACUUM ANALYZE llm_spend_days")


def timed(fn: Callable[[], object], times: int) -> tuple[list[float], object]:
    samples, value = [], None
    for _ in range(times):
        started = time.perf_counter()
        value = fn()
        samples.append((time.perf_counter() - started) * 1000)
    return samples, value


def pct(samples: list[float], q: float) -> float:
    return sorted(samples)[min(len(samples) - 1, int(q * len(samples)))]


def reads(factory: sessionmaker, checks: int) -> None:  # type: ignore[type-arg]
    print(f"1. the day budget's check, {checks} checks a scope (ms)")
    for search in (False, True):
        scope = "search" if search else "work"
        budget = Budget(factory, lambda key: None, ttl=0, search=search)
        query = old_day_sum(search)

        def old(query: TextClause = query) -> Decimal:
            with factory() as session:
                return Decimal(session.scalar(query))

        base, old_total = timed(old, max(5, checks // 10))
        new, new_total = timed(budget.spent_today, checks)
        assert old_total == new_total, (old_total, new_total)
        ratio = statistics.median(base) / statistics.median(new)
        print(
            f"   {scope:<6} sum of the day's llm_calls (baseline): p50 {statistics.median(base):8.2f}"
            f"  p95 {pct(base, 0.95):8.2f}\n"
            f"   {scope:<6} Budget.spent_today (llm_spend_days):  p50 {statistics.median(new):8.2f}"
            f"  p95 {pct(new, 0.95):8.2f}   {ratio:,.0f}x faster; both say ${new_total}"
        )


def writes(factory: sessionmaker, rounds: int) -> None:  # type: ignore[type-arg]
    ledger = Ledger(lambda key: None)  # list prices: gpt-4o-mini costs something
    plain = BulkInsert(LLM_CALLS, _COLUMNS, returning="id")
    calls = [
        LLMCallRecord(
            "extraction",
            "openai",
            "gpt-4o-mini",
            Usage(input_tokens=1500, output_tokens=200),
            latency_ms=900,
            outcome="ok",
        )
    ] * 3

    def with_spend() -> object:
        with factory.begin() as session:
            return ledger.record_many(session, calls)

    def without_spend() -> object:
        with factory.begin() as session:
            return plain.new_keys(session, [ledger.row(call) for call in calls])

    timed(with_spend, 20)
    timed(without_spend, 20)
    old, new = [], []
    for _ in range(rounds // 20):
        old += timed(without_spend, 20)[0]
        new += timed(with_spend, 20)[0]
    print(f"\n2. recording a commit's three calls, {len(new)} transactions each, alternating (ms)")
    rows = (("INSERT of the calls alone (baseline)", old), ("the ledger's (calls + spend)", new))
    for label, samples in rows:
        print(f"   {label:<38} p50 {statistics.median(samples):6.3f}  p95 {pct(samples, 0.95):6.3f}")
    print(f"   the ledger's p50 is {statistics.median(new) / statistics.median(old):.2f}x the baseline's")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--calls",
        type=at_least(1, "the day's spend must be a sum of calls"),
        default=1_000_000,
        help="llm_calls rows dated today",
    )
    parser.add_argument(
        "--backends",
        type=at_least(1, "the spend is kept in one row a connection at least"),
        default=500,
        help="connections that wrote the day's spend",
    )
    parser.add_argument("--checks", type=at_least(1, "a median needs a sample"), default=200)
    parser.add_argument(
        "--writes",
        type=at_least(20, "the writes alternate in rounds of 20"),
        default=400,
        help="transactions of each kind in part 2",
    )
    args = parser.parse_args()
    with fresh_database(SERVER, "bench") as url:
        db.upgrade(url)
        factory = sessionmaker(db.get_engine(url), expire_on_commit=False)
        started = time.perf_counter()
        fill(url, args.calls, args.backends)
        print(
            f"bench/budget.py: {args.calls:,} llm_calls rows today, the day's spend in "
            f"{args.backends} rows a scope (filled in {time.perf_counter() - started:.1f} s)\n"
        )
        reads(factory, args.checks)
        writes(factory, args.writes)


if __name__ == "__main__":
    stop_cleanly_on_termination()
    main()
