"""LLM budgets: exhaustion is its own outcome (never "0 facts"), jobs wait and resume; spend reports."""

from __future__ import annotations

import json
import logging
from datetime import timedelta
from decimal import Decimal
from typing import Any

import pytest
from sqlalchemy import delete, event, func, select, update
from sqlalchemy.exc import OperationalError

from models import ExtractionAudit, Fact, Job, LLMCall
from tests.cli import invoke_cli
from tests.integration.test_extraction import SAMPLE_BODY, SLUG, put_page
from worker.accounting import Budget, parse_prices, parse_usd
from worker.accounting.budget import MAX_BUDGET_USD, RECHECK_SECONDS
from worker.config_store import ConfigReader, set_config
from worker.extraction import ExtractOptions, run_extract_conversation_facts
from worker.jobs import outbox
from worker.jobs.budgets import JobBudgets
from worker.jobs.lifecycle import run_job
from worker.jobs.outbox import (
    EXTRACTION,
    SWEEP_BATCH,
    page_subject,
    request_job,
    resume_for_config_change,
    sweep,
)
from worker.llm.errors import BudgetExhaustedError
from worker.llm.openai_compat import OpenAIChatClient
from worker.runtime import Runtime
from worker.settings import Settings

pytestmark = pytest.mark.integration

# The simulator's model has no list price; give it one so calls cost money: 1 USD per 1k tokens.
PRICES = json.dumps({"simulator-1": {"input": 1000, "output": 1000}})


@pytest.fixture
def llm(simulator: Any) -> OpenAIChatClient:
    return OpenAIChatClient(model="simulator-1", base_url=simulator.base_url, provider="simulator")


def set_(factory, key: str, value: str) -> None:
    with factory.begin() as session:
        set_config(session, key, value, updated_by="test")


def test_parse_usd_and_prices():
    assert parse_usd(None) is None and parse_usd(" ") is None
    assert parse_usd("2.50") == Decimal("2.50")
    # 1e1000000 passed, and a backfill's pass raised decimal.Overflow subtracting the day's spend from it.
    for bad in ("-1", "lots", "nan", "inf", "1e1000000", "1000000000001"):
        with pytest.raises(ValueError, match="US dollars"):
            parse_usd(bad)
    prices = parse_prices('{"m": {"input": 1, "output": 2}}')
    assert prices["m"].cache_read == Decimal("0.1") and prices["m"].cache_write == Decimal(1)
    for bad in ("[1]", '{"m": {"input": 1}}', '{"m": {"input": -1, "output": 1}}', "{nope"):
        with pytest.raises(ValueError):
            parse_prices(bad)
    assert parse_prices('{"m": {"input": "2.5", "output": 10000}}')["m"].input == Decimal("2.5")
    # Each problem named: a price past the bound (a per-token price written as per million), a
    # misspelt field (it would silently price at the default), a value that is no number.
    for bad, named in (
        ('{"m": {"input": 1e308, "output": 1}}', "llm.prices['m'].input must be from 0 to 10,000"),
        ('{"m": {"input": 1, "output": 10000.5}}', "llm.prices['m'].output must be from 0 to 10,000"),
        ('{"m": {"input": 1, "output": 1, "cache_reed": 1}}', "llm.prices['m'] has 'cache_reed'"),
        ('{"m": {"input": true, "output": 1}}', "llm.prices['m'].input must be a number"),
        ('{"m": {"input": [1], "output": 1}}', "llm.prices['m'].input must be a number"),
        ('{"m": {"input": "lots", "output": 1}}', "llm.prices['m'].input must be a number"),
        ("[" * 20_000 + "]" * 20_000, "not nested"),  # past the decoder's limit: a 500 from the API before
        # Python's own advice before ("use sys.set_int_max_str_digits()"), which no operator can take.
        (
            '{"m": {"input": ' + "9" * 5000 + ', "output": 1}}',
            "llm.prices holds a number thousands of digits",
        ),
    ):
        with pytest.raises(ValueError) as caught:
            parse_prices(bad)
        assert named in str(caught.value)


def test_bad_budget_values_are_refused_at_config_set(session):
    with pytest.raises(ValueError, match="US dollars"):
        set_config(session, "llm.budget_daily_usd", "a lot")
    with pytest.raises(ValueError, match=r"llm\.prices"):
        set_config(session, "llm.prices", '{"m": {"input": 1}}')
    for key in ("llm.budget_daily_usd", "llm.budget_job_usd", "llm.prices", "facts.extraction_enabled"):
        with pytest.raises(ValueError, match=r"needs a value; .* unset it"):  # before: a blank cap was none
            set_config(session, key, "   ")


