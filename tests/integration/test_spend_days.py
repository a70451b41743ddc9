"""llm_spend_days: the ledger adds every call's cost to its day and budget scope, in the statement that
records the call, and the day budgets read it (never the day's llm_calls rows)."""

from __future__ import annotations

import threading
from decimal import Decimal

import pytest
from sqlalchemy import func, select, text
from sqlalchemy.orm import Session, sessionmaker

from models import LLMCall, LLMSpendDay
from worker.accounting import PRICES_KEY, SEARCH_PURPOSES, Budget, Ledger, LLMCallRecord
from worker.llm.types import Usage

pytestmark = pytest.mark.integration

# One input token of model "m" costs a cent.
LEDGER = Ledger(lambda key: '{"m": {"input": 10000, "output": 0}}' if key == PRICES_KEY else None)
UTC_TODAY = text("(now() AT TIME ZONE 'UTC')::date")


def call(purpose: str, cents: int | None) -> LLMCallRecord:
    """A call of ``purpose`` that cost ``cents`` (None: it failed before the provider counted tokens)."""
    usage = None if cents is None else Usage(input_tokens=cents)
    return LLMCallRecord(purpose, "p", "m", usage, latency_ms=1, outcome="ok" if usage else "provider_error")


def spend_by_scope(session: Session) -> dict[str, Decimal]:
    rows = session.execute(
        select(LLMSpendDay.scope, func.sum(LLMSpendDay.cost_usd))
        .where(LLMSpendDay.day == UTC_TODAY)
        .group_by(LLMSpendDay.scope)
    )
    return {scope: total for scope, total in rows}


def calls_by_scope(session: Session) -> dict[str, Decimal]:
    """The same totals worked out from the llm_calls rows, as the budget used to."""
    totals: dict[str, Decimal] = {}
    for purpose, cost in session.execute(select(LLMCall.purpose, LLMCall.cost_usd)):
        if cost:
            scope = "search" if purpose in SEARCH_PURPOSES else "work"
            totals[scope] = totals.get(scope, Decimal(0)) + cost
    return totals


def budgets(factory: sessionmaker[Session]) -> tuple[Budget, Budget]:
    return Budget(factory, lambda key: None, ttl=0), Budget(factory, lambda key: None, ttl=0, search=True)


def test_each_calls_cost_goes_to_its_days_scope_with_the_call(tx_factory: sessionmaker[Session]) -> None:
    with tx_factory.begin() as session:
        LEDGER.record_many(
            session, [call("extraction", 150), call("search_expansion", 7), call("extraction", None)]
        )
    with tx_factory.begin() as session:
        LEDGER.record(session, call("consolidation", 25))
        LEDGER.record(session, call("search_embedding", 3))
        LEDGER.record(session, call("extraction", 0))  # free: adds nothing
    with tx_factory() as session:
        assert spend_by_scope(session) == {"work": Decimal("1.75"), "search": Decimal("0.10")}
        assert spend_by_scope(session) == calls_by_scope(session)
        # One connection wrote them all: one row per scope, the backend's own.
        backends = session.scalars(select(LLMSpendDay.backend)).all()
        assert backends == [session.scalar(text("SELECT pg_backend_pid()"))] * 2
    work, search = budgets(tx_factory)
    assert (work.spent_today(), search.spent_today()) == (Decimal("1.75"), Decimal("0.10"))


def test_a_rolled_back_call_spends_nothing(tx_factory: sessionmaker[Session]) -> None:
    with pytest.raises(RuntimeError), tx_factory.begin() as session:
        LEDGER.record(session, call("extraction", 500))
        raise RuntimeError("the segment's commit failed")
    with tx_factory() as session:
        assert spend_by_scope(session) == {}
    assert budgets(tx_factory)[0].spent_today() == 0


def test_concurrent_writers_lose_no_spend(factory: sessionmaker[Session]) -> None:
    """Eight threads on their own connections, each transaction recording both scopes in both orders."""
    errors: list[BaseException] = []

    def write(n: int) -> None:
        try:
            for i in range(15):
                purposes = ["extraction", "search_embedding"][:: 1 if (n + i) % 2 else -1]
                with factory.begin() as session:
                    for purpose in purposes:
                        LEDGER.record(session, call(purpose, 1 + n))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors
    expected = Decimal(sum(15 * (1 + n) for n in range(8))) / 100
    with factory() as session:
        assert spend_by_scope(session) == {"work": expected, "search": expected}
        assert spend_by_scope(session) == calls_by_scope(session)
