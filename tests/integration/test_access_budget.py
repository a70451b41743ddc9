"""Readers' LLM use is bounded: its own day budget (apart from extraction's) and a per-key rate limit."""

from __future__ import annotations

import re
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select, text
from sqlalchemy.orm import Session, sessionmaker

from models import LLMCall
from tests.auth import bearer, new_key
from tests.conftest import TABLES
from tests.integration.test_api import Recorder, make_runtime
from tests.integration.test_search import seed
from worker import db
from worker.accounting import (
    DAILY_BUDGET_KEY,
    PRICES_KEY,
    SEARCH_DAILY_BUDGET_KEY,
    SEARCH_PURPOSES,
    Budget,
    Ledger,
    LLMCallRecord,
)
from worker.api.app import create_app
from worker.config_store import get_config, set_config
from worker.llm.errors import BudgetExhaustedError
from worker.llm.types import Usage
from worker.search import EMBEDDING_PURPOSE, EXPANSION_PURPOSE

pytestmark = pytest.mark.integration


# A price list where one input token of model "m" costs a cent, so a call can spend any whole cents.
CENT_A_TOKEN = Ledger(lambda key: '{"m": {"input": 10000, "output": 0}}' if key == PRICES_KEY else None)


def spend(factory: sessionmaker[Session], purpose: str, usd: str) -> None:
    """Record a call that cost ``usd``, through the ledger (the only writer of llm_calls and the spend)."""
    tokens = int(Decimal(usd) * 100)
    call = LLMCallRecord(purpose, "p", "m", Usage(input_tokens=tokens), latency_ms=1, outcome="ok")
    with factory.begin() as session:
        CENT_A_TOKEN.record(session, call)
        assert session.scalars(select(LLMCall.cost_usd).order_by(LLMCall.id.desc())).first() == Decimal(usd)


def configure(factory: sessionmaker[Session], key: str, value: str) -> None:
    with factory.begin() as session:
        set_config(session, key, value)


def budgets(factory: sessionmaker[Session]) -> tuple[Budget, Budget]:
    def get(key: str) -> str | None:
        with factory() as session:
            return get_config(session, key)

    return Budget(factory, get, ttl=0), Budget(factory, get, ttl=0, search=True)


def test_the_search_purposes_are_the_ones_search_records() -> None:
    assert set(SEARCH_PURPOSES) == {EXPANSION_PURPOSE, EMBEDDING_PURPOSE}


def test_exhausting_the_search_budget_never_pauses_extraction(factory: sessionmaker[Session]) -> None:
    work, search = budgets(factory)
    configure(factory, "llm.budget_daily_usd", "5")
    configure(factory, SEARCH_DAILY_BUDGET_KEY, "1")
    for _ in range(60):  # sixty searches' worth of expansion spend
        spend(factory, EXPANSION_PURPOSE, "0.05")
    with pytest.raises(BudgetExhaustedError):
        search.check()
    work.check(job_id=None)  # extraction still has its whole budget


def test_extractions_budget_never_blocks_search(factory: sessionmaker[Session]) -> None:
    work, search = budgets(factory)
    configure(factory, "llm.budget_daily_usd", "1")
    spend(factory, "extraction", "2")
    with pytest.raises(BudgetExhaustedError):
        work.check()
    search.check()  # no search budget set, and extraction's spend is not the readers'
    configure(factory, SEARCH_DAILY_BUDGET_KEY, "1")
    search.check()


@pytest.fixture
def api(database_url: str, factory: sessionmaker[Session], simulator: Any) -> Iterator[TestClient]:
    runtime = make_runtime(
        database_url, factory, llm="simulator", simulator_url=simulator.base_url, search_rate_per_minute=3
    )
    with TestClient(create_app(runtime, sender=Recorder(factory))) as client:
        yield client
    runtime.close()


@pytest.fixture
def vector_api(
    vector_database_url: str, factory: sessionmaker[Session], simulator: Any
) -> Iterator[tuple[TestClient, sessionmaker[Session]]]:
    """The API on the database with the vector store (the test database where its server has pgvector),
    and a factory on it. Emptied before and after: where it is a database of its own (the embedded
    pgserver), ``factory`` truncates another, and a spent budget or a key left here met later tests."""
    engine = db.get_engine(vector_database_url)

    def truncate() -> None:
        with engine.begin() as conn:
            conn.execute(text(f"TRUNCATE {TABLES} RESTART IDENTITY CASCADE"))

    truncate()
    vectors = sessionmaker(engine, expire_on_commit=False)
    runtime = make_runtime(
        vector_database_url,
        vectors,
        llm="simulator",
        simulator_url=simulator.base_url,
        search_rate_per_minute=3,
    )
    try:
        with TestClient(create_app(runtime, sender=Recorder(vectors))) as client:
            yield client, vectors
    finally:
        runtime.close()
        truncate()


def ledger_rows(factory: sessionmaker[Session]) -> int:
    with factory() as session:
        return len(session.scalars(select(LLMCall.id)).all())


def chat_calls(simulator: Any) -> int:
    return int(simulator.stats()["by_route"].get("chat.completions", 0))