def test_price_override_is_what_llm_calls_record(tx_factory, llm):
    set_(tx_factory, "llm.prices", PRICES)
    put_page(tx_factory)
    run_extract_conversation_facts(tx_factory, llm, ExtractOptions(slug=SLUG))
    with tx_factory() as session:
        calls = list(session.scalars(select(LLMCall)))
    assert calls
    for call in calls:
        # Cached input tokens cost a tenth of the input price unless the override says otherwise.
        uncached = call.input_tokens - call.cache_read_tokens
        expected = (
            Decimal(uncached * 1000 + call.cache_read_tokens * 100 + call.output_tokens * 1000) / 1_000_000
        )
        assert call.cost_usd == expected.quantize(Decimal("0.000001"))


def test_exhausted_daily_budget_is_its_own_outcome_and_calls_nothing(tx_factory, llm, simulator):
    set_(tx_factory, "llm.prices", PRICES)
    set_(tx_factory, "llm.budget_daily_usd", "0")
    put_page(tx_factory)
    before = simulator.stats()["requests_total"]
    result = run_extract_conversation_facts(tx_factory, llm, ExtractOptions(slug=SLUG))
    assert simulator.stats()["requests_total"] == before
    assert (result.pages_failed, result.facts_inserted, result.llm_calls) == (1, 0, 0)
    assert result.pages[0].outcome == "budget_exhausted"
    assert "budget" in result.pages[0].reason and "llm.budget_daily_usd" in result.pages[0].reason
    with tx_factory() as session:
        [audit] = session.scalars(select(ExtractionAudit))
        assert (audit.outcome, audit.llm_call_id, audit.facts_count) == ("budget_exhausted", None, 0)
        assert session.scalar(select(func.count()).select_from(LLMCall)) == 0


def test_budget_spent_part_way_stops_before_the_next_call(tx_factory, llm):
    set_(tx_factory, "llm.prices", PRICES)
    put_page(tx_factory)
    # One segment costs well under 2 USD at these prices; allow about one call's worth.
    run_extract_conversation_facts(tx_factory, llm, ExtractOptions(slug=SLUG, dry_run=True))
    set_(tx_factory, "llm.budget_daily_usd", "0.01")
    budget = Budget(tx_factory, ConfigReader(tx_factory, ttl=0).get, ttl=0)
    budget.check()  # nothing spent yet
    result = run_extract_conversation_facts(tx_factory, llm, ExtractOptions(slug=SLUG), budget=budget)
    assert result.segments_processed == 1 and result.pages[0].outcome == "budget_exhausted"
    with pytest.raises(BudgetExhaustedError, match="day LLM budget is exhausted"):
        budget.check()


def test_a_stored_budget_no_rule_takes_is_spent_not_lifted(tx_factory, caplog):
    """A value written before the rules (or by hand) was read as no limit, unsaid: a negative budget
    let every call through. It reads as 0 now, said once in the log; a huge one as the most there is."""
    from models import ConfigEntry

    with tx_factory.begin() as session:  # past validate_value, as an old release or psql wrote it
        session.add(ConfigEntry(key="llm.budget_daily_usd", value="-5"))
        session.add(ConfigEntry(key="llm.budget_job_usd", value="1e1000000"))
    budget = Budget(tx_factory, ConfigReader(tx_factory, ttl=0).get, ttl=0)
    with caplog.at_level("WARNING", logger="worker.accounting.budget"):
        with pytest.raises(BudgetExhaustedError, match="day LLM budget is exhausted"):
            budget.check()
        with pytest.raises(BudgetExhaustedError):
            budget.check()
    assert caplog.text.count("config llm.budget_daily_usd holds a value no budget takes") == 1
    with tx_factory.begin() as session:
        session.execute(delete(ConfigEntry).where(ConfigEntry.key == "llm.budget_daily_usd"))
    budget.check()  # the huge job budget is no limit in practice, and no warning
    assert budget.room(job_id=1) == (None, MAX_BUDGET_USD)  # the most there is (no calls for job 1)
    assert "llm.budget_job_usd" not in caplog.text


