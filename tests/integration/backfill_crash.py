"""The backfill crash scenario, shared by the suite (small) and bench/backfill.py (2,000 pages).

Worker 1 is SIGKILLed while the provider holds its batch create open (the batch accepted, its id never
stored); worker 2 while it downloads an ended batch's results (polling, nothing of it committed); worker 3
finishes. Beat runs throughout (the sweeper hands the dead workers' lease on, the poll wakes the job).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from models import Backfill, BackfillBatch, BackfillRequest, ExtractionAudit, Fact, LLMCall
from tests.service import REPO, ServiceProcess, running, start_beat, start_worker, wait_for
from worker.accounting import cost_usd, parse_prices
from worker.extraction import TERMINAL_AUDIT_SOURCE
from worker.llm.types import Usage
from worker.simulator import Simulator

HOLD = 600.0  # the simulator holds the call this long: far longer than the scenario waits for it
# A loaded machine (the suite on 2 cores) can take a minute or more to start a worker.
START = 300.0


@dataclass
class CrashFigures:
    pages: int
    segments: int
    batches: int = 0
    requests: dict[str, int] = field(default_factory=dict)
    provider_batches_created: int = 0
    provider_requests_paid: int = 0
    provider_files_held: int = 0  # uploads and results not deleted at the provider
    llm_calls: int = 0
    cost_usd: Decimal = Decimal(0)
    online_cost_usd: Decimal = Decimal(0)
    pages_complete: int = 0
    segments_committed_once: int = 0
    segments_committed_twice_or_more: int = 0
    stored_after_first_kill: dict[str, Any] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)


def start_backfill_cli(env: dict[str, str], source: str) -> tuple[int, int]:
    """`factmill backfill --source S --json`, as an operator runs it: (backfill id, job id)."""
    done = subprocess.run(
        [sys.executable, "-m", "worker.cli", "backfill", "--source", source, "--json"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=START,
        check=True,
    )
    answer = json.loads(done.stdout)
    return int(answer["id"]), int(answer["job_id"])


def batch_rows(factory: sessionmaker[Session], backfill_id: int) -> list[dict[str, Any]]:
    with factory() as session:
        rows = session.scalars(
            select(BackfillBatch).where(BackfillBatch.backfill_id == backfill_id).order_by(BackfillBatch.id)
        ).all()
        return [{"status": b.status, "provider_batch_id": b.provider_batch_id} for b in rows]


def backfill_status(factory: sessionmaker[Session], backfill_id: int) -> str:
    with factory() as session:
        backfill = session.get(Backfill, backfill_id)
        return backfill.status if backfill is not None else "missing"


def run_crash_scenario(
    factory: sessionmaker[Session],
    env: dict[str, str],
    sim: Simulator,
    data_dir: Path,
    *,
    source: str,
    pages: int,
    segments: int,
    timeout: float = 600.0,
) -> CrashFigures:
    """Run the scenario over pages already stored in ``source``; the figures it ends with."""
    figures = CrashFigures(pages, segments)
    sim.configure(batch_create_hold_seconds=HOLD, batch_results_hold_seconds=0)
    started = time.monotonic()
    beat = start_beat(env, data_dir, START)
    with running(beat):
        first = start_worker(env, timeout=START)
        with running(first):
            backfill_id, job_id = start_backfill_cli(env, source)
            wait_for(
                lambda: sim.stats()["batches"]["created"] >= 1, timeout, "the provider to accept a batch"
            )
            first.kill()  # the create is accepted at the provider; its answer (the id) never arrives
        figures.stored_after_first_kill = {"batches": batch_rows(factory, backfill_id)}
        figures.seconds["to_first_kill"] = time.monotonic() - started
        sim.configure(batch_create_hold_seconds=0, batch_results_hold_seconds=HOLD)
        second = start_worker(env, timeout=START)
        with running(second):
            wait_for(
                lambda: sim.stats()["batches"]["results_downloads"] >= 1,
                timeout,
                "the second worker to poll an ended batch and download its results",
                diagnostics=second.tail,
            )
            second.kill()  # polling: the batch has ended, none of its results are committed
        figures.seconds["to_second_kill"] = time.monotonic() - started
        sim.configure(batch_results_hold_seconds=0)
        third = start_worker(env, timeout=START)
        with running(third):
            wait_for(
                lambda: backfill_status(factory, backfill_id) == "done",
                timeout,
                "the backfill to finish",
                interval=0.5,
                diagnostics=lambda: _diagnostics(factory, backfill_id, third),
            )
    figures.seconds["total"] = time.monotonic() - started
    return measure(factory, sim, figures, backfill_id, job_id, source)


def _diagnostics(factory: sessionmaker[Session], backfill_id: int, worker: ServiceProcess) -> str:
    return f"{batch_rows(factory, backfill_id)}\n{worker.tail()}"


def measure(
    factory: sessionmaker[Session],
    sim: Simulator,
    figures: CrashFigures,
    backfill_id: int,
    job_id: int,
    source: str,
) -> CrashFigures:
    stats = sim.stats()["batches"]
    figures.provider_batches_created = stats["created"]
    figures.provider_requests_paid = stats["requests"]
    figures.provider_files_held = stats["held"]["files"]
    prices = parse_prices(sim_prices(factory))
    with factory() as session:
        figures.batches = len(batch_rows(factory, backfill_id))
        figures.requests = {
            status: int(count)
            for status, count in session.execute(
                select(BackfillRequest.status, func.count())
                .join(BackfillBatch, BackfillBatch.id == BackfillRequest.batch_id)
                .where(BackfillBatch.backfill_id == backfill_id)
                .group_by(BackfillRequest.status)
            )
        }
        calls = session.scalars(select(LLMCall).where(LLMCall.job_id == job_id)).all()
        figures.llm_calls = len(calls)
        figures.cost_usd = sum((c.cost_usd for c in calls), Decimal(0))
        figures.online_cost_usd = sum(
            (
                cost_usd(
                    c.model,
                    Usage(c.input_tokens, c.output_tokens, c.cache_read_tokens, c.cache_write_tokens),
                    prices,
                )
                for c in calls
            ),
            Decimal(0),
        )
        figures.pages_complete = int(
            session.scalar(
                select(func.count()).where(Fact.source_id == source, Fact.source == TERMINAL_AUDIT_SOURCE)
            )
            or 0
        )
        per_segment = session.execute(
            select(func.count())
            .where(ExtractionAudit.source_id == source, ExtractionAudit.outcome == "ok")
            .group_by(ExtractionAudit.page_slug, ExtractionAudit.segment_start)
        ).scalars()
        counts = list(per_segment)
    figures.segments_committed_once = sum(1 for n in counts if n == 1)
    figures.segments_committed_twice_or_more = sum(1 for n in counts if n > 1)
    return figures


def sim_prices(factory: sessionmaker[Session]) -> str:
    from models import ConfigEntry

    with factory() as session:
        entry = session.get(ConfigEntry, "llm.prices")
        return entry.value if entry is not None else "{}"
