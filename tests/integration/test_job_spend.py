"""A job's spend (`GET /v1/jobs/{id}`, `factmill jobs show`) and `factmill costs` split batch vs online.

The llm_calls rows are written by the Ledger (the one writer), under a price override; the expected
figures are worked out here from the override's numbers.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from models import Job
from tests.auth import send_key
from tests.cli import invoke_cli
from tests.integration.test_api import make_runtime
from worker.accounting import PRICES_KEY, Ledger, LLMCallRecord
from worker.api.app import create_app
from worker.config_store import ConfigReader, set_config
from worker.jobs.outbox import EXTRACTION
from worker.llm.types import Usage

pytestmark = pytest.mark.integration

# USD per 1M tokens: input 100, output 400, cache reads 10 (a tenth, the default).
PRICE_IN, PRICE_OUT, PRICE_CACHED = Decimal(100), Decimal(400), Decimal(10)
OVERRIDE = json.dumps({"m-1": {"input": 100, "output": 400}, "m-2": {"input": 100, "output": 400}})


def usd(input_tokens: int, cached: int, output: int, *, batch: bool = False) -> Decimal:
    """What one call costs under OVERRIDE, from its prices (batch: half of it)."""
    dollars = ((input_tokens - cached) * PRICE_IN + cached * PRICE_CACHED + output * PRICE_OUT) / 1_000_000
    return dollars / 2 if batch else dollars


# (model, purpose, input, cached, output, batch) per call of the job under test
CALLS = [
    ("m-1", "extraction", 2000, 1500, 300, False),
    ("m-1", "extraction", 2100, 1500, 250, False),  # e.g. a repair turn
    ("m-1", "extraction", 1900, 0, 280, True),
    ("m-2", "embedding", 120, 0, 0, False),
]


def record_calls(factory: sessionmaker[Session]) -> tuple[int, int]:
    """Two jobs, the calls above for the first and one online call for the second; their ids."""
    with factory.begin() as session:
        set_config(session, PRICES_KEY, OVERRIDE, updated_by="test")
    with factory.begin() as session:
        jobs = [Job(kind=EXTRACTION, subject=f"default|spend/p{i}", status="succeeded") for i in range(2)]
        session.add_all(jobs)
        session.flush()
        ledger = Ledger(ConfigReader(factory, ttl=0).get)
        records = [
            LLMCallRecord(purpose, "sim", model, Usage(i, o, c), 100, "ok", jobs[0].id, batch=b)
            for model, purpose, i, c, o, b in CALLS
        ]
        records.append(LLMCallRecord("extraction", "sim", "m-1", Usage(999, 99, 9), 10, "ok", jobs[1].id))
        ledger.record_many(session, records)
        return jobs[0].id, jobs[1].id


def expected_spend() -> dict[str, Any]:
    return {
        "calls": len(CALLS),
        "input_tokens": sum(c[2] for c in CALLS),
        "cached_tokens": sum(c[3] for c in CALLS),
        "output_tokens": sum(c[4] for c in CALLS),
        "cost_usd": float(sum(usd(i, c, o, batch=b) for _, _, i, c, o, b in CALLS)),
        # All of it counts against its own budget: nothing started it over.
        "budget_cost_usd": float(sum(usd(i, c, o, batch=b) for _, _, i, c, o, b in CALLS)),
    }


@pytest.fixture
def client(database_url: str, tx_factory: sessionmaker[Session]) -> Iterator[TestClient]:
    with TestClient(create_app(make_runtime(database_url, tx_factory), sender=lambda *a: None)) as c:
        send_key(c, tx_factory, ("read", "metrics"))
        yield c


def test_get_job_gives_its_tokens_cached_tokens_and_usd(
    client: TestClient, tx_factory: sessionmaker[Session]
) -> None:
    job_id, other_id = record_calls(tx_factory)
    body = client.get(f"/v1/jobs/{job_id}").json()
    assert body["spend"] == pytest.approx(expected_spend())
    assert body["spend"]["cost_usd"] > 0
    other = client.get(f"/v1/jobs/{other_id}").json()["spend"]
    assert other == pytest.approx(
        {
            "calls": 1,
            "input_tokens": 999,
            "cached_tokens": 9,
            "output_tokens": 99,
            "cost_usd": float(usd(999, 9, 99)),
            "budget_cost_usd": float(usd(999, 9, 99)),
        }
    )
    with tx_factory.begin() as session:
        idle = Job(kind=EXTRACTION, subject="default|spend/idle", status="queued")
        session.add(idle)
        session.flush()
        idle_id = idle.id
    zero = {"calls": 0, "input_tokens": 0, "cached_tokens": 0, "output_tokens": 0, "cost_usd": 0.0}
    zero["budget_cost_usd"] = 0.0
    assert client.get(f"/v1/jobs/{idle_id}").json()["spend"] == zero
    # A read key sees the job, not what it cost: spend is the metrics' and the admin's, as everywhere
    # else a reader is kept from spend and budget figures.
    from tests.auth import bearer, new_key

    read = client.get(f"/v1/jobs/{job_id}", headers=bearer(new_key(tx_factory, ["read"])))
    assert read.status_code == 200 and read.json()["spend"] is None
    metrics = client.get(f"/v1/jobs/{job_id}", headers=bearer(new_key(tx_factory, ["read", "metrics"])))
    assert metrics.json()["spend"] == pytest.approx(expected_spend())


@pytest.fixture
def cli(factory: sessionmaker[Session], database_url: str) -> Any:
    """The factmill CLI on the test database (it opens its own engine, so rows must be committed)."""

    def run(*args: str) -> Any:
        result = invoke_cli(database_url, *args)
        assert result.exit_code == 0, result.output
        return result

    return run


def test_jobs_show_gives_the_same_spend(factory: sessionmaker[Session], cli: Any) -> None:
    job_id, _ = record_calls(factory)
    shown = json.loads(cli("jobs", "show", str(job_id)).output)
    assert shown["id"] == job_id
    assert shown["spend"] == pytest.approx(expected_spend())


def test_costs_splits_every_grouping_into_batch_and_online(factory: sessionmaker[Session], cli: Any) -> None:
    job_id, other_id = record_calls(factory)
    batch_usd = float(usd(1900, 0, 280, batch=True))
    online_usd = float(usd(2000, 1500, 300) + usd(2100, 1500, 250))
    by_purpose = {
        (r["key"], r["mode"]): r for r in json.loads(cli("costs", "--by", "purpose", "--json").output)
    }
    assert set(by_purpose) == {("extraction", "batch"), ("extraction", "online"), ("embedding", "online")}
    assert by_purpose["extraction", "batch"]["calls"] == 1
    assert by_purpose["extraction", "batch"]["cost_usd"] == pytest.approx(batch_usd)
    assert by_purpose["extraction", "online"]["calls"] == 3  # two of the job, one of the other
    assert by_purpose["extraction", "online"]["cost_usd"] == pytest.approx(
        online_usd + float(usd(999, 9, 99))
    )
    assert by_purpose["extraction", "online"]["cached_share"] == pytest.approx(
        round(3009 / (2000 + 2100 + 999), 4)
    )

    by_job = json.loads(cli("costs", "--by", "job", "--json").output)
    assert [(r["key"], r["mode"], r["calls"]) for r in by_job] == [
        (str(job_id), "batch", 1),
        (str(job_id), "online", 3),
        (str(other_id), "online", 1),
    ]
    assert sum(r["cost_usd"] for r in by_job if r["key"] == str(job_id)) == pytest.approx(
        expected_spend()["cost_usd"]
    )
    modes = {
        r["mode"] for by in ("model", "day") for r in json.loads(cli("costs", "--by", by, "--json").output)
    }
    assert modes == {"batch", "online"}

    table = cli("costs", "--by", "model").output
    assert "batch" in table and "online" in table and "total" in table