# Truncation: run_job extraction runs segment_concurrency=8 (threads share the factory).
def test_job_waits_for_budget_and_resumes_when_it_is_raised(factory, database_url, simulator):
    # No consolidation follow-up: it would be sent to a broker, and this process has none.
    settings = Settings(
        database_url=database_url,
        simulator_url=simulator.base_url,
        llm="simulator",
        consolidate_after_extraction=False,
    )
    rt = Runtime(settings=settings, factory=factory, config=ConfigReader(factory, ttl=0))
    set_(factory, "llm.prices", PRICES)
    set_(factory, "llm.budget_daily_usd", "0")
    put_page(factory, body=SAMPLE_BODY)
    with factory.begin() as session:
        job_id = request_job(session, EXTRACTION, page_subject("default", SLUG)).job_id
    try:
        outcome = run_job(rt, job_id, EXTRACTION)
        with factory() as session:
            job = session.get(Job, job_id)
            assert (outcome.status, job.status, job.pause_reason) == ("paused", "paused", "budget")
            assert job.attempts == 0, "waiting for budget costs no attempt"
            assert "budget" in job.last_error
        with factory.begin() as session:
            set_config(session, "llm.budget_daily_usd", "100")
            resumed = resume_for_config_change(session, "llm.budget_daily_usd", "100")
        assert resumed == [(job_id, EXTRACTION)]
        assert run_job(rt, job_id, EXTRACTION).status == "succeeded"
        with factory() as session:
            done = session.get(Job, job_id)
            assert (done.status, done.attempts, done.worker_losses) == ("succeeded", 1, 0)
            assert session.scalar(select(func.count()).select_from(Fact).where(Fact.is_audit)) == 1
    finally:
        rt.close()


def test_kill_switch_resume_does_not_wake_budget_waiters(session):
    session.add_all(
        [
            Job(kind=EXTRACTION, subject="a", status="paused", pause_reason="budget"),
            Job(kind=EXTRACTION, subject="b", status="paused", pause_reason="kill_switch"),
        ]
    )
    session.flush()
    resumed = resume_for_config_change(session, "facts.extraction_enabled", "true")
    statuses = dict(session.execute(select(Job.subject, Job.status)).all())
    assert len(resumed) == 1 and statuses == {"a": "paused", "b": "queued"}


def sweep_waking(factory, budget: Budget):  # type: ignore[no-untyped-def]
    """One sweep that wakes budget waiters by ``budget`` and sends nowhere."""
    return sweep(
        factory,
        stale_after=60,
        requeue_after=300,
        enabled=lambda key: True,
        job_budgets=JobBudgets(max_attempts=3, max_worker_losses=3),
        budget_room_for=budget.jobs_with_room,
        sender=lambda task, job_id, queue: None,
    )


def test_the_sweep_wakes_only_the_budget_waiters_whose_own_budget_has_room(tx_factory):
    """The sweep woke every job paused for budget whenever the day's budget had room, so a job whose
    own budget was spent was claimed, run and paused again on every sweep, for ever."""
    set_(tx_factory, "llm.budget_daily_usd", "100")
    set_(tx_factory, "llm.budget_job_usd", "1")
    with tx_factory.begin() as session:
        spent, fresh = (Job(kind=EXTRACTION, subject=s, status="paused", pause_reason="budget") for s in "ab")
        session.add_all([spent, fresh])
        session.flush()
        session.add(
            LLMCall(provider="p", model="m", purpose="extraction", outcome="ok", cost_usd=1, job_id=spent.id)
        )
    budget = Budget(tx_factory, ConfigReader(tx_factory, ttl=0).get, ttl=0)
    report = sweep_waking(tx_factory, budget)
    assert report.resumed_paused == [fresh.id]
    with tx_factory() as session:
        assert session.get(Job, spent.id).status == "paused"
    # The job budget raised: the spent job has room again (the config change resumes it too).
    set_(tx_factory, "llm.budget_job_usd", "2")
    assert budget.jobs_with_room([spent.id]) == [spent.id]
    set_(tx_factory, "llm.budget_daily_usd", "0")
    assert budget.jobs_with_room([spent.id, fresh.id]) == []


