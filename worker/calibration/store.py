"""Calibration's store: observations and threshold versions, each method owning its transaction.

Every method opens its own session from the factory: writes in ``factory.begin()`` (committed when
the method returns), reads in a plain session closed without a commit. The recompute's transaction
is the one ``recomputing()`` holds open for the block the service runs in it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager

from sqlalchemy import ColumnElement, func
from sqlalchemy.orm import Session, sessionmaker

from models import CalibrationThreshold
from models.reads import read_only
from worker.calibration import queries
from worker.calibration.queries import AddReport
from worker.core.calibration import METHOD, ActiveThreshold, Evaluation, Observation, ObservationIn
from worker.jobs.outbox import JobRequest
from worker.jobs.sending import Sender, enqueue


class VersionWriter:
    """The recompute's view of the store, inside one transaction that holds the recompute lock."""

    def __init__(self, session: Session) -> None:
        self._session = session
        self._bound: int | None = None
        self._bounded = False

    def _upper(self) -> int | None:
        """The newest id this recompute reads up to: fixed once, when no lower one is still uncommitted."""
        if not self._bounded:
            self._bound, self._bounded = queries.observations_bound(self._session), True
        return self._bound

    def observations(self) -> list[Observation]:
        """The stored observations up to the recompute's bound, by id."""
        return queries.load_observations(self._session, self._upper()) if self._upper() is not None else []

    def extent(self) -> tuple[int | None, int]:
        """(the newest observation's id, the count) up to the bound, without loading them."""
        return queries.observations_extent(self._session, self._upper())

    def active(self) -> ActiveThreshold:
        return queries.active_threshold(self._session)

    def latest(self) -> CalibrationThreshold | None:
        return queries.latest_version(self._session)

    def method_of(self, version: int) -> str | None:
        row = self._session.get(CalibrationThreshold, version)
        return None if row is None else row.split_method

    def counted_labels_apart(self, version: int) -> bool:
        """Whether ``version`` counted more cases than its observations make, one a compaction: made by a
        release that counted each label of a compaction as a case of its own."""
        row = self._session.get(CalibrationThreshold, version)
        if row is None or row.max_observation_id is None:
            return False
        return row.n > queries.observations_extent(self._session, row.max_observation_id)[1]

    def retire_active(self, why: str | ColumnElement[str] = "") -> None:
        """No version is active after this (gates take the shipped fallback τ); ``why`` joins its reason."""
        queries.deactivate_versions(self._session, why)

    def record(
        self,
        evaluation: Evaluation,
        *,
        alpha: float,
        target_recall: float,
        min_observations: int,
        max_observation_id: int | None,
        reason: str,
        trigger: str,
        job_id: int | None,
    ) -> CalibrationThreshold:
        """Write the next version; one that activates first retires the version active now."""
        if evaluation.activate:
            queries.deactivate_versions(self._session)
        row = CalibrationThreshold(
            tau=evaluation.tau,
            alpha=alpha,
            target_recall=target_recall,
            min_observations=min_observations,
            max_observation_id=max_observation_id,
            split_method=METHOD,
            active=evaluation.activate,
            # When this statement ran, not when the transaction began (now()): before the recompute
            # lock's wait, so a version seemed computed and active before its predecessor's commit.
            computed_at=func.statement_timestamp(),
            activated_at=func.statement_timestamp() if evaluation.activate else None,
            reason=reason,
            trigger=trigger,
            job_id=job_id,
            **evaluation.counts(),
        )
        self._session.add(row)
        self._session.flush()
        return row


class CalibrationStore:
    """Observations and threshold versions in Postgres; every method owns its transaction."""

    def __init__(self, factory: sessionmaker[Session]) -> None:
        self._factory = factory

    def add(
        self,
        observations: Sequence[ObservationIn],
        *,
        recompute_every: int,
        on_chunk: Callable[[int], None] | None = None,
    ) -> AddReport:
        """Store the observations and, once a recompute is due, request it, in one transaction
        (``on_chunk``: see ``queries.store_observations``)."""
        with self._factory.begin() as session:
            report = queries.store_observations(session, observations, on_chunk)
            if report.added:
                report.recompute = queries.request_recompute_if_due(session, recompute_every)
        return report

    def knows(self, observation: ObservationIn) -> bool:
        """Whether an observation with ``observation``'s dedupe key is stored."""
        key = observation.dedupe_key()
        if key is None:
            return False
        with read_only(self._factory) as session:
            return queries.dedupe_key_stored(session, key)

    def request_recompute(self, trigger: str) -> JobRequest:
        """Request a recompute job (or reuse the pending one), committed; send it with ``enqueue``."""
        with self._factory.begin() as session:
            return queries.request_recompute(session, trigger)

    def enqueue(self, jobs: Iterable[tuple[int, str]], sender: Sender | None = None) -> int:
        """Hand committed jobs to the broker (and note when they went); returns how many went."""
        return enqueue(self._factory, jobs, sender)

    def active(self) -> ActiveThreshold:
        """The τ gates use now (read in its own session)."""
        with read_only(self._factory) as session:
            return queries.active_threshold(session)

    @contextmanager
    def recomputing(self) -> Iterator[VersionWriter]:
        """One transaction, serialized with any concurrent recompute, committed when the block ends."""
        with self._factory.begin() as session:
            queries.lock_recompute(session)
            yield VersionWriter(session)
