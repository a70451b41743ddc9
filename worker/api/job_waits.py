"""How long jobs have waited with no worker on them, for the alerts that see a stalled service: a
queue nobody takes from, or running jobs whose heartbeats stopped and that nobody swept."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client.core import GaugeMetricFamily
from sqlalchemy import func, or_, select
from sqlalchemy.orm import Session

from models import Job

_SECONDS_SINCE = func.extract("epoch", func.now() - func.min(func.coalesce(Job.enqueued_at, Job.created_at)))
# Queued and due (a retry's backoff or an outage's wait ahead is not waiting), by kind: ix_jobs_status_kind.
_OLDEST_DUE = (
    select(Job.kind, _SECONDS_SINCE, func.count())
    .where(Job.status == "queued", or_(Job.enqueued_at.is_(None), Job.enqueued_at <= func.now()))
    .group_by(Job.kind)
)
_OLDEST_BEAT = (
    select(Job.kind, func.extract("epoch", func.now() - func.min(Job.heartbeat_at)))
    .where(Job.status == "running", Job.heartbeat_at.is_not(None))
    .group_by(Job.kind)
)


@dataclass(frozen=True)
class JobWaits:
    due: dict[str, float]  # kind -> seconds the longest-waiting due queued job has waited since it was sent
    beat: dict[str, float]  # kind -> seconds since the oldest heartbeat of a running job
    due_count: dict[str, int]  # kind -> queued jobs due now

    @classmethod
    def read(cls, session: Session) -> JobWaits:
        rows = session.execute(_OLDEST_DUE).all()
        due = {kind: max(0.0, float(s)) for kind, s, _ in rows}
        beat = {kind: max(0.0, float(s)) for kind, s in session.execute(_OLDEST_BEAT)}
        return cls(due, beat, {kind: int(n) for kind, _, n in rows})

    def metrics(self, kinds: Iterable[str]) -> list[GaugeMetricFamily]:
        waiting = GaugeMetricFamily(
            "factmill_job_oldest_due_seconds",
            "Per kind, how long the due queued job that has waited longest has waited since it was (last) "
            "sent; 0 with none. The sweeper sends a job again after FACTMILL_JOB_REQUEUE_AFTER_SECONDS: "
            "growing while no job of the kind ends, nothing takes its queue (workers, broker or beat down)",
            labels=["kind"],
        )
        silent = GaugeMetricFamily(
            "factmill_job_oldest_heartbeat_seconds",
            "Per kind, the age of the oldest heartbeat of a running job; 0 with none. The sweeper hands a "
            "job whose heartbeat is older than FACTMILL_JOB_STALE_AFTER_SECONDS to another worker: minutes "
            "past it, the sweeper is not running (beat or the maintenance worker down)",
            labels=["kind"],
        )
        due = GaugeMetricFamily(
            "factmill_jobs_due",
            "Per kind, the queued jobs due now: not those waiting out a retry's backoff or a provider outage "
            "(factmill_jobs counts them as queued). What a worker pool can take: scale and alert on it",
            labels=["kind"],
        )
        # The kinds this release runs, each with a series (zeros: none vanishes). Not a kind only another
        # release knows (rolled back while its jobs wait): nothing here takes or sweeps it, by design, and
        # its growing ages fired "the sweeper is not running" for good (factmill_jobs still counts them).
        for kind in sorted(set(kinds)):
            waiting.add_metric([kind], self.due.get(kind, 0.0))
            silent.add_metric([kind], self.beat.get(kind, 0.0))
            due.add_metric([kind], self.due_count.get(kind, 0))
        return [waiting, silent, due]


__all__ = ["JobWaits"]