def job_that_spent(factory: Any, kind: str, subject: str, **state: Any) -> Job:
    """A job (committed, with ``state``: status, pause_reason...) and one call of it that cost $1."""
    with factory.begin() as session:
        job = Job(kind=kind, subject=subject, **state)
        session.add(job)
        session.flush()
        session.add(LLMCall(provider="p", model="m", purpose=kind, outcome="ok", cost_usd=1, job_id=job.id))
    return job


def test_a_rerun_or_a_retry_starts_a_job_s_own_budget_over(factory):
    """A job's own budget counted every call since its creation: paused for it, the job held its page's
    one pending slot for good (each later delivery merged into it, an operator's retry paused again at
    once). A rerun for new content and an operator's retry now start it over, as they do the attempts.
    (Real commits: a budget counts from its transaction's now().)"""
    from worker.accounting.reports import job_spend
    from worker.jobs.leases import claim, finish
    from worker.jobs.outbox import retry_job

    set_(factory, "llm.budget_job_usd", "1")
    budget = Budget(factory, ConfigReader(factory, ttl=0).get, ttl=0)
    job = job_that_spent(factory, EXTRACTION, "default|spent", status="paused", pause_reason="budget")
    assert budget.jobs_with_room([job.id]) == [] and not budget.has_room(job.id)
    with factory.begin() as session:
        retry_job(session, job.id)  # the operator's retry
    assert budget.jobs_with_room([job.id]) == [job.id] and budget.spent_by_job(job.id) == 0
    with factory() as session:  # what GET /v1/jobs/{id} shows: all it cost, and what its budget counts
        shown = job_spend(session, job.id)
    assert (shown.cost_usd, shown.budget_cost_usd) == (1, 0)
    # Spent again on the content it had, then new content arrives while it runs: its rerun starts over.
    assert claim(factory, job.id, "w1", stale_after=60, budgets=JobBudgets(5, 20)) is not None
    with factory.begin() as session:
        session.add(
            LLMCall(provider="p", model="m", purpose="extraction", outcome="ok", cost_usd=1, job_id=job.id)
        )
        assert not request_job(session, EXTRACTION, "default|spent").created  # a rerun is asked
    assert not budget.has_room(job.id)
    done = finish(factory, job.id, "w1", "succeeded", attempt=True)
    assert done is not None and done.rerun is not None  # sent again, for the new
    assert budget.has_room(job.id)
    # Spent again and paused for it: new content for the page (merged into the paused job) starts it over,
    # so the sweeper wakes it; before, only an operator could.
    assert claim(factory, job.id, "w2", stale_after=60, budgets=JobBudgets(5, 20)) is not None
    with factory.begin() as session:
        session.add(
            LLMCall(provider="p", model="m", purpose="extraction", outcome="ok", cost_usd=1, job_id=job.id)
        )
    finish(factory, job.id, "w2", "paused", pause_reason="budget")
    assert budget.jobs_with_room([job.id]) == []
    with factory.begin() as session:
        assert not request_job(session, EXTRACTION, "default|spent").created
    assert budget.jobs_with_room([job.id]) == [job.id]
    # New content while it ran, then a pause (for budget): the run after reads it, with a budget of its own.
    assert claim(factory, job.id, "w3", stale_after=60, budgets=JobBudgets(5, 20)) is not None
    with factory.begin() as session:
        session.add(
            LLMCall(provider="p", model="m", purpose="extraction", outcome="ok", cost_usd=1, job_id=job.id)
        )
        request_job(session, EXTRACTION, "default|spent")
    finish(factory, job.id, "w3", "paused", pause_reason="budget")
    assert budget.jobs_with_room([job.id]) == [job.id]


def test_a_job_from_before_budget_since_counts_from_its_creation(factory):
    """Migration 0035 leaves the jobs there were without a budget_since (no rewrite of a table of
    finished jobs): their budget, and the spend shown for it, count every call, as before."""
    from worker.accounting.reports import job_spend

    set_(factory, "llm.budget_job_usd", "1")
    budget = Budget(factory, ConfigReader(factory, ttl=0).get, ttl=0)
    job = job_that_spent(factory, EXTRACTION, "default|old", status="succeeded")
    with factory.begin() as session:
        session.execute(update(Job).where(Job.id == job.id).values(budget_since=None))
    assert budget.spent_by_job(job.id) == 1 and not budget.has_room(job.id)
    with factory() as session:
        assert job_spend(session, job.id).budget_cost_usd == 1


