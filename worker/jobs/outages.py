"""The outage clock: how long the LLM provider has served a job nothing, and what that run's end reads.

A provider outage (429/5xx past the retry layer, unreachable, the account's money spent) is nobody's
fault and the same for every job: it spends neither of a job's budgets (worker.jobs.budgets). The job
waits it out, its backoffs growing with the outage, and fails only once the provider has served it
nothing for FACTMILL_JOB_PROVIDER_OUTAGE_PATIENCE_SECONDS. The clock starts at the job's first run the
provider could not serve, and starts over once the provider has answered any call of the job since
(a flapping provider, a long page making progress between incidents)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

from sqlalchemy import exists, func, select
from sqlalchemy.orm import Session, sessionmaker

from models.tables import JOBS, LLM_CALLS

# What ``finish`` does with the clock: start it now, or keep the one running (None: a run that was no
# outage; a job that finished leaves it empty).
ClockChange = Literal["restart", "keep"]

# Outcomes of an llm_calls row that are no answer from the provider (every other one is: a reply that
# was malformed, cut off or refused was still served).
NOT_SERVED = ("provider_error", "budget_exhausted")


@dataclass(frozen=True)
class OutageClock:
    """The job's outage so far: ``restarts`` when it starts now (no clock yet, or the provider answered
    the job since it started); else ``elapsed`` seconds since it did, by the database's clock."""

    restarts: bool
    elapsed: float

    @property
    def change(self) -> ClockChange:
        return "restart" if self.restarts else "keep"

    def spent(self, patience_seconds: float) -> bool:
        return not self.restarts and self.elapsed >= patience_seconds

    def backoff(self, base_seconds: float, max_seconds: float, rng: random.Random | None = None) -> float:
        """The wait before the next run: about as long as the outage has lasted (so the tries grow
        sparse as an outage drags on, as an exponential backoff's do, with no counter to keep), from
        the base to the ceiling, jittered."""
        ceiling = min(max_seconds, max(base_seconds, 0.0 if self.restarts else self.elapsed))
        return (rng or random).uniform(ceiling / 2, ceiling)


def read_outage_clock(factory: sessionmaker[Session], job_id: int) -> OutageClock:
    since = JOBS.c.provider_outage_since
    served = exists().where(
        LLM_CALLS.c.job_id == JOBS.c.id,
        LLM_CALLS.c.created_at > since,
        LLM_CALLS.c.outcome.not_in(NOT_SERVED),
    )
    query = select(
        since.is_(None) | served,
        func.coalesce(func.extract("epoch", func.now() - since), 0.0),
    ).where(JOBS.c.id == job_id)
    with factory.begin() as session:
        row = session.execute(query).one_or_none()
    if row is None:  # the job is gone (erased): ``finish`` writes nothing either
        return OutageClock(True, 0.0)
    return OutageClock(bool(row[0]), float(row[1]))


def waiting_note(clock: OutageClock, patience_seconds: float, reason: str) -> str:
    waited = "" if clock.restarts else f" for {_span(clock.elapsed)}"
    return (
        f"the LLM provider cannot serve this job{waited}; it waits (failed after "
        f"{_span(patience_seconds)} with no answer): {reason}"
    )


def spent_note(clock: OutageClock, reason: str) -> str:
    return (
        f"the LLM provider served this job nothing for {_span(clock.elapsed)} "
        f"(FACTMILL_JOB_PROVIDER_OUTAGE_PATIENCE_SECONDS); retry it by hand once it serves; last: {reason}"
    )


def _span(seconds: float) -> str:
    if seconds >= 5400:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 90:
        return f"{seconds / 60:.0f} min"
    return f"{seconds:.0f} s"


__all__ = ["ClockChange", "OutageClock", "read_outage_clock", "spent_note", "waiting_note"]
