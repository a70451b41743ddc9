"""The crash test at suite size: a backfill whose worker is SIGKILLed during submission and again
during polling ends with every page extracted once, every segment paid once, at half the online price.
(bench/backfill.py runs the same scenario on 2,000 pages.)"""

from __future__ import annotations

from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path

import pytest
from sqlalchemy.orm import Session, sessionmaker

from tests.integration.backfill_crash import run_crash_scenario
from tests.integration.test_backfill import SEGMENTS_PER_PAGE, facts_of, online_reference, seed_pages
from tests.service import service_env
from worker.simulator import Simulator, SimulatorConfig

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1500)]

PAGES = 6


@pytest.fixture(scope="module")
def crash_sim() -> Iterator[Simulator]:
    with Simulator(SimulatorConfig(batch_delay_seconds=2)) as simulator:
        yield simulator


def test_a_backfill_survives_sigkill_during_submission_and_during_polling(
    factory: sessionmaker[Session], database_url: str, broker_url: str, crash_sim: Simulator, tmp_path: Path
) -> None:
    seed_pages(factory, "bf", PAGES)
    reference = online_reference(factory, crash_sim, PAGES)
    crash_sim.reset()
    env = service_env(
        database_url,
        broker_url,
        crash_sim.base_url,
        backfill_poll_seconds=0.5,
        backfill_batch_max_requests=8,
    )
    segments = PAGES * SEGMENTS_PER_PAGE
    figures = run_crash_scenario(
        factory, env, crash_sim, tmp_path, source="bf", pages=PAGES, segments=segments
    )

    # The first worker died after the provider accepted its batch and before the id was stored.
    first_batches = figures.stored_after_first_kill["batches"]
    assert first_batches[0] == {"status": "submitting", "provider_batch_id": None}
    # Every page extracted exactly once, as an online run extracts it.
    assert facts_of(factory, "bf") == reference
    assert figures.pages_complete == PAGES
    assert figures.segments_committed_once == segments
    assert figures.segments_committed_twice_or_more == 0
    # Batch requests paid == segments: no batch was sent twice, every result recorded once.
    assert figures.provider_batches_created == figures.batches == 3
    assert figures.provider_requests_paid == segments
    assert figures.requests == {"done": segments}
    # Collected batches leave no copy of the pages at the provider (the dead workers' batch included).
    assert figures.provider_files_held == 0
    assert figures.llm_calls == segments
    # Half the online price for the same tokens.
    assert figures.cost_usd > 0
    assert figures.cost_usd == (figures.online_cost_usd / 2).quantize(Decimal("0.000001"))