def test_new_work_renews_the_budget_of_a_paused_extraction_only(factory):
    """A compaction is requested on every append past its threshold: renewed each time, a compaction job
    paused for its own budget would have no cap but the day's."""
    from worker.jobs.outbox import COMPACTION

    set_(factory, "llm.budget_job_usd", "1")
    budget = Budget(factory, ConfigReader(factory, ttl=0).get, ttl=0)
    job = job_that_spent(factory, COMPACTION, "t1", status="paused", pause_reason="budget")
    with factory.begin() as session:
        assert not request_job(session, COMPACTION, "t1").created
    assert budget.jobs_with_room([job.id]) == []


def test_new_facts_renew_a_paused_consolidations_budget_and_a_forced_compaction_its_own(factory, llm):
    """A consolidation paused for its own budget was reused by every later request and never woke (the
    entity's one pending slot, held for good); `factmill compact` said "it is now forced" of a job that
    then never ran."""
    from worker.compaction import append_messages, parse_messages, request_compaction
    from worker.consolidation import BUDGET_RENEW_SECONDS, consolidate_page_entities
    from worker.jobs.outbox import COMPACTION, CONSOLIDATION

    set_(factory, "llm.budget_job_usd", "1")
    budget = Budget(factory, ConfigReader(factory, ttl=0).get, ttl=0)
    put_page(factory)
    run_extract_conversation_facts(factory, llm, ExtractOptions(slug=SLUG))
    assert consolidate_page_entities(factory, "default", SLUG) >= 1
    with factory.begin() as session:
        job_ids = session.scalars(select(Job.id).where(Job.kind == CONSOLIDATION)).all()
        session.execute(update(Job).values(status="paused", pause_reason="budget"))
        for job_id in job_ids:
            session.add(
                LLMCall(
                    provider="p", model="m", purpose="consolidation", outcome="ok", cost_usd=1, job_id=job_id
                )
            )
    assert budget.jobs_with_room(job_ids) == []
    consolidate_page_entities(factory, "default", SLUG)  # within the hour: an entity on every page
    assert budget.jobs_with_room(job_ids) == []  # would start it over with every page's extraction
    with factory.begin() as session:
        session.execute(update(Job).values(budget_since=func.now() - timedelta(seconds=BUDGET_RENEW_SECONDS)))
        session.execute(update(LLMCall).values(created_at=func.now() - timedelta(hours=2)))
    consolidate_page_entities(factory, "default", SLUG)  # the page's facts are still to consolidate
    assert budget.jobs_with_room(job_ids) == job_ids
    with factory.begin() as session:
        append_messages(session, "t1", parse_messages([{"role": "user", "text": "hello"}]))
    job = job_that_spent(factory, COMPACTION, "t1", status="paused", pause_reason="budget")
    with factory.begin() as session:
        assert not request_compaction(session, "t1").created  # an append's request: within its wait
    assert budget.jobs_with_room([job.id]) == []
    with factory.begin() as session:
        assert not request_compaction(session, "t1", force=True).created
    assert budget.jobs_with_room([job.id]) == [job.id]


def test_the_sweep_skips_a_budget_waiter_whose_row_another_transaction_holds(factory):
    """The sweep holds every row it locked: waiting on one a delivery or a claim held kept them all
    waiting (and a delivery that then wanted one of the sweep's rows deadlocked)."""
    set_(factory, "llm.budget_daily_usd", "100")
    with factory.begin() as session:
        waiters = [Job(kind=EXTRACTION, subject=s, status="paused", pause_reason="budget") for s in "abc"]
        session.add_all(waiters)
    budget = Budget(factory, ConfigReader(factory, ttl=0).get, ttl=0)
    held = waiters[1].id
    with factory.begin() as holder:
        holder.execute(select(Job.id).where(Job.id == held).with_for_update())
        report = sweep_waking(factory, budget)  # waited here for ever (until the holder's commit)
        assert sorted(report.resumed_paused) == sorted(j.id for j in waiters if j.id != held)
    assert sweep_waking(factory, budget).resumed_paused == [held]


