"""Calibration's SQL inside the caller's Session: none of these commits (the caller owns the transaction).

The API and the CLI read with these in their own session; ``CalibrationStore`` wraps them in the
transactions it owns.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, Row, Text, any_, bindparam, func, select, text, update
from sqlalchemy.dialects.postgresql import ARRAY, insert
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from models import CalibrationObservation, CalibrationThreshold
from models.bulk import BulkInsert
from models.tables import CALIBRATION_OBSERVATIONS, CALIBRATION_THRESHOLDS
from worker.calibration.judged import judged_compactions, same_coverage
from worker.core import progress
from worker.core.calibration import FALLBACK, RECORDED_FIELDS, ActiveThreshold, Observation, ObservationIn
from worker.db import lock_timed_out
from worker.jobs.outbox import CALIBRATION, JobRequest, request_job

# One pending recompute at a time: every request uses this job subject (jobs.uq_jobs_pending_subject).
SUBJECT = "calibration"
INSERT_CHUNK = 1000
# Serializes recomputes (a job and a `factmill calibration recompute --now` may overlap).
RECOMPUTE_LOCK_ID = 0x46_4D_43_41_4C  # "FMCAL"
# Held shared by each transaction that stores observations, from before its ids are drawn until it
# commits; a recompute takes it exclusively for one statement to fix its bound (observations_bound).
OBSERVATIONS_LOCK_ID = 0x46_4D_4F_42_53  # "FMOBS"


# ---------------------------------------------------------------------------
# Observations in
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class StoredObservation:
    index: int  # position in the submitted sequence
    id: int
    duplicate: bool  # True: an earlier submission with the same key was found; nothing new was stored
    coverage: float | None = field(default=None, compare=False)  # as stored (a label: its measured one)


@dataclass
class AddReport:
    stored: list[StoredObservation] = field(default_factory=list)
    # (index, message): refused, nothing stored (a reused key, a compaction that does not exist)
    conflicts: list[tuple[int, str]] = field(default_factory=list)
    # The indexes of conflicts with a stored compaction (none, never judged, measured at another coverage).
    unknown_compactions: list[int] = field(default_factory=list)
    recompute: JobRequest | None = None

    @property
    def added(self) -> list[StoredObservation]:
        return [s for s in self.stored if not s.duplicate]

    @property
    def duplicates(self) -> list[StoredObservation]:
        return [s for s in self.stored if s.duplicate]

    def pending_jobs(self) -> list[tuple[int, str]]:
        """Jobs to hand to the broker after the commit (only a newly created recompute)."""
        return pending_recompute(self.recompute)


def pending_recompute(request: JobRequest | None) -> list[tuple[int, str]]:
    """The (job id, kind) to send after the commit: only a recompute this transaction created."""
    if request is not None and request.created:
        return [(request.job_id, CALIBRATION)]
    return []


def _conflict_message(obs: ObservationIn, row: Row[Any]) -> str:
    # The stored observation by its id only: its values and its origin (a label that may name a person)
    # went back to whoever reused the key, and every holder of the webhook secret is one sender.
    return (
        f"idempotency_key {obs.idempotency_key!r} was already used for a different observation "
        f"(id {row.id}); send a new key for a new observation"
    )


def _says_the_same(obs: ObservationIn, row: Row[Any], *, erased: bool = False) -> bool:
    """The stored row says what ``obs`` says (the origin aside when it is a default: a copy of the same
    file under another name, or with --origin, is the same rows, not a conflict on every line; with
    ``erased``, the compaction aside: its erasure set the row's to NULL)."""
    ignored = {"origin", "coverage"} if not obs.origin_given else {"coverage"}
    if erased:
        ignored.add("compaction_id")
    # A coverage within rounding of the stored one is the same (a label is stored at its compaction's
    # measured coverage: its resend, after an erasure too, is the duplicate it was).
    same = all(getattr(row, name) == value for name, value in obs.recorded().items() if name not in ignored)
    if obs.compaction_id is None:  # stored as sent: an honest resend is the same number
        return same and obs.coverage == row.coverage
    return same and same_coverage(obs.coverage, row.coverage)


def _stored_rows(
    session: Session, observations: Sequence[ObservationIn], naming: set[int]
) -> dict[int, Row[Any]]:
    """By position: the stored rows with the key of an observation naming one of the compactions
    ``naming`` (what a resubmission of it finds)."""
    keyed = {
        index: key
        for index, obs in enumerate(observations)
        if obs.compaction_id in naming and (key := obs.dedupe_key()) is not None
    }
    if not keyed:
        return {}
    rows = session.connection().execute(_KEYED_ROWS_ANY, {"keys": sorted(set(keyed.values()))})
    found = {row.dedupe_key: row for row in rows}
    return {index: row for index, key in keyed.items() if (row := found.get(key)) is not None}


def _stored_before(session: Session, observations: Sequence[ObservationIn], unjudged: set[int]) -> set[int]:
    """The positions of labels of compactions in ``unjudged`` already stored (before they were
    refused): a sender's retry gets its duplicate answer, not a 409."""
    rows = _stored_rows(session, observations, unjudged)
    return {index for index, row in rows.items() if _says_the_same(observations[index], row)}


def _erased_since(
    session: Session, observations: Sequence[ObservationIn], unknown: set[int]
) -> dict[int, StoredObservation]:
    """By position: the resubmissions (same key, same observation) of rows whose compaction was erased
    since. Refused as naming no compaction, an at-least-once sender's retry after an erasure got a 409
    instead of its duplicate answer."""
    return {
        index: StoredObservation(index, row.id, True, row.coverage)
        for index, row in _stored_rows(session, observations, unknown).items()
        if row.compaction_id is None and _says_the_same(observations[index], row, erased=True)
    }


def store_observations(
    session: Session, observations: Sequence[ObservationIn], on_chunk: Callable[[int], None] | None = None
) -> AddReport:
    """Insert the observations in the caller's transaction; a repeated key is reported, not stored twice.

    Ids follow the submitted order. One naming a compaction that does not exist is refused (a conflict).
    ``on_chunk`` hears how many observations each statement took (a progress bar's steps).
    """
    session.execute(text("SELECT pg_advisory_xact_lock_shared(:id)"), {"id": OBSERVATIONS_LOCK_ID})
    report = AddReport()
    unknown, unjudged, measured = judged_compactions(session, observations)
    erased = _erased_since(session, observations, unknown)
    # A label stored before it was refused (a compaction never judged, or one labelled at another
    # coverage before labels carried the measured one): a sender's retry gets its duplicate answer.
    off_measure = {
        obs.compaction_id
        for obs in observations
        if obs.compaction_id in measured and obs.coverage != measured[obs.compaction_id]
    }
    stored_before = _stored_before(session, observations, unjudged | off_measure)
    report.stored.extend(erased.values())
    indexed: list[tuple[int, ObservationIn]] = []
    for index, obs in enumerate(observations):
        if index in erased:
            continue
        if obs.compaction_id in unknown:  # the foreign key would refuse the whole batch
            report.conflicts.append((index, f"compaction_id {obs.compaction_id}: no such compaction"))
            report.unknown_compactions.append(index)
        elif obs.compaction_id in unjudged and index not in stored_before:
            report.conflicts.append(
                (
                    index,
                    f"compaction_id {obs.compaction_id}: that compaction has no measured coverage (it "
                    "failed, or its transcript gave the gate no query words to judge it on); only a judged "
                    "compaction (one with a coverage) can be labelled",
                )
            )
            report.unknown_compactions.append(index)
        elif (
            obs.compaction_id in measured
            and index not in stored_before
            and not same_coverage(obs.coverage, measured[obs.compaction_id])
        ):
            # A label of a compaction is a point of the gate's own measure: calibrated on a number the
            # client sent (0.615, as `transcripts show` prints 0.6153846...), τ could land just under the
            # coverage the gate measured, and pass the very case it was meant to reject.
            report.conflicts.append(
                (
                    index,
                    f"compaction_id {obs.compaction_id}: its coverage was measured as "
                    f"{measured[obs.compaction_id]!r}, not {obs.coverage!r}; send the measured coverage "
                    "(the transcript's context, or GET /v1/transcripts/{id}/compactions, gives it) or leave "
                    "compaction_id out",
                )
            )
            report.unknown_compactions.append(index)
        elif obs.compaction_id in measured and index not in stored_before:
            # Stored as measured, not as sent: within a last digit's rounding (a spreadsheet's 15
            # significant digits), τ computed on the sent value sat under the measured one.
            indexed.append((index, replace(obs, coverage=measured[obs.compaction_id])))
        else:
            indexed.append((index, obs))
    # Runs of keyed and of unkeyed observations are inserted differently; taking runs in order keeps ids
    # in submission order.
    for unkeyed, run in itertools.groupby(indexed, key=lambda item: item[1].dedupe_key() is None):
        items = list(run)
        for start in range(0, len(items), INSERT_CHUNK):
            chunk = items[start : start + INSERT_CHUNK]
            (_store_unkeyed if unkeyed else _store_keyed)(session, chunk, report)
            if on_chunk is not None:
                on_chunk(len(chunk))
    report.stored.sort(key=lambda s: s.index)
    report.conflicts.sort()
    return report


def _row(obs: ObservationIn) -> dict[str, Any]:
    return obs.recorded() | {"dedupe_key": obs.dedupe_key()}


# Core statements on the table, built once: an ORM-enabled bulk insert cost a feedback's request more
# Python than the rest of its transaction (py-spy of `bench/load.py --route feedback`).
_OBS = CALIBRATION_OBSERVATIONS.c
_INSERT_UNKEYED = insert(CALIBRATION_OBSERVATIONS).returning(_OBS.id, sort_by_parameter_order=True)
_SAID = (_OBS.id, _OBS.dedupe_key, *(_OBS[name] for name in RECORDED_FIELDS))
_KEYED_ROWS = select(*_SAID).where(_OBS.dedupe_key.in_(bindparam("keys", expanding=True)))
# One array parameter: a request may name 70,000 (erased) compactions, past the protocol's bind limit.
_KEYED_ROWS_ANY = select(*_SAID).where(_OBS.dedupe_key == any_(bindparam("keys", type_=ARRAY(Text))))
# One JSON document a chunk (models.bulk): built per chunk with .values(rows), each chunk of 1,000 was
# compiled anew and its 5,000 placeholders parsed by psycopg, 0.2 s of Python a chunk (a 200,000-row
# CSV import took 45 s).
_INSERT_KEYED = BulkInsert(
    CALIBRATION_OBSERVATIONS,
    (*RECORDED_FIELDS, "dedupe_key"),
    conflict=("dedupe_key",),
    returning="dedupe_key, id",
)


def dedupe_key_stored(session: Session, key: str) -> bool:
    """Whether an observation with this dedupe key is stored."""
    return session.scalar(select(_OBS.id).where(_OBS.dedupe_key == key).limit(1)) is not None


def _store_unkeyed(session: Session, chunk: list[tuple[int, ObservationIn]], report: AddReport) -> None:
    ids = session.connection().execute(_INSERT_UNKEYED, [_row(obs) for _, obs in chunk]).scalars().all()
    report.stored.extend(
        StoredObservation(i, id_, False, obs.coverage) for (i, obs), id_ in zip(chunk, ids, strict=True)
    )


def _store_keyed(session: Session, chunk: list[tuple[int, ObservationIn]], report: AddReport) -> None:
    connection = session.connection()
    inserted: dict[str | None, int] = dict(
        _INSERT_KEYED.returned_rows(session, [_row(obs) for _, obs in chunk])
    )
    keys = sorted({key for _, obs in chunk if (key := obs.dedupe_key()) is not None})
    existing = {row.dedupe_key: row for row in connection.execute(_KEYED_ROWS, {"keys": keys})}
    claimed: set[str] = set()
    for index, obs in chunk:
        key = obs.dedupe_key()
        assert key is not None
        if key in inserted and key not in claimed:  # the first submission with a key is the one stored
            claimed.add(key)
            report.stored.append(StoredObservation(index, inserted[key], False, obs.coverage))
            continue
        stored = existing[key]
        if _says_the_same(obs, stored):
            report.stored.append(StoredObservation(index, stored.id, True, stored.coverage))
        else:
            report.conflicts.append((index, _conflict_message(obs, stored)))


# Observations newer than the ones the latest threshold version was computed from (ids start at 1, so
# no version, or one computed from none, counts them all), counted up to :at_most.
_LAST_COMPUTED = (
    select(CALIBRATION_THRESHOLDS.c.max_observation_id)
    .order_by(CALIBRATION_THRESHOLDS.c.version.desc())
    .limit(1)
    .scalar_subquery()
)
_NEWER_OBSERVATIONS = select(func.count()).select_from(
    select(CALIBRATION_OBSERVATIONS.c.id)
    .where(CALIBRATION_OBSERVATIONS.c.id > func.coalesce(_LAST_COMPUTED, 0))
    .limit(bindparam("at_most"))
    .subquery()
)


def observations_since_last_version(session: Session, at_most: int) -> int:
    """Observations newer than the ones the latest threshold version was computed from, counted up
    to ``at_most``: every feedback asks, and while versions lag behind (no worker on the calibration
    queue, its switch off) a full count would grow with every observation."""
    return int(session.connection().execute(_NEWER_OBSERVATIONS, {"at_most": at_most}).scalar_one())


def request_recompute_if_due(session: Session, every: int) -> JobRequest | None:
    """Request a recompute once ``every`` observations are newer than the last version (one pending)."""
    if observations_since_last_version(session, every) < every:
        return None
    return request_job(session, CALIBRATION, SUBJECT, options={"trigger": "observations"})


def request_recompute(session: Session, trigger: str) -> JobRequest:
    """Request a recompute job, or reuse the pending one (send it after the commit)."""
    return request_job(session, CALIBRATION, SUBJECT, options={"trigger": trigger})


# ---------------------------------------------------------------------------
# Threshold versions
# ---------------------------------------------------------------------------


def lock_recompute(session: Session) -> None:
    """Hold the recompute lock until the caller's transaction ends (one recompute at a time)."""
    session.execute(text("SELECT pg_advisory_xact_lock(:id)"), {"id": RECOMPUTE_LOCK_ID})


def active_threshold(session: Session) -> ActiveThreshold:
    """The active version's τ, or COVERAGE_THRESHOLD (version None) while none is active."""
    row = session.execute(
        select(CalibrationThreshold.tau, CalibrationThreshold.version).where(
            CalibrationThreshold.active.is_(True)
        )
    ).first()
    if row is None or row.tau is None:
        return FALLBACK
    return ActiveThreshold(float(row.tau), int(row.version))


def deactivate_versions(session: Session, why: str | ColumnElement[str] = "") -> None:
    """Retire the active version (a new one is about to take its place); ``why`` is added to its reason."""
    reason = CalibrationThreshold.reason + why
    active = CalibrationThreshold.active.is_(True)
    session.execute(update(CalibrationThreshold).where(active).values(active=False, reason=reason))


# How long a recompute polls for the observations lock before it queues for it (for at most
# QUEUED_LOCK_TIMEOUT: later feedback waits behind it that long at most).
BOUND_PATIENCE_SECONDS = 30.0
QUEUED_LOCK_TIMEOUT = "5s"


class ObservationsBusyError(RuntimeError):
    """Storing transactions held the observations lock all along: the recompute tries again later."""


def observations_bound(
    session: Session, poll_seconds: float = 0.2, patience: float = BOUND_PATIENCE_SECONDS
) -> int | None:
    """The newest observation id a recompute reads up to, once every transaction that drew a lower one
    has ended: ids come from a sequence when a row is inserted, not when it commits, so a long import
    of ids 1..1000 could commit after a recompute had read id 1001 (and recorded it as its range):
    that version could not be derived again from "ids <= 1001", and its rows were never counted as
    new since. Storing transactions hold the lock shared; this takes it exclusively for one statement.
    By polling (a try-lock) rather than waiting in the lock's queue: a waiting exclusive request
    queues every later shared one behind it, so all feedback waited for an import of minutes. The
    statement runs in a savepoint, so the unlock always runs in a live transaction (a failed one would
    have left the lock on the pooled connection). Under steady feedback the try-lock may never find a
    moment free: each wait is a sign of life (a job's heartbeat keeps its lease), and after ``patience``
    seconds it queues for the lock for at most QUEUED_LOCK_TIMEOUT, then gives up
    (ObservationsBusyError: a job retries later; it had spun unseen until its lease lapsed)."""
    lock = {"id": OBSERVATIONS_LOCK_ID}
    deadline = time.monotonic() + patience
    while not session.scalar(text("SELECT pg_try_advisory_lock(:id)"), lock):
        progress.mark()
        if time.monotonic() >= deadline:
            _queue_for(session, lock)
            break
        time.sleep(poll_seconds)
    try:
        with session.begin_nested():
            newest = session.scalar(select(func.max(CalibrationObservation.id)))
    finally:
        release_session_lock(session, lock["id"])
    return int(newest) if newest is not None else None


def release_session_lock(session: Session, lock_id: int) -> None:
    """Unlock a session-level advisory lock; if the unlock cannot run (the transaction failed), the
    connection is closed instead, which releases it: a rollback does not, and the pooled connection
    held the exclusive lock for good, every storing transaction queued behind it."""
    try:
        session.execute(text("SELECT pg_advisory_unlock(:id)"), {"id": lock_id})
    except BaseException:
        session.connection().invalidate()
        raise


def _queue_for(session: Session, lock: dict[str, int]) -> None:
    """Wait in the lock's queue, at most QUEUED_LOCK_TIMEOUT; ObservationsBusyError past it."""
    before = session.scalar(text("SELECT current_setting('lock_timeout')"))
    try:
        with session.begin_nested():  # a refusal rolls the savepoint back, and the setting with it
            session.execute(text(f"SET LOCAL lock_timeout = '{QUEUED_LOCK_TIMEOUT}'"))
            session.execute(text("SELECT pg_advisory_lock(:id)"), lock)
            try:
                # Taken: the rest of the recompute waits for its locks as before (a released savepoint
                # keeps what SET LOCAL did).
                session.execute(text("SELECT set_config('lock_timeout', :was, true)"), {"was": before})
            except BaseException:
                release_session_lock(session, lock["id"])
                raise
    except OperationalError as exc:
        if not lock_timed_out(exc):
            raise
        raise ObservationsBusyError(
            "observations were being stored all along (the feedback lock was never free); the "
            "recompute tries again later"
        ) from None


def observations_extent(session: Session, bound: int | None) -> tuple[int | None, int]:
    """(the newest observation's id, how many cases there are) up to ``bound``: what a version is
    computed from, counted by Postgres without loading one observation into Python. Cases as a version
    counts them (worker.core.calibration.one_case_per_compaction): each compaction once, whatever its
    labels (counted as rows, a compaction labelled twice made every hourly recompute a new version)."""
    if bound is None:
        return None, 0
    named = CalibrationObservation.compaction_id
    count = session.scalar(
        select(func.count().filter(named.is_(None)) + func.count(named.distinct())).where(
            CalibrationObservation.id <= bound
        )
    )
    return bound, int(count or 0)


# Rows fetched from the DBAPI cursor: the columns are bigint, float8, boolean (NOT NULL) and a nullable
# bigint, so psycopg already answers int, float, bool and int or None, and each Observation is built
# straight from its tuple. Through
# SQLAlchemy's rows and a conversion a value, a million took 6.0 s; this way 3.0 s (the same machine).
_LOAD_OBSERVATIONS = (
    "SELECT id, coverage, answer_kept, compaction_id FROM calibration_observations WHERE id <= %(bound)s "
    "ORDER BY id"
)


def load_observations(session: Session, bound: int | None = None) -> list[Observation]:
    """The observations up to ``bound`` (None: every one), by id, in this session's transaction."""
    if bound is None:
        bound = 2**63 - 1
    result = session.connection().exec_driver_sql(_LOAD_OBSERVATIONS, {"bound": bound})
    try:
        return list(itertools.starmap(Observation, result.cursor.fetchall()))
    finally:
        result.close()


def threshold_history(session: Session, limit: int = 50) -> list[CalibrationThreshold]:
    """Threshold versions, newest first."""
    return list(
        session.scalars(
            select(CalibrationThreshold).order_by(CalibrationThreshold.version.desc()).limit(limit)
        )
    )


def latest_version(session: Session) -> CalibrationThreshold | None:
    """The newest threshold version, active or not."""
    history = threshold_history(session, 1)
    return history[0] if history else None


# ---------------------------------------------------------------------------
# Reading it back
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ObservationStats:
    n: int
    kept: int
    lost: int
    since_last_version: int
    last_at: datetime | None


def observation_stats(session: Session) -> ObservationStats:
    n, kept, last_at = session.execute(
        select(
            func.count(),
            func.count().filter(CalibrationObservation.answer_kept.is_(True)),
            func.max(CalibrationObservation.created_at),
        )
    ).one()
    return ObservationStats(n, kept, n - kept, observations_since_last_version(session, n), last_at)


def coverages_by_label(session: Session) -> tuple[list[float], list[float]]:
    """(coverages of cases that kept the answer, of cases that lost it)."""
    kept: list[float] = []
    lost: list[float] = []
    for observation in load_observations(session):
        (kept if observation.answer_kept else lost).append(observation.coverage)
    return kept, lost