def test_a_spent_search_budget_skips_expansion_without_figures_and_extraction_runs_on(
    vector_api: tuple[TestClient, sessionmaker[Session]], simulator: Any
) -> None:
    api, factory = vector_api  # with the vector store: a query embedding to refuse
    seed(factory, filler=0)
    reader = bearer(new_key(factory, ["read"]))
    configure(factory, SEARCH_DAILY_BUDGET_KEY, "0")
    before = chat_calls(simulator)
    rows_before = ledger_rows(factory)
    reply = api.get("/v1/search", params={"q": "where does alice live"}, headers=reader)
    assert reply.status_code == 200, reply.text
    notes = reply.json()["notes"]
    assert "query expansion skipped: budget; searched the query alone" in notes
    assert not any(re.search(r"\$|\d", note) for note in notes)  # no spend, no budget figures
    assert chat_calls(simulator) == before  # no LLM call was made
    # ...so none is recorded: the query's refused embedding wrote a row per search (60 a minute a key).
    assert "vector search skipped: budget" in notes, notes
    assert ledger_rows(factory) == rows_before
    work, _ = budgets(factory)
    work.check()


def test_search_expansion_runs_while_extractions_budget_is_spent(
    api: TestClient, factory: sessionmaker[Session], simulator: Any
) -> None:
    seed(factory, filler=0)
    configure(factory, "llm.budget_daily_usd", "1")
    spend(factory, "extraction", "2")
    before = chat_calls(simulator)
    reply = api.get("/v1/search", params={"q": "where does alice live"}, headers=bearer(new_key(factory)))
    assert reply.status_code == 200 and reply.json()["expanded"], reply.text
    assert chat_calls(simulator) == before + 1


def test_searches_per_minute_are_limited_per_key(api: TestClient, factory: sessionmaker[Session]) -> None:
    first, second = bearer(new_key(factory)), bearer(new_key(factory))
    # Seven within seconds: even if a minute boundary falls between them, one of them is refused.
    answers = [api.get("/v1/search", params={"q": "lex: lisbon"}, headers=first) for _ in range(7)]
    assert [a.status_code for a in answers[:3]] == [200, 200, 200]
    [limited, *_] = [a for a in answers if a.status_code == 429]
    assert limited.status_code == 429 and "at most 3 a minute" in limited.json()["detail"]
    assert 1 <= int(limited.headers["Retry-After"]) <= 60
    assert api.post("/v1/search", json={"q": "lex: lisbon"}, headers=second).status_code == 200


def test_a_key_has_at_most_its_share_of_searches_running_and_another_key_is_not_held(
    api: TestClient, factory: sessionmaker[Session]
) -> None:
    """The per-minute limit counts searches begun: sixty slow ones begun at once took every thread of
    the API's pool, and every other tenant's request waited. Two running per key, then 429."""
    from worker.access import principal_for

    busy_key, other_key = new_key(factory), new_key(factory)
    busy = principal_for(factory, busy_key)
    assert busy is not None
    running = api.app.state.factmill.searches_running()  # two of its searches still running
    assert running.most == 2 and running.enter(busy.rate_key) and running.enter(busy.rate_key)
    try:
        for refused in (
            api.get("/v1/search", params={"q": "lex: lisbon"}, headers=bearer(busy_key)),
            api.post("/v1/search", json={"q": "lex: lisbon"}, headers=bearer(busy_key)),
        ):
            assert refused.status_code == 429 and refused.headers["Retry-After"] == "1"
            assert "this key has 2 searches running" in refused.json()["detail"]
        assert (
            api.get("/v1/search", params={"q": "lex: lisbon"}, headers=bearer(other_key)).status_code == 200
        )
    finally:
        running.leave(busy.rate_key)
    # One finished: the next ones go (the refused ones spent none of the minute's 3), and each gives its
    # slot back as it answers.
    assert api.post("/v1/search", json={"q": "lex: lisbon"}, headers=bearer(busy_key)).status_code == 200
    assert api.get("/v1/search", params={"q": "lex: lisbon"}, headers=bearer(busy_key)).status_code == 200
    running.leave(busy.rate_key)
    assert running.enter(busy.rate_key) and running.enter(busy.rate_key)  # both free again
    assert not running.enter(busy.rate_key)


def test_near_its_limit_the_day_budget_reads_the_spend_fresh(factory: sessionmaker[Session]) -> None:
    """The day's total is cached a second in each process: every call checked in that second passed a
    budget already spent. Far from the limit the cache serves; within a tenth of it, each check reads."""

    def get(key: str) -> str | None:
        with factory() as session:
            return get_config(session, key)

    configure(factory, DAILY_BUDGET_KEY, "2")
    far = Budget(factory, get, ttl=3600)  # the cache never expires within the test
    loads: list[int] = []
    load = far._day._load
    far._day._load = lambda key: loads.append(1) or load(key)  # type: ignore[method-assign]
    spend(factory, "extraction", "0.50")
    far.check()  # cached: $0.50
    spend(factory, "extraction", "1.60")  # $2.10
    far.check()
    far.check()
    assert len(loads) == 1  # far from the limit, the cached $0.50 is what it knows: no query a check
    near = Budget(factory, get, ttl=3600)
    configure(factory, DAILY_BUDGET_KEY, "2.20")
    near.check()  # cached: $2.10, within a tenth of $2.20
    spend(factory, "extraction", "0.20")  # $2.30, after the check cached $2.10
    with pytest.raises(BudgetExhaustedError):
        near.check()