def test_the_sweep_wakes_more_budget_waiters_than_a_query_has_parameters(tx_factory, caplog):
    """A day's ingest paused for budget: the waiters' ids went in IN lists, one parameter each, and past
    65,535 the driver refused the query: the whole sweep rolled back, every sweep (nothing re-sent)."""
    from sqlalchemy import text

    set_(tx_factory, "llm.budget_daily_usd", "100")
    set_(tx_factory, "llm.budget_job_usd", "1")
    with tx_factory.begin() as session:
        session.execute(
            text(
                "INSERT INTO jobs (kind, subject, status, pause_reason, options, attempts, worker_losses) "
                "SELECT 'extraction', 'default|p' || n, 'paused', 'budget', '{}', 0, 0 "
                "FROM generate_series(1, 70000) AS n"
            )
        )
    budget = Budget(tx_factory, ConfigReader(tx_factory, ttl=0).get, ttl=0)
    caplog.set_level("INFO", logger="worker.jobs.outbox")
    with tx_factory() as session:
        ids = session.scalars(select(Job.id).order_by(Job.id)).all()
    report = sweep_waking(tx_factory, budget)
    # A batch a sweep (the whole backlog in one transaction held its rows, then sent them all), lowest
    # ids first; the next sweep takes the next batch.
    assert sorted(report.resumed_paused) == ids[:SWEEP_BATCH]
    # Counts and a few ids: every id made one 45 KB line, split by Docker's 16 KB lines.
    [said] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("sweep re-sent")]
    assert f"{SWEEP_BATCH} resumed" in said and len(said) < 500, said[:200]
    assert sorted(sweep_waking(tx_factory, budget).resumed_paused) == ids[SWEEP_BATCH : 2 * SWEEP_BATCH]
    with tx_factory() as session:
        assert session.scalar(select(func.count()).where(Job.status == "paused")) == 70_000 - 2 * SWEEP_BATCH


def test_a_switch_turned_on_resumes_a_batch_at_once_and_the_sweeper_the_rest(tx_factory):
    """Turned on over a day's paused ingest, the config change updated and sent every job inside its
    request."""
    from sqlalchemy import text

    with tx_factory.begin() as session:
        session.execute(
            text(
                "INSERT INTO jobs (kind, subject, status, pause_reason, options, attempts, worker_losses) "
                "SELECT 'extraction', 'default|p' || n, 'paused', 'kill_switch', '{}', 0, 0 "
                "FROM generate_series(1, :n) AS n"
            ),
            {"n": SWEEP_BATCH + 10},
        )
    with tx_factory.begin() as session:
        resumed = resume_for_config_change(session, "facts.extraction_enabled", "true")
    assert len(resumed) == SWEEP_BATCH
    budget = Budget(tx_factory, ConfigReader(tx_factory, ttl=0).get, ttl=0)
    assert len(sweep_waking(tx_factory, budget).resumed_paused) == 10
    with tx_factory() as session:
        assert session.scalar(select(func.count()).where(Job.status == "paused")) == 0


# Truncation: the CLI opens its own engine from FACTMILL_DATABASE_URL.
def test_costs_command_reports_spend_and_cached_share(factory, llm, database_url):
    set_(factory, "llm.prices", PRICES)
    put_page(factory)
    run_extract_conversation_facts(factory, llm, ExtractOptions(slug=SLUG))
    result = invoke_cli(database_url, "costs", "--by", "purpose", "--json")
    assert result.exit_code == 0, result.output
    [row] = json.loads(result.output)
    assert row["key"] == "extraction" and row["calls"] == 2 and row["cost_usd"] > 0
    assert 0 <= row["cached_share"] <= 1
    table = invoke_cli(database_url, "costs", "--by", "day")
    assert table.exit_code == 0 and "total" in table.output
    assert invoke_cli(database_url, "costs", "--by", "colour").exit_code == 2


# Truncation: the rows are read through a second engine, whose sessions run in another time zone.
def test_costs_by_day_count_utc_days_whatever_the_sessions_zone(factory, database_url):
    """The day budgets count UTC days; `costs --by day` grouped by the session's zone, so on a server
    east of UTC a call late in a UTC day was reported on the next one."""
    from datetime import UTC, datetime

    from sqlalchemy import create_engine, insert, pool
    from sqlalchemy.orm import sessionmaker

    from worker.accounting import reports

    late = datetime(2026, 12, 1, 23, 30, tzinfo=UTC)  # 2026-12-02 13:30 in Kiritimati (UTC+14)
    with factory.begin() as session:
        session.execute(
            insert(LLMCall),
            [{"provider": "p", "model": "m", "purpose": "extraction", "outcome": "ok", "created_at": late}],
        )
    east = create_engine(
        database_url, poolclass=pool.NullPool, connect_args={"options": "-c timezone=Pacific/Kiritimati"}
    )
    try:
        with sessionmaker(east)() as session:
            assert session.scalar(select(func.current_setting("TimeZone"))) == "Pacific/Kiritimati"
            rows = reports.spend(session, by="day", since=datetime(2026, 11, 30))  # naive: UTC
        assert [(r.key, r.calls) for r in rows] == [("2026-12-01", 1)]
    finally:
        east.dispose()


