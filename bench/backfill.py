"""Backfill crash benchmark: a backfill of N pages through the simulator's batch API, its worker SIGKILLed
during submission (the provider accepted a batch whose id was never stored) and again during polling
(an ended batch's results downloading), then a third worker finishes it.

Prints whether every page was extracted exactly once, batch requests paid against segments (the
baseline: 1 request per segment), the cost against the online price of the same tokens (measured in
the same run from the same llm_calls rows, through the one costing function), and the seconds taken.

    .venv/bin/python bench/backfill.py [--pages 2000] [--batch-max 2000] [--batch-seconds 5]

Needs the local Postgres (127.0.0.1:5432) and Redis (127.0.0.1:6379); creates and drops its own
database and uses its own Redis key prefix in the benchmarks' Redis database (15), deleted at the end;
exits 1 when a page was not extracted exactly once.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from sqlalchemy.orm import sessionmaker  # noqa: E402

from bench.pipeline import BROKER, forget_broker_keys  # noqa: E402
from tests.integration.backfill_crash import run_crash_scenario  # noqa: E402
from tests.integration.test_backfill import SEGMENTS_PER_PAGE, seed_pages  # noqa: E402
from tests.service import fresh_database, service_env, stop_cleanly_on_termination  # noqa: E402
from worker import db  # noqa: E402
from worker.simulator import Simulator, SimulatorConfig  # noqa: E402

SERVER = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=2000)
    parser.add_argument("--batch-max", type=int, default=2000, help="requests per provider batch")
    parser.add_argument("--batch-seconds", type=float, default=5.0, help="how long a batch runs")
    args = parser.parse_args()
    segments = args.pages * SEGMENTS_PER_PAGE
    with (
        fresh_database(SERVER, "bench_backfill") as url,
        Simulator(SimulatorConfig(batch_delay_seconds=args.batch_seconds)) as sim,
        tempfile.TemporaryDirectory(prefix="factmill-bench-backfill-") as data_dir,
    ):
        db.upgrade(url)
        factory = sessionmaker(db.get_engine(url), expire_on_commit=False)
        seeded = time.monotonic()
        seed_pages(factory, "bf", args.pages)
        seed_seconds = time.monotonic() - seeded
        env = service_env(
            url,
            BROKER,
            sim.base_url,
            backfill_poll_seconds=0.5,
            backfill_batch_max_requests=args.batch_max,
        )
        try:
            figures = run_crash_scenario(
                factory,
                env,
                sim,
                Path(data_dir),
                source="bf",
                pages=args.pages,
                segments=segments,
                timeout=3600,
            )
        finally:
            forget_broker_keys(env["FACTMILL_BROKER_KEY_PREFIX"])
    result = asdict(figures)
    result["seed_seconds"] = round(seed_seconds, 1)
    result["exactly_once"] = (
        figures.pages_complete == args.pages
        and figures.segments_committed_once == segments
        and figures.segments_committed_twice_or_more == 0
    )
    result["paid_per_segment"] = figures.provider_requests_paid / segments
    result["llm_calls_per_segment"] = figures.llm_calls / segments
    result["cost_vs_online"] = (
        float(figures.cost_usd / figures.online_cost_usd) if figures.online_cost_usd else None
    )
    print(json.dumps(result, indent=2, default=str))
    return 0 if result["exactly_once"] else 1


if __name__ == "__main__":
    stop_cleanly_on_termination()
    sys.exit(main())
