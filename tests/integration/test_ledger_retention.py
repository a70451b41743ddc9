"""llm_calls and extraction_audit rows past FACTMILL_LEDGER_RETENTION_DAYS: the sweep deletes them,
oldest first, a batch at a time; a decision or a newer audit row naming a deleted call stays, and the
day's spend (the budgets) and /metrics' counters lose nothing."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
from sqlalchemy import func, select, update
from sqlalchemy.orm import Session, sessionmaker

from models import (
    SEGMENTS_COUNTER,
    ConsolidationDecision,
    ExtractionAudit,
    Job,
    LLMCall,
    LLMCallTotal,
    LLMSpendDay,
    RowCount,
    expire_ledger,
)
from tests.integration.test_api import make_runtime
from tests.maintenance import maintained
from tests.rows import audit_row
from worker.accounting import Ledger, LLMCallRecord
from worker.config_store import ConfigReader
from worker.llm.types import Usage
from worker.settings import Settings

pytestmark = pytest.mark.integration

KEPT = timedelta(days=30)


def call(factory: sessionmaker[Session], age_days: float) -> int:
    """An LLM call recorded through the ledger (so the day's spend and the counters see it), aged."""
    record = LLMCallRecord("extraction", "simulator", "gpt-4o", Usage(1000, 100), 5, "ok")
    with factory.begin() as session:
        call_id = Ledger(lambda _: None).record(session, record)
        session.execute(
            update(LLMCall)
            .where(LLMCall.id == call_id)
            .values(created_at=func.now() - timedelta(days=age_days))
        )
    return call_id


def audit(factory: sessionmaker[Session], call_id: int | None, age_days: float) -> int:
    with factory.begin() as session:
        row = audit_row(llm_call_id=call_id)
        session.add(row)
        session.flush()
        session.execute(
            update(ExtractionAudit)
            .where(ExtractionAudit.id == row.id)
            .values(created_at=func.now() - timedelta(days=age_days))
        )
        return row.id


def left(factory: sessionmaker[Session]) -> tuple[set[int], dict[int, int | None]]:
    with factory() as session:
        calls = set(session.scalars(select(LLMCall.id)))
        rows = session.execute(select(ExtractionAudit.id, ExtractionAudit.llm_call_id)).all()
    audits = {audit_id: call_id for audit_id, call_id in rows}
    return calls, audits


def spend(factory: sessionmaker[Session]) -> tuple[Decimal, int, int]:
    """The day's spend (what budgets read) and /metrics' call and segment counters."""
    with factory() as session:
        cost = session.scalar(select(func.coalesce(func.sum(LLMSpendDay.cost_usd), 0))) or Decimal(0)
        calls = session.scalar(select(func.coalesce(func.sum(LLMCallTotal.calls), 0))) or 0
        segments = session.scalar(
            select(func.coalesce(func.sum(RowCount.n), 0)).where(RowCount.counter == SEGMENTS_COUNTER)
        )
    return cost, calls, segments or 0


def test_old_calls_and_audit_rows_go_oldest_first_and_what_named_them_stays(
    tx_factory: sessionmaker[Session],
) -> None:
    oldest, old, recent = call(tx_factory, 90), call(tx_factory, 31), call(tx_factory, 29)
    old_audit = audit(tx_factory, oldest, 90)
    newer_audit = audit(tx_factory, old, 10)  # a retried segment's row, newer than the call it names
    recent_audit = audit(tx_factory, recent, 29)
    with tx_factory.begin() as session:
        session.add(
            ConsolidationDecision(
                source_id="default",
                entity_key="e",
                decision="new",
                decided_by="model",
                reason="r",
                llm_call_id=old,
            )
        )
    spent = spend(tx_factory)
    with tx_factory.begin() as session:
        assert expire_ledger(session, KEPT, 1) == (1, 1)  # the oldest of each
    assert left(tx_factory) == ({old, recent}, {newer_audit: old, recent_audit: recent})
    with tx_factory.begin() as session:
        assert expire_ledger(session, KEPT, 5) == (0, 1)
        assert expire_ledger(session, KEPT, 5) == (0, 0)
    assert left(tx_factory) == ({recent}, {newer_audit: None, recent_audit: recent})
    assert old_audit not in left(tx_factory)[1]
    with tx_factory() as session:
        assert session.scalars(select(ConsolidationDecision.llm_call_id)).all() == [None]
    assert spend(tx_factory) == spent and spent[0] > 0 and spent[1:] == (3, 3)  # counters, not gauges


def test_the_sweep_deletes_them_only_when_a_retention_is_set(
    database_url: str, tx_factory: sessionmaker[Session]
) -> None:
    gone, kept = call(tx_factory, 10), call(tx_factory, 6)
    audit(tx_factory, gone, 10)
    report = maintained(make_runtime(database_url, tx_factory))
    assert (report.expired_audit_rows, report.expired_llm_calls) == (0, 0)
    runtime = make_runtime(database_url, tx_factory, ledger_retention_days=7)
    report = maintained(runtime)
    assert (report.expired_audit_rows, report.expired_llm_calls) == (1, 1)
    assert left(tx_factory) == ({kept}, {})


def test_a_retention_under_a_week_is_refused() -> None:
    with pytest.raises(ValueError, match="ledger_retention_days"):
        Settings(ledger_retention_days=6)


def test_a_pending_jobs_calls_stay_its_own_budget_sums_them(tx_factory: sessionmaker[Session]) -> None:
    """A job paused for its own budget longer than the ledger is kept had its calls deleted: its spend
    read $0, the sweeper found it room, and it spent its whole budget again every retention period."""
    from worker.accounting import Budget
    from worker.config_store import set_config

    with tx_factory.begin() as session:
        paused = Job(kind="extraction", subject="default|p", status="paused", pause_reason="budget")
        done = Job(kind="extraction", subject="default|q", status="succeeded")
        session.add_all([paused, done])
        session.flush()
        session.execute(update(Job).values(budget_since=func.now() - timedelta(days=60)))
        set_config(session, "llm.budget_job_usd", "0.000001")
    calls = {job.id: call(tx_factory, 40) for job in (paused, done)}
    with tx_factory.begin() as session:
        for job_id, call_id in calls.items():
            session.execute(update(LLMCall).where(LLMCall.id == call_id).values(job_id=job_id))
    budget = Budget(tx_factory, ConfigReader(tx_factory, ttl=0).get, ttl=0)
    assert budget.spent_by_job(paused.id) > 0
    with tx_factory.begin() as session:
        assert expire_ledger(session, KEPT, 10) == (0, 1)  # the finished job's call alone
    assert left(tx_factory)[0] == {calls[paused.id]}
    assert budget.spent_by_job(paused.id) > 0  # still spent: not woken
    # A call from before its budget last started over is no longer counted: it goes.
    counted_before = call(tx_factory, 50)
    with tx_factory.begin() as session:
        session.execute(update(LLMCall).where(LLMCall.id == counted_before).values(job_id=paused.id))
        session.execute(
            update(Job).where(Job.id == paused.id).values(budget_since=func.now() - timedelta(days=45))
        )
        assert expire_ledger(session, KEPT, 10) == (0, 1)
    assert left(tx_factory)[0] == {calls[paused.id]}
    with tx_factory.begin() as session:
        session.execute(update(Job).where(Job.id == paused.id).values(status="failed"))
        assert expire_ledger(session, KEPT, 10) == (0, 1)  # ended: its calls go as any other
