"""The job-kind registry: each kind of job declares itself once (task, queue, switch, work, backoff)."""

from __future__ import annotations

import importlib
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from worker.jobs.lifecycle import JobContext, WorkResult

# Where each kind declares itself. The registry imports these by name when a kind is first needed (as
# Celery's ``include`` does), so the outbox can route a kind without importing every feature up front.
# A new kind is one module that calls ``register`` plus one line here.
KIND_MODULES: dict[str, str] = {
    "extraction": "worker.extraction.job",
    "compaction": "worker.compaction.job",
    "calibration": "worker.calibration.job",
    "consolidation": "worker.consolidation.job",
    "batch_extraction": "worker.extraction.backfill_job",
}

# retry: the job's own failure (spends an attempt); requeue: infrastructure cut the run short (spends a
# worker loss); outage: the LLM provider cannot serve (spends neither; the job waits the outage out on
# its clock, worker.jobs.outages); pause: waits for a switch or the LLM budget (spends nothing); lost:
# another worker took the lease over (it counted the loss); release: the worker is stopping, so the job
# goes back to the queue at once for another worker (spends nothing); fail: no retry.
KILL_SWITCH = "kill_switch"  # pause reasons every kind has: its switch is off; a budget has no room
BUDGET = "budget"
Action = Literal["retry", "requeue", "outage", "pause", "fail", "lost", "release"]


class UnknownJobKindError(ValueError):
    pass


class KillSwitchOffError(RuntimeError):
    """A kind's kill switch was turned off mid-run: stop before the next LLM call; the job pauses."""


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff with full jitter, bounded: how long a job waits before its next attempt."""

    base_seconds: float = 5.0
    max_seconds: float = 300.0

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        # The exponent bounded: 2**1025 is past a float, and a budget of 2,000 losses (a week of outage
        # at five minutes each) raised OverflowError in settle, the job left running with a dead lease.
        ceiling = min(self.max_seconds, self.base_seconds * 2.0 ** min(max(0, attempt - 1), 64))
        return (rng or random).uniform(ceiling / 2, ceiling)


@dataclass(frozen=True)
class ErrorRule:
    """One row of the table that sorts a job's exceptions: this class (and its subclasses) → action."""

    error: type[BaseException]
    action: Action
    pause_reason: str | None = None  # for action "pause": kill_switch | budget
    when: Callable[[BaseException], bool] | None = None  # the rule applies only if this says so


@dataclass(frozen=True)
class JobKind:
    name: str
    task_name: str
    queue: str
    switch: str  # the kill switch (config key) that pauses this kind
    work: Callable[[JobContext], WorkResult]
    backoff: Backoff = field(default_factory=Backoff)
    # Consulted before the lifecycle's common rules; first match wins.
    errors: tuple[ErrorRule, ...] = ()
    # Pause reasons of this kind's own, beside the kill switch and the budget every kind can pause for
    # (the metrics list each one, so its series exists before the first job pauses).
    pause_reasons: tuple[str, ...] = ()
    # Job options that ask something of one run (a forced run, re-extracting skipped segments): a rerun
    # for content that arrived meanwhile goes without them.
    one_run_options: tuple[str, ...] = ()
    # What a run does while the kind's switch is off, instead of pausing at once (under the lease, as
    # ``work``): what the switch must not hold back (a backfill's cancel at the provider, which stops
    # its spend). It returns the run's result, a pause for the switch as a rule.
    while_switched_off: Callable[[JobContext], WorkResult] | None = None


@dataclass(frozen=True)
class Periodic:
    """A task beat sends on a schedule (not a job row): its name, queue and interval setting."""

    name: str  # the beat schedule entry
    task_name: str
    queue: str
    interval_setting: str  # the Settings field holding the interval in seconds


MAINTENANCE_QUEUE = "maintenance"
PERIODIC: tuple[Periodic, ...] = (
    Periodic("sweep", "tasks.maintenance.sweep", MAINTENANCE_QUEUE, "sweep_interval_seconds"),
    Periodic(
        "calibration-recompute", "tasks.calibration.schedule", "calibration", "calibration_schedule_seconds"
    ),
    # The poll that wakes backfills waiting on provider batches: on the maintenance queue (the jobs it
    # wakes run on extraction). On extraction it expired behind any backlog longer than its expiry
    # (celery_app.beat_schedule), and no batch was collected until the backlog drained.
    Periodic("backfill-poll", "tasks.backfill.poll", MAINTENANCE_QUEUE, "backfill_poll_seconds"),
)

_kinds: dict[str, JobKind] = {}


def register(kind: JobKind) -> JobKind:
    if kind.name not in KIND_MODULES:
        raise UnknownJobKindError(f"job kind {kind.name!r} is not listed in KIND_MODULES")
    _kinds[kind.name] = kind
    return kind


def kind_names() -> tuple[str, ...]:
    return tuple(KIND_MODULES)


def get_kind(name: str) -> JobKind:
    if name not in _kinds:
        module = KIND_MODULES.get(name)
        if module is None:
            raise UnknownJobKindError(f"unknown job kind {name!r}; expected one of {sorted(KIND_MODULES)}")
        importlib.import_module(module)
    return _kinds[name]


def all_kinds() -> list[JobKind]:
    return [get_kind(name) for name in KIND_MODULES]


def pause_reasons() -> tuple[str, ...]:
    """Every reason a job can be paused for, in a stable order."""
    from_kinds = [reason for kind in all_kinds() for reason in kind.pause_reasons]
    return tuple(dict.fromkeys([KILL_SWITCH, BUDGET, *from_kinds]))


def queues() -> tuple[str, ...]:
    """Every queue a worker can serve, in a stable order."""
    names = [kind.queue for kind in all_kinds()] + [p.queue for p in PERIODIC]
    return tuple(dict.fromkeys(names))


def task_routes() -> dict[str, dict[str, Any]]:
    routes = {kind.task_name: {"queue": kind.queue} for kind in all_kinds()}
    routes.update({p.task_name: {"queue": p.queue} for p in PERIODIC})
    return routes
