"""Calibration's service over a CalibrationStore: observations in, split-conformal versions out, τ read back.

The flow: observations (coverage a compression scored, whether it kept the answer) arrive through the
API, the CLI or a CSV import. A recompute splits them into a calibration half and a held-out half
(deterministic, stratified by label), computes τ on the calibration half with
``worker.core.quality.calibrate_threshold``, measures the answer-kept rate of the held-out cases τ
accepts, and writes a new ``calibration_thresholds`` version with that provenance. The version becomes
the active one only if the held-out rate meets the target; otherwise the current one stays and the
row says why. Gates read the active τ through ``ThresholdCache`` and fall back to
``COVERAGE_THRESHOLD`` until a version is active.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, Protocol

from sqlalchemy import func
from sqlalchemy.exc import SQLAlchemyError

from models import CalibrationThreshold
from worker.calibration.queries import AddReport, pending_recompute
from worker.calibration.store import CalibrationStore, VersionWriter
from worker.core.calibration import (
    COUNT_FIELDS,
    FALLBACK,
    MAX_CSV_BYTES,
    MAX_ORIGIN_LENGTH,
    METHOD,
    ActiveThreshold,
    ObservationError,
    ObservationIn,
    SplitCounts,
    UnknownCompactionError,
    check_parameters,
    checked_origin,
    describe_succession,
    describe_tau,
    evaluate,
)
from worker.core.calibration_csv import content_digest, decode_csv, parse_observations_csv
from worker.core.errors import error_summary
from worker.core.labels import clean_label
from worker.core.ttl_cache import TtlCache
from worker.jobs.outbox import CALIBRATION, JobRequest
from worker.jobs.sending import Sender

logger = logging.getLogger(__name__)

Trigger = Literal["schedule", "observations", "manual", "api"]


# ---------------------------------------------------------------------------
# Observations in
# ---------------------------------------------------------------------------


def add_observations(
    store: CalibrationStore, observations: Sequence[ObservationIn], *, recompute_every: int
) -> AddReport:
    """Store the observations in one transaction, requesting a recompute when one is due.

    The caller hands ``report.pending_jobs()`` to the broker after this returns (the commit is done).
    """
    return store.add(observations, recompute_every=recompute_every)


def add_observation(
    store: CalibrationStore, observation: ObservationIn, *, recompute_every: int
) -> AddReport:
    """``add_observations`` for one. A reused key with different values raises ObservationError, a
    compaction_id naming no compaction UnknownCompactionError."""
    report = add_observations(store, [observation], recompute_every=recompute_every)
    if report.unknown_compactions:
        raise UnknownCompactionError(report.conflicts[0][1])
    if report.conflicts:
        raise ObservationError(report.conflicts[0][1])
    return report


def request_recompute(store: CalibrationStore, trigger: Trigger, sender: Sender | None = None) -> JobRequest:
    """Request a recompute job (or reuse the pending one) and send it after the commit."""
    request = store.request_recompute(trigger)
    if request.created:
        store.enqueue([(request.job_id, CALIBRATION)], sender)
    return request


@dataclass
class ImportReport:
    rows: int = 0  # data rows seen (blank and comment lines excluded)
    added: list[tuple[int, int]] = field(default_factory=list)  # (line, observation id)
    duplicates: list[tuple[int, int]] = field(default_factory=list)  # (line, id of the earlier copy)
    errors: list[tuple[int, str]] = field(default_factory=list)  # (line, message)
    comments: list[int] = field(default_factory=list)  # lines skipped as comments (starting with #)
    recompute: JobRequest | None = None

    def pending_jobs(self) -> list[tuple[int, str]]:
        return pending_recompute(self.recompute)


def _import_origin(origin: str | None, path: Path, digest: str) -> str:
    """The origin of rows that leave theirs blank: ``origin`` (ObservationError at once if it is none: every
    row was refused alone, a line each), else the file's name, or its digest when the name is not
    printable text (a tab, or bytes of another encoding)."""
    if origin is not None:
        return checked_origin(origin)
    return clean_label(f"csv:{path.name}"[:MAX_ORIGIN_LENGTH], MAX_ORIGIN_LENGTH) or f"csv:{digest}"


def _as_imported_before(
    store: CalibrationStore, good: list[tuple[int, ObservationIn]], digest: str, bytes_digest: str
) -> list[tuple[int, ObservationIn]]:
    """``good``, its rows known by their line keyed as an earlier import of this file keyed them: by the
    file's bytes (before 2026-12; content_digest since). Keyed anew, a file imported before in another
    form than the usual (a byte-order mark, CRLF, no last newline) stored every such row again."""
    by_line = [(line, obs) for line, obs in good if obs.idempotency_key == f"csv:{digest}:{line}"]
    if bytes_digest == digest or not by_line:
        return good
    line, first = by_line[0]
    if not store.knows(replace(first, idempotency_key=f"csv:{bytes_digest}:{line}")):
        return good
    return [
        (line, replace(obs, idempotency_key=f"csv:{bytes_digest}:{line}"))
        if obs.idempotency_key == f"csv:{digest}:{line}"
        else (line, obs)
        for line, obs in good
    ]


def import_csv(
    store: CalibrationStore,
    path: Path,
    *,
    recompute_every: int,
    origin: str | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> ImportReport:
    """Import a CSV of observations: bad rows are reported by line, good rows are stored.

    Raises CsvFormatError when the file cannot be read at all (OSError for a missing file).
    The caller sends ``report.pending_jobs()`` after this returns. ``progress(stored, total)`` hears
    of each statement's rows once the file is read and checked (a 64 MiB file is minutes of inserts).
    """
    with path.open("rb") as file:  # no further than the cap: a path may be huge, or /dev/zero
        data = file.read(MAX_CSV_BYTES + 1)
    content = decode_csv(data, str(path))
    digest = content_digest(content)
    default_origin = _import_origin(origin, path, digest)
    parsed = parse_observations_csv(content, default_origin=default_origin, file_digest=digest)
    good = _as_imported_before(store, parsed.good, digest, hashlib.sha256(data).hexdigest()[:16])
    report = ImportReport(rows=parsed.rows, errors=parsed.errors, comments=parsed.comments)
    if good:
        done = 0

        def on_chunk(count: int) -> None:
            nonlocal done
            done += count
            if progress is not None:
                progress(done, len(good))

        stored = store.add([obs for _, obs in good], recompute_every=recompute_every, on_chunk=on_chunk)
        lines = [line for line, _ in good]
        for item in stored.stored:
            (report.duplicates if item.duplicate else report.added).append((lines[item.index], item.id))
        report.errors.extend((lines[index], message) for index, message in stored.conflicts)
        report.errors.sort()
        report.recompute = stored.recompute
    return report


# ---------------------------------------------------------------------------
# Recompute
# ---------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ThresholdResult(SplitCounts):
    """What one recompute did.

    outcome: ``activated`` (a new version gates from now on), ``kept`` (a new version was recorded but
    the previous active one, or the fallback, stays; ``reason`` says why), ``unchanged`` (nothing new
    since version ``version``; nothing was written).
    """

    outcome: Literal["activated", "kept", "unchanged"]
    version: int
    tau: float | None
    reason: str
    active: ActiveThreshold

    @property
    def activated(self) -> bool:
        return self.outcome == "activated"

    def as_dict(self) -> dict[str, Any]:
        head = {"outcome": self.outcome, "version": self.version, "tau": self.tau, "reason": self.reason}
        return head | {"active": {"tau": self.active.tau, "version": self.active.version}} | self.counts()


def _result(
    outcome: Literal["activated", "kept", "unchanged"], row: CalibrationThreshold, active: ActiveThreshold
) -> ThresholdResult:
    return ThresholdResult(
        outcome=outcome,
        version=row.version,
        tau=row.tau,
        reason=row.reason,
        active=active,
        **{name: getattr(row, name) for name in COUNT_FIELDS},
    )


def _computed_from(row: CalibrationThreshold) -> tuple[Any, ...]:
    return (
        row.max_observation_id,
        row.n,
        row.alpha,
        row.target_recall,
        row.min_observations,
        row.split_method,
    )


def _succession(
    versions: VersionWriter, activate: bool, current: ActiveThreshold
) -> tuple[str, ActiveThreshold]:
    """What the new version means for the active one (for its reason), and the version active after it
    (before an activating one is written). An active version made under rules this release does not
    hold to (an activation on "1 of 1 kept"), and not earned again under these, is retired: it stayed
    active for good, the gates on a τ nothing supports."""
    if activate or current.version is None:
        return describe_succession(activate, current), current
    if current.tau >= 1.0:
        # No version activates at τ = 1 now (evaluate): one an earlier release activated reverted
        # every summary short of full coverage.
        why = "accepts only full coverage"
    elif versions.method_of(current.version) != METHOD:
        why = "was made under other rules"
    elif versions.counted_labels_apart(current.version):
        # (Erasing a compaction only makes more cases of its labels: never retired for that.)
        why = "counted the labels of one compaction as several cases"
    else:
        return describe_succession(activate, current), current
    versions.retire_active()
    retired = f"; version {current.version} (τ={describe_tau(current.tau)}) {why}"
    return f"{retired} and is retired" + describe_succession(False, FALLBACK), FALLBACK


# Dated by the database's clock, as versions are (an operator's laptop's may be off).
RETIRED_BY_HAND = func.concat(
    "; retired by hand at ",
    func.to_char(func.timezone("UTC", func.statement_timestamp()), "YYYY-MM-DD HH24:MI:SS"),
    " UTC",
)


def retire_active(store: CalibrationStore) -> ActiveThreshold:
    """Retire the active version, if any (serialized with recomputes): the gates take the fallback τ
    until a recompute earns a new version (one with nothing new is "unchanged" and activates nothing;
    `--force` evaluates again). The operator's way out of a τ they distrust: the kill switch pauses
    recomputes only, and the gates kept the version. Returns the version that was active."""
    with store.recomputing() as versions:
        current = versions.active()
        if current.version is not None:
            versions.retire_active(RETIRED_BY_HAND)
            logger.warning("calibration version %s (τ=%s) retired by hand", current.version, current.tau)
    return current


def recompute(
    store: CalibrationStore,
    *,
    alpha: float,
    target_recall: float,
    min_observations: int,
    trigger: str = "manual",
    job_id: int | None = None,
    force: bool = False,
    guard: Callable[[], None] | None = None,
) -> ThresholdResult:
    """Compute a new threshold version from every observation stored so far, and activate it if earned.

    One transaction, serialized with any concurrent recompute. Unless ``force``, nothing is written
    when the latest version was computed from the same observations with the same parameters
    (outcome ``unchanged``), so an hourly schedule does not fill the history with copies.
    ``guard`` is called before writing (a job passes its lease check). Raises ValueError on bad
    parameters.
    """
    check_parameters(alpha, target_recall, min_observations)
    with store.recomputing() as versions:
        current = versions.active()
        latest = versions.latest()
        # Counted in Postgres before anything is loaded: an hourly schedule with no new feedback read
        # every observation ever stored into Python to find that out (bench/recompute_unchanged.py).
        inputs = (*versions.extent(), alpha, target_recall, min_observations, METHOD)
        stale = current.version is not None and (
            current.tau >= 1.0 or versions.method_of(current.version) != METHOD  # (_succession retires it)
        )
        if not force and latest is not None and _computed_from(latest) == inputs and not stale:
            logger.info("calibration unchanged since version %s; nothing written", latest.version)
            return _result("unchanged", latest, current)
        observations = versions.observations()
        max_id = inputs[0]  # the bound: every id up to it was committed when it was read
        evaluation = evaluate(
            observations, alpha=alpha, target_recall=target_recall, min_observations=min_observations
        )
        if guard is not None:
            guard()
        succession, current = _succession(versions, evaluation.activate, current)
        row = versions.record(
            evaluation,
            alpha=alpha,
            target_recall=target_recall,
            min_observations=min_observations,
            max_observation_id=max_id,
            reason=evaluation.reason + succession,
            trigger=trigger,
            job_id=job_id,
        )
        if evaluation.activate:
            assert evaluation.tau is not None
            result = _result("activated", row, ActiveThreshold(evaluation.tau, row.version))
        else:
            result = _result("kept", row, current)
    logger.info(
        "calibration version %s: %s (τ=%s, n=%s, lost=%s, held-out rate=%s): %s",
        result.version,
        result.outcome,
        result.tau,
        result.n,
        result.n_bad,
        result.held_out_rate,
        result.reason,
    )
    return result


# ---------------------------------------------------------------------------
# Reading τ back
# ---------------------------------------------------------------------------


class ThresholdSource(Protocol):
    def active(self) -> ActiveThreshold: ...


class ThresholdCache:
    """The active τ for gates, re-read from the store at most every ``ttl`` seconds; thread-safe.

    A compaction worker gates every summary on it, so reads are one dictionary look-up almost always
    (``TtlCache``: one read at a time, the others take the value it had). If the store cannot be
    read, the last known value is served (and a warning logged) until the next refresh; with no value
    known yet the error propagates rather than inventing a threshold.
    """

    def __init__(
        self, store: ThresholdSource, ttl: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._store = store
        self._cache: TtlCache[None, ActiveThreshold] = TtlCache(self._read, ttl, clock)

    def get(self) -> ActiveThreshold:
        return self._cache.get(None)

    def _read(self, _: None) -> ActiveThreshold:
        try:
            return self._store.active()
        except SQLAlchemyError as exc:
            known = self._cache.last(None)
            if known is None:
                raise
            logger.warning(
                "could not read the active threshold; using version %s: %s", known.version, error_summary(exc)
            )
            return known

    def tau(self) -> float:
        return self.get().tau

    def invalidate(self) -> None:
        self._cache.invalidate()
