"""The outage clock: how long the LLM provider has served a job nothing, and what that run's end reads.

A provider outage (429/5xx past the retry layer, unreachable, the account's money spent) is nobody's
fault and the same for every job: it spends neither of a job's budgets (worker.jobs.budgets). The job
waits it out, its backoffs growing with the outage, and fails only once the provider has served it
nothing for FACTMILL_JOB_PROVIDER_OUTAGE_PATIENCE_SECONDS. The clock starts at the job's first run the
provider could not serve, starts anew after a run that went forward before the provider went away, and
is emptied by any run that ends otherwise (served, paused for a switch or a budget, finished); a run
that reached no verdict, or a kind's own pause after a run that went nowhere, leaves it.

An extraction run (the kind that can tell) in which the provider answered some of the page's calls,
yet no segment went forward (one it answers with a 500 every time, a request over a per-minute token
limit), is no outage: it is the job's own failure, on its attempts. Taken for an outage, such a page
waited a day, paying on every run for the other segments' calls in flight, whose answers were then
thrown away (worker.jobs.lifecycle.wait_out_outage)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from sqlalchemy import exists, false, func, select
from sqlalchemy.orm import Session, sessionmaker

from models.tables import JOBS, LLM_CALLS

# What ``finish`` does with the clock: "keep" (an outage run: started now if it was not running),
# "restart" (an outage that began after the run went forward: from now) or "leave" (a run that reached
# no verdict: handed back by a stopping worker, cut short by the database);
# None, any other end, empties it.
ClockChange = Literal["keep", "restart", "leave"]

# Outcomes of an llm_calls row that are no answer from the provider (every other one is: a reply that
# was malformed, cut off or refused was still served).
NOT_SERVED = ("provider_error", "budget_exhausted")


@dataclass(frozen=True)
class OutageClock:
    """The job's outage so far: ``elapsed`` seconds since its clock started (0: it starts now), and
    whether the provider ``answered`` any call of this run (then the run was no outage)."""

    running: bool
    elapsed: float
    answered: bool = False

    def spent(self, patience_seconds: float) -> bool:
        return self.running and self.elapsed >= patience_seconds

    def backoff(self, base_seconds: float, max_seconds: float, rng: random.Random | None = None) -> float:
        """The wait before the next run: about as long as the outage has lasted (so the tries grow
        sparse as an outage drags on, as an exponential backoff's do, with no counter to keep), from
        the base to the ceiling, jittered."""
        ceiling = min(max_seconds, max(base_seconds, self.elapsed if self.running else 0.0))
        return (rng or random).uniform(ceiling / 2, ceiling)


def read_outage_clock(factory: sessionmaker[Session], job_id: int, run_began: datetime | None) -> OutageClock:
    """The job's clock, and whether the provider answered a call the job made since ``run_began`` (its
    claim, by the database's clock: the claimed row's first heartbeat)."""
    since = JOBS.c.provider_outage_since
    answered = exists().where(
        LLM_CALLS.c.job_id == JOBS.c.id,
        LLM_CALLS.c.created_at >= run_began,
        LLM_CALLS.c.outcome.not_in(NOT_SERVED),
    )
    query = select(
        since.is_not(None),
        func.coalesce(func.extract("epoch", func.now() - since), 0.0),
        answered if run_began is not None else false(),
    ).where(JOBS.c.id == job_id)
    with factory.begin() as session:
        row = session.execute(query).one_or_none()
    if row is None:  # the job is gone (erased): ``finish`` writes nothing either
        return OutageClock(False, 0.0)
    return OutageClock(bool(row[0]), float(row[1]), bool(row[2]))


def waiting_note(clock: OutageClock, patience_seconds: float, reason: str) -> str:
    waited = f" for {_span(clock.elapsed)}" if clock.running else ""
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