def test_every_runtime_call_is_budgeted(tx_factory, database_url, simulator):
    """The runtime's client (used by extraction, compaction, search and embeddings) checks the day's
    budget before each call: a refusal is an LLMError with outcome budget_exhausted, and no request."""
    from worker.llm.errors import LLMError
    from worker.llm.types import ChatRequest

    settings = Settings(database_url=database_url, simulator_url=simulator.base_url, llm="simulator")
    rt = Runtime(settings=settings, factory=tx_factory, config=ConfigReader(tx_factory, ttl=0))
    request = ChatRequest(purpose="test", system="be brief", messages=(("user", "hello"),), max_tokens=16)
    try:
        assert rt.llm.chat(request).text
        assert len(rt.llm.embed(["hello"]).vectors) == 1
        set_(tx_factory, "llm.prices", PRICES)
        set_(tx_factory, "llm.budget_daily_usd", "0")
        before = simulator.stats()["requests_total"]
        for call in (
            lambda: rt.llm.chat(request),
            lambda: rt.llm.embed(["x"]),
            lambda: rt.llm.chat_traced(request),
        ):
            with pytest.raises(LLMError) as info:
                call()
            assert isinstance(info.value, BudgetExhaustedError) and info.value.outcome == "budget_exhausted"
            assert not info.value.retryable
        assert simulator.stats()["requests_total"] == before
    finally:
        rt.close()


def test_more_pending_subjects_than_a_query_has_parameters_are_requested_again(tx_factory):
    """A backfill pass's entities, each with a consolidation job pending: the pending read took one
    parameter a subject (and the rerun and renewal one a job), and past 65,535 the driver refused it
    after the pass's facts had committed."""
    from sqlalchemy import text

    from worker.jobs.outbox import CONSOLIDATION, request_jobs

    with tx_factory.begin() as session:
        session.execute(
            text(
                "INSERT INTO jobs (kind, subject, status, options, attempts, worker_losses) "
                "SELECT 'consolidation', 'default|e' || n, "
                "CASE n % 3 WHEN 0 THEN 'running' WHEN 1 THEN 'queued' ELSE 'paused' END, '{}', 0, 0 "
                "FROM generate_series(1, 70000) AS n"
            )
        )
    with tx_factory.begin() as session:  # the paused ones paused for their own budget long ago
        session.execute(
            text(
                "UPDATE jobs SET pause_reason = 'budget', budget_since = now() - interval '1 day' "
                "WHERE status = 'paused'"
            )
        )
    subjects = [f"default|e{n}" for n in range(1, 70_001)]
    with tx_factory.begin() as session:
        requests = request_jobs(session, CONSOLIDATION, subjects, renew_spent_budget_after=0.0)
    assert len(requests) == 70_000 and not any(r.created for r in requests)
    with tx_factory() as session:
        assert session.scalar(select(func.count()).where(Job.rerun_requested)) == 23_333  # the running ones
        renewed = select(func.count()).where(
            Job.status == "paused", Job.budget_since > func.now() - timedelta(hours=1)
        )
        assert session.scalar(renewed) == 23_333  # every paused one's budget started over


def test_the_budget_waiters_spend_is_asked_a_batch_at_a_time_after_the_resends(
    tx_factory, monkeypatch, caplog
):
    """Every sweep asked the spend of every job paused for budget (a spent day pauses hundreds of thousands)
    in one query, inside the transaction that held the stale rows it had locked; and a
    budget read that failed rolled the re-sends of dead workers' jobs back."""
    monkeypatch.setattr(outbox, "SWEEP_BATCH", 2)
    with tx_factory.begin() as session:
        dead = Job(
            kind=EXTRACTION, subject="dead", status="running", heartbeat_at=func.now() - timedelta(hours=1)
        )
        waiters = [
            Job(kind=EXTRACTION, subject=f"w{i}", status="paused", pause_reason="budget") for i in range(5)
        ]
        session.add_all([dead, *waiters])
        session.flush()
    asked: list[list[int]] = []

    def room_for(ids):  # type: ignore[no-untyped-def]
        asked.append(list(ids))
        return [i for i in ids if i in (waiters[3].id, waiters[4].id)]  # the first three's own budgets spent

    sent: list[int] = []

    def swept(budget_room_for, budget_has_room=None):  # type: ignore[no-untyped-def]
        return sweep(
            tx_factory,
            stale_after=60,
            requeue_after=300,
            enabled=lambda key: True,
            job_budgets=JobBudgets(max_attempts=3, max_worker_losses=3),
            budget_room_for=budget_room_for,
            budget_has_room=budget_has_room,
            sender=lambda task, job_id, queue: sent.append(job_id),
        )

    # The day's budget spent: no waiter is read at all (each sweep read every id first).
    reads: list[str] = []
    engine = tx_factory.kw["bind"].engine

    def count(_conn, _cursor, statement, *_):  # type: ignore[no-untyped-def]
        if "pause_reason" in statement and statement.lstrip().startswith("SELECT"):
            reads.append(statement)

    event.listen(engine, "before_cursor_execute", count)
    try:
        assert swept(room_for, budget_has_room=lambda: False).resumed_paused == []
    finally:
        event.remove(engine, "before_cursor_execute", count)
    assert (asked, reads) == ([], [])  # (the dead worker's job was re-sent all the same)
    report = swept(room_for)
    assert max(len(page) for page in asked) <= 2
    assert sorted(report.resumed_paused) == [waiters[3].id, waiters[4].id]
    assert sent[0] == dead.id and sorted(sent[1:]) == [waiters[3].id, waiters[4].id]

    def broken(ids):  # type: ignore[no-untyped-def]
        raise OperationalError("SELECT sum(cost_usd) ...", {}, Exception("connection lost"))

    with tx_factory.begin() as session:
        session.execute(
            update(Job)
            .where(Job.id == dead.id)
            .values(status="running", heartbeat_at=func.now() - timedelta(hours=1))
        )
    sent.clear()
    with pytest.raises(OperationalError):  # the step fails (Flower shows it) ...
        swept(broken)
    assert sent == [dead.id]  # ... its re-sends done
    with tx_factory() as session:
        assert session.get(Job, dead.id).status == "queued"

    def unreadable_day() -> bool:
        raise OperationalError("SELECT sum(cost_usd) ...", {}, Exception("connection lost"))

    with tx_factory.begin() as session:  # the day's own read failing: the same
        session.execute(
            update(Job)
            .where(Job.id == dead.id)
            .values(status="running", heartbeat_at=func.now() - timedelta(hours=1), worker_losses=0)
        )
    sent.clear()
    with caplog.at_level(logging.INFO, logger="worker.jobs.outbox"), pytest.raises(OperationalError):
        swept(room_for, budget_has_room=unreadable_day)
    assert sent == [dead.id] and any("sweep re-sent 1 job" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("key", ["llm.budget_daily_usd", "llm.budget_job_usd"])
def test_a_raised_budget_is_read_past_the_cache_before_a_call_is_refused(tx_factory, key):
    """`config set` on a budget wakes the jobs paused for it; a worker whose config cache still held the
    old limit (2 s) paused each again at once, until the next sweep. The limit is read again, past the
    cache, before a call is refused."""
    with tx_factory.begin() as session:
        job_id = request_job(session, EXTRACTION, "default|conversations/raised").job_id
    set_(tx_factory, key, "0")
    config = ConfigReader(tx_factory, ttl=3600)
    fresh_reads, now = [], [0.0]

    def fresh(name: str) -> str | None:
        fresh_reads.append(name)
        return config.fresh(name)

    budget = Budget(tx_factory, config.get, ttl=0, fresh_config=fresh, clock=lambda: now[0])
    assert not any(budget.has_room(job_id) for _ in range(100))  # the cache now holds 0
    assert len(fresh_reads) == 1, "a spent budget read its limit past the cache at every check"
    set_(tx_factory, key, "100")
    assert config.get(key) == "0", "the cache still holds the old limit"
    now[0] += RECHECK_SECONDS
    assert budget.has_room(job_id), "refused by a limit raised a moment ago"
    set_(tx_factory, key, "0")
    assert not Budget(tx_factory, config.fresh, ttl=0).has_room(job_id)
