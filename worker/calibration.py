"""Calibration over the store: labelled observations in, split-conformal threshold versions out, τ read back.

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

import csv
import hashlib
import io
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from sqlalchemy import func, select, text, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.exc import OperationalError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from models import CalibrationObservation, CalibrationThreshold, Compaction
from worker.config_store import CALIBRATION_ENABLED
from worker.core.quality import COVERAGE_THRESHOLD, CoverageScore, calibrate_threshold
from worker.job_runner import JobOutcome, RetryPolicy, begin_job, paused_reason, retry_or_fail
from worker.jobs import (
    CALIBRATION,
    Heartbeat,
    JobRequest,
    LeaseLostError,
    Sender,
    enqueue,
    finish,
    request_job,
)
from worker.runtime import Runtime

logger = logging.getLogger(__name__)

# One pending recompute at a time: every request uses this job subject (jobs.uq_jobs_pending_subject).
SUBJECT = "calibration"
SPLIT_METHOD = "stratified-sha256-alternate-v1"
SPLIT_SALT = "factmill-calibration-split-v1"
MAX_ORIGIN_LENGTH = 200
MAX_KEY_LENGTH = 255
INSERT_CHUNK = 1000
# Serializes recomputes (a job and a `factmill calibration recompute --now` may overlap).
RECOMPUTE_LOCK_ID = 0x46_4D_43_41_4C  # "FMCAL"
RATE_TOLERANCE = 1e-9  # the same slack calibrate_threshold gives its own recall check
PAUSED_REASON = paused_reason(CALIBRATION_ENABLED)

Trigger = Literal["schedule", "observations", "manual", "api"]


def describe_tau(tau: float) -> str:
    """τ for people: 4 significant digits, and ``+ε`` when it sits just above a round value.

    calibrate_threshold puts τ one machine epsilon above a lost case's coverage so that case is
    rejected; printing it as plain ``0.5`` would suggest a summary at exactly 0.5 passes.
    """
    rounded = round(tau, 4)
    if tau != rounded and abs(tau - rounded) < 1e-9:
        return f"{rounded:g}+ε" if tau > rounded else f"{rounded:g}-ε"
    return f"{tau:.4g}"


class ObservationError(ValueError):
    """An observation a user sent is not usable; the message says which field and why."""


# ---------------------------------------------------------------------------
# Observations in
# ---------------------------------------------------------------------------


def _check_coverage(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ObservationError(f"coverage must be a number from 0 to 1, got {value!r}")
    if math.isnan(value) or not 0.0 <= value <= 1.0:
        raise ObservationError(
            f"coverage must be a number from 0 to 1 (the share of query units a summary kept), got {value!r}"
        )
    return float(value)


def _check_text(value: object, name: str, limit: int) -> str:
    if not isinstance(value, str):
        raise ObservationError(f"{name} must be text, got {value!r}")
    cleaned = value.strip()
    if not cleaned or len(cleaned) > limit or not cleaned.isprintable():
        raise ObservationError(f"{name} must be 1 to {limit} printable characters, got {value!r}")
    return cleaned


@dataclass(frozen=True, slots=True)
class ObservationIn:
    """One labelled case to store, validated on construction (ObservationError says what is wrong)."""

    coverage: float
    answer_kept: bool
    origin: str
    compaction_id: int | None = None
    idempotency_key: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "coverage", _check_coverage(self.coverage))
        if not isinstance(self.answer_kept, bool):
            raise ObservationError(f"answer_kept must be true or false, got {self.answer_kept!r}")
        object.__setattr__(self, "origin", _check_text(self.origin, "origin", MAX_ORIGIN_LENGTH))
        if self.compaction_id is not None and (
            isinstance(self.compaction_id, bool)
            or not isinstance(self.compaction_id, int)
            or self.compaction_id < 1
        ):
            raise ObservationError(f"compaction_id must be a positive integer, got {self.compaction_id!r}")
        if self.idempotency_key is not None:
            key = _check_text(self.idempotency_key, "idempotency_key", MAX_KEY_LENGTH)
            object.__setattr__(self, "idempotency_key", key)

    def dedupe_key(self) -> str | None:
        """The key that makes a repeated submission a duplicate; None means never deduplicated.

        A client key wins. Otherwise a judgement of a known compaction is identified by everything it
        says (origin, compaction, coverage, label), so resending it is a no-op. Without either, two equal
        labels may be two real cases, and both are kept.
        """
        if self.idempotency_key is not None:
            return f"key:{self.idempotency_key}"
        if self.compaction_id is not None:
            fields = f"{self.origin}\x1f{self.compaction_id}\x1f{self.coverage!r}\x1f{self.answer_kept}"
            return "compaction:" + hashlib.sha256(fields.encode("utf-8")).hexdigest()
        return None

    def same_as(self, row: CalibrationObservation) -> bool:
        return (row.coverage, row.answer_kept, row.origin, row.compaction_id) == (
            self.coverage,
            self.answer_kept,
            self.origin,
            self.compaction_id,
        )


@dataclass(frozen=True)
class StoredObservation:
    index: int  # position in the submitted sequence
    id: int
    duplicate: bool  # True: an earlier submission with the same key was found; nothing new was stored


@dataclass
class AddReport:
    stored: list[StoredObservation] = field(default_factory=list)
    # (index, message): refused, nothing stored (a reused key, a compaction that does not exist)
    conflicts: list[tuple[int, str]] = field(default_factory=list)
    recompute: JobRequest | None = None

    @property
    def added(self) -> list[StoredObservation]:
        return [s for s in self.stored if not s.duplicate]

    @property
    def duplicates(self) -> list[StoredObservation]:
        return [s for s in self.stored if s.duplicate]

    def pending_jobs(self) -> list[tuple[int, str]]:
        """Jobs to hand to the broker after the commit (only a newly created recompute)."""
        if self.recompute is not None and self.recompute.created:
            return [(self.recompute.job_id, CALIBRATION)]
        return []


def _conflict_message(obs: ObservationIn, row: CalibrationObservation) -> str:
    return (
        f"idempotency_key {obs.idempotency_key!r} was already used for a different observation "
        f"(id {row.id}: coverage {row.coverage}, answer_kept {str(row.answer_kept).lower()}, "
        f"origin {row.origin!r}); send a new key for a new observation"
    )


def store_observations(session: Session, observations: Sequence[ObservationIn]) -> AddReport:
    """Insert the observations in the caller's transaction; a repeated key is reported, not stored twice.

    Ids follow the submitted order. One naming a compaction that does not exist is refused (a conflict).
    """
    report = AddReport()
    unknown = _unknown_compactions(session, observations)
    indexed: list[tuple[int, ObservationIn]] = []
    for index, obs in enumerate(observations):
        if obs.compaction_id in unknown:  # the foreign key would refuse the whole batch
            report.conflicts.append((index, f"compaction_id {obs.compaction_id}: no such compaction"))
        else:
            indexed.append((index, obs))
    # Runs of keyed and of unkeyed observations are inserted differently; taking runs in order keeps ids
    # in submission order.
    for unkeyed, run in itertools.groupby(indexed, key=lambda item: item[1].dedupe_key() is None):
        items = list(run)
        for start in range(0, len(items), INSERT_CHUNK):
            chunk = items[start : start + INSERT_CHUNK]
            (_store_unkeyed if unkeyed else _store_keyed)(session, chunk, report)
    report.stored.sort(key=lambda s: s.index)
    report.conflicts.sort()
    return report


def _unknown_compactions(session: Session, observations: Sequence[ObservationIn]) -> set[int]:
    """The judged compaction ids that name no compaction. The ones found are locked FOR KEY SHARE (as
    the foreign key check itself does), so none can be deleted before this transaction commits."""
    ids = {obs.compaction_id for obs in observations if obs.compaction_id is not None}
    if not ids:
        return set()
    found = session.scalars(
        select(Compaction.id).where(Compaction.id.in_(ids)).with_for_update(key_share=True)
    )
    return ids - set(found)


def _row(obs: ObservationIn) -> dict[str, Any]:
    return {
        "coverage": obs.coverage,
        "answer_kept": obs.answer_kept,
        "origin": obs.origin,
        "compaction_id": obs.compaction_id,
        "dedupe_key": obs.dedupe_key(),
    }


def _store_unkeyed(session: Session, chunk: list[tuple[int, ObservationIn]], report: AddReport) -> None:
    ids = session.scalars(
        insert(CalibrationObservation).returning(CalibrationObservation.id, sort_by_parameter_order=True),
        [_row(obs) for _, obs in chunk],
    ).all()
    report.stored.extend(StoredObservation(i, id_, False) for (i, _), id_ in zip(chunk, ids, strict=True))


def _store_keyed(session: Session, chunk: list[tuple[int, ObservationIn]], report: AddReport) -> None:
    result = session.execute(
        insert(CalibrationObservation)
        .values([_row(obs) for _, obs in chunk])
        .on_conflict_do_nothing(index_elements=[CalibrationObservation.dedupe_key])
        .returning(CalibrationObservation.dedupe_key, CalibrationObservation.id)
    )
    inserted: dict[str | None, int] = {key: id_ for key, id_ in result}
    keys = {obs.dedupe_key() for _, obs in chunk}
    existing = {
        row.dedupe_key: row
        for row in session.scalars(
            select(CalibrationObservation).where(CalibrationObservation.dedupe_key.in_(keys))
        )
    }
    claimed: set[str] = set()
    for index, obs in chunk:
        key = obs.dedupe_key()
        assert key is not None
        if key in inserted and key not in claimed:  # the first submission with a key is the one stored
            claimed.add(key)
            report.stored.append(StoredObservation(index, inserted[key], False))
            continue
        stored = existing[key]
        if obs.same_as(stored):
            report.stored.append(StoredObservation(index, stored.id, True))
        else:
            report.conflicts.append((index, _conflict_message(obs, stored)))


def observations_since_last_version(session: Session) -> int:
    """Observations newer than the ones the latest threshold version was computed from."""
    last = session.scalar(
        select(CalibrationThreshold.max_observation_id).order_by(CalibrationThreshold.version.desc()).limit(1)
    )
    query = select(func.count()).select_from(CalibrationObservation)
    if last is not None:
        query = query.where(CalibrationObservation.id > last)
    return session.scalar(query) or 0


def request_recompute_if_due(session: Session, every: int) -> JobRequest | None:
    """Request a recompute once ``every`` observations are newer than the last version (one pending)."""
    if observations_since_last_version(session) < every:
        return None
    return request_job(session, CALIBRATION, SUBJECT, options={"trigger": "observations"})


def add_observations(
    factory: sessionmaker[Session], observations: Sequence[ObservationIn], *, recompute_every: int
) -> AddReport:
    """Store the observations in one transaction, requesting a recompute when one is due.

    The caller hands ``report.pending_jobs()`` to the broker after this returns (the commit is done).
    """
    with factory.begin() as session:
        report = store_observations(session, observations)
        if report.added:
            report.recompute = request_recompute_if_due(session, recompute_every)
    return report


def add_observation(
    factory: sessionmaker[Session], observation: ObservationIn, *, recompute_every: int
) -> AddReport:
    """``add_observations`` for one; a reused key with different values raises ObservationError."""
    report = add_observations(factory, [observation], recompute_every=recompute_every)
    if report.conflicts:
        raise ObservationError(report.conflicts[0][1])
    return report


def request_recompute(
    factory: sessionmaker[Session], trigger: Trigger, sender: Sender | None = None
) -> JobRequest:
    """Request a recompute job (or reuse the pending one) and send it after the commit."""
    with factory.begin() as session:
        request = request_job(session, CALIBRATION, SUBJECT, options={"trigger": trigger})
    if request.created:
        enqueue(factory, [(request.job_id, CALIBRATION)], sender)
    return request


# ---------------------------------------------------------------------------
# CSV import
# ---------------------------------------------------------------------------

CSV_COLUMNS = ("coverage", "answer_kept", "origin", "compaction_id", "idempotency_key")
POSITIONAL_COLUMNS = CSV_COLUMNS[:4]
TRUE_WORDS = frozenset({"true", "t", "1", "yes", "y", "kept"})
FALSE_WORDS = frozenset({"false", "f", "0", "no", "n", "lost"})


class CsvFormatError(ValueError):
    """The file as a whole cannot be read (encoding, header); nothing was imported."""


@dataclass
class ImportReport:
    rows: int = 0  # data rows seen (blank and comment lines excluded)
    added: list[tuple[int, int]] = field(default_factory=list)  # (line, observation id)
    duplicates: list[tuple[int, int]] = field(default_factory=list)  # (line, id of the earlier copy)
    errors: list[tuple[int, str]] = field(default_factory=list)  # (line, message)
    recompute: JobRequest | None = None

    def pending_jobs(self) -> list[tuple[int, str]]:
        if self.recompute is not None and self.recompute.created:
            return [(self.recompute.job_id, CALIBRATION)]
        return []


def _parse_label(cell: str) -> bool:
    word = cell.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ObservationError(f"answer_kept {cell!r} is not one of true/false, 1/0, yes/no, kept/lost")


def _parse_row(values: dict[str, str], default_origin: str, line_key: str) -> ObservationIn:
    raw_coverage = values.get("coverage", "")
    try:
        coverage = float(raw_coverage)
    except ValueError:
        raise ObservationError(f"coverage {raw_coverage!r} is not a number") from None
    compaction_id: int | None = None
    raw_id = values.get("compaction_id", "")
    if raw_id:
        if not raw_id.isascii() or not raw_id.isdigit():
            raise ObservationError(f"compaction_id {raw_id!r} is not a positive integer")
        compaction_id = int(raw_id)
    key = values.get("idempotency_key") or None
    if key is None and compaction_id is None:
        key = line_key  # re-importing the same file reports its rows as duplicates
    return ObservationIn(
        coverage=coverage,
        answer_kept=_parse_label(values.get("answer_kept", "")),
        origin=values.get("origin") or default_origin,
        compaction_id=compaction_id,
        idempotency_key=key,
    )


def parse_observations_csv(
    content: str, *, default_origin: str, file_digest: str
) -> tuple[list[tuple[int, ObservationIn]], list[tuple[int, str]], int]:
    """Rows of ``coverage,answer_kept,origin[,compaction_id]`` → (good rows by line, errors by line, rows).

    A first line naming the columns is a header (then columns may come in any order, and an
    ``idempotency_key`` column is allowed). Blank lines and lines starting with ``#`` are skipped. A
    blank origin becomes ``default_origin``. Line numbers are the file's, counted from 1.
    """
    reader = csv.reader(io.StringIO(content, newline=""))
    good: list[tuple[int, ObservationIn]] = []
    errors: list[tuple[int, str]] = []
    columns: tuple[str, ...] | None = None
    rows = 0
    previous_end = 0
    while True:
        start = previous_end + 1
        try:
            record = next(reader)
        except StopIteration:
            break
        except csv.Error as exc:
            if reader.line_num == previous_end:  # no progress: stop rather than loop
                errors.append((start, f"unreadable CSV: {exc}"))
                break
            previous_end = reader.line_num
            rows += 1
            errors.append((start, f"unreadable CSV: {exc}"))
            continue
        previous_end = reader.line_num
        cells = [cell.strip() for cell in record]
        if not any(cells) or cells[0].startswith("#"):
            continue
        if columns is None and rows == 0 and cells[0].lower() in CSV_COLUMNS and not _is_number(cells[0]):
            columns = _header(cells, start)
            continue
        rows += 1
        names = columns or POSITIONAL_COLUMNS
        if columns is None and not 2 <= len(cells) <= len(POSITIONAL_COLUMNS):
            errors.append(
                (
                    start,
                    f"expected 2 to 4 columns (coverage,answer_kept,origin[,compaction_id]), "
                    f"got {len(cells)}",
                )
            )
            continue
        if columns is not None and len(cells) > len(columns):
            errors.append(
                (start, f"expected at most {len(columns)} columns (as in the header), got {len(cells)}")
            )
            continue
        try:
            values = dict(zip(names, cells, strict=False))
            good.append((start, _parse_row(values, default_origin, f"csv:{file_digest}:{start}")))
        except ObservationError as exc:
            errors.append((start, str(exc)))
    return good, errors, rows


def _is_number(cell: str) -> bool:
    try:
        float(cell)
    except ValueError:
        return False
    return True


def _header(cells: list[str], line: int) -> tuple[str, ...]:
    names = tuple(cell.lower() for cell in cells)
    unknown = [name for name in names if name not in CSV_COLUMNS]
    if unknown:
        raise CsvFormatError(
            f"line {line}: unknown column(s) {', '.join(map(repr, unknown))}; "
            f"expected {', '.join(CSV_COLUMNS)}"
        )
    missing = [name for name in ("coverage", "answer_kept") if name not in names]
    if missing:
        raise CsvFormatError(f"line {line}: the header has no {' or '.join(missing)} column")
    if len(set(names)) != len(names):
        raise CsvFormatError(f"line {line}: the header repeats a column")
    return names


def import_csv(
    factory: sessionmaker[Session],
    path: Path,
    *,
    recompute_every: int,
    origin: str | None = None,
) -> ImportReport:
    """Import a CSV of observations: bad rows are reported by line, good rows are stored.

    Raises CsvFormatError when the file cannot be read at all (OSError for a missing file).
    The caller sends ``report.pending_jobs()`` after this returns.
    """
    data = path.read_bytes()
    try:
        content = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise CsvFormatError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    default_origin = origin or f"csv:{path.name}"[:MAX_ORIGIN_LENGTH]
    digest = hashlib.sha256(data).hexdigest()[:16]
    good, errors, rows = parse_observations_csv(content, default_origin=default_origin, file_digest=digest)
    report = ImportReport(rows=rows, errors=errors)
    if good:
        stored = add_observations(factory, [obs for _, obs in good], recompute_every=recompute_every)
        lines = [line for line, _ in good]
        for item in stored.stored:
            (report.duplicates if item.duplicate else report.added).append((lines[item.index], item.id))
        report.errors.extend((lines[index], message) for index, message in stored.conflicts)
        report.errors.sort()
        report.recompute = stored.recompute
    return report


# ---------------------------------------------------------------------------
# The split and the activation rule (pure)
# ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Observation:
    """A stored observation as the recompute sees it."""

    id: int
    coverage: float
    answer_kept: bool

    def score(self) -> CoverageScore:
        return CoverageScore(self.coverage, self.answer_kept)


def _split_rank(salt: str, observation_id: int) -> bytes:
    return hashlib.sha256(f"{salt}:{observation_id}".encode("ascii")).digest()


def split_observations(
    observations: Iterable[Observation], *, salt: str = SPLIT_SALT
) -> tuple[list[Observation], list[Observation]]:
    """Split into (calibration, held-out) halves, stratified by label and deterministic.

    Within each label, observations are ordered by sha256 of ``salt`` and their id (so the halves do
    not follow arrival order, and the same set always splits the same way whatever order it comes in),
    then dealt alternately: the calibration half gets ceil(k/2) of each label's k cases, the held-out
    half floor(k/2). Both halves come back sorted by id.
    """
    items = list(observations)
    if len({o.id for o in items}) != len(items):
        raise ValueError("observation ids must be unique to split deterministically")
    calibration: list[Observation] = []
    held_out: list[Observation] = []
    for label in (False, True):
        stratum = sorted((o for o in items if o.answer_kept is label), key=lambda o: _split_rank(salt, o.id))
        calibration.extend(stratum[0::2])
        held_out.extend(stratum[1::2])
    return sorted(calibration, key=lambda o: o.id), sorted(held_out, key=lambda o: o.id)


def _conformal_rank_needs(alpha: float) -> int:
    """Fewest lost-answer cases for which ceil((n+1)(1-alpha)) <= n, i.e. the rank needs no clamping."""
    n = 1
    while math.ceil((n + 1) * (1.0 - alpha)) > n:
        n += 1
    return n


@dataclass(frozen=True)
class Evaluation:
    """What a recompute found: the candidate τ (None: none computed), whether it may gate, and why."""

    tau: float | None
    activate: bool
    reason: str
    n: int
    n_bad: int
    calibration_n: int = 0
    calibration_n_bad: int = 0
    held_out_n: int = 0
    held_out_n_bad: int = 0
    held_out_accepted: int = 0
    held_out_rate: float | None = None


def _check_parameters(alpha: float, target_recall: float, min_observations: int) -> None:
    for name, value in (("alpha", alpha), ("target_recall", target_recall)):
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 < value < 1.0:
            raise ValueError(f"{name} must be strictly between 0 and 1, got {value!r}")
    if isinstance(min_observations, bool) or not isinstance(min_observations, int) or min_observations < 4:
        raise ValueError(
            f"min_observations must be an integer of at least 4 (two kept and two lost cases), "
            f"got {min_observations!r}"
        )


def evaluate(
    observations: Sequence[Observation],
    *,
    alpha: float,
    target_recall: float,
    min_observations: int,
    salt: str = SPLIT_SALT,
) -> Evaluation:
    """Compute a candidate τ on the calibration half and decide whether the held-out half supports it.

    No τ is computed (tau None, not activated) when the data cannot support one: fewer than
    ``min_observations``; no case that lost the answer (τ would be 0, accepting coverages nobody ever
    observed); no case that kept it; or a single lost case (it cannot both set τ and test it).
    Otherwise τ = calibrate_threshold(calibration half) and the held-out cases with coverage ≥ τ are
    the accepted ones: the version activates only if some are accepted and the share of them that kept
    the answer is at least ``target_recall``.
    """
    _check_parameters(alpha, target_recall, min_observations)
    n = len(observations)
    n_bad = sum(not o.answer_kept for o in observations)
    n_good = n - n_bad

    def without_tau(reason: str) -> Evaluation:
        return Evaluation(tau=None, activate=False, reason=reason, n=n, n_bad=n_bad)

    if n == 0:
        return without_tau(
            "no observations yet; add some with POST /v1/feedback or `factmill calibration add`"
        )
    if n < min_observations:
        return without_tau(
            f"too few observations: {n} ({n_good} kept, {n_bad} lost); "
            f"at least {min_observations} are needed before a threshold is computed"
        )
    if n_bad == 0:
        return without_tau(
            f"no observation lost the answer (all {n} kept): the data cannot tell which coverage is too "
            "low, so no threshold is claimed"
        )
    if n_good == 0:
        return without_tau(
            f"every observation lost the answer ({n} lost): no coverage is shown to keep it, "
            "so no threshold is claimed"
        )
    if n_bad == 1:
        return without_tau(
            "only 1 observation lost the answer; at least 2 are needed (one sets the threshold, "
            "one checks it on the held-out half)"
        )

    calibration, held_out = split_observations(observations, salt=salt)
    tau = calibrate_threshold([o.score() for o in calibration], target_recall, alpha)
    accepted = [o for o in held_out if o.coverage >= tau]
    kept = sum(o.answer_kept for o in accepted)
    rate = kept / len(accepted) if accepted else None
    calibration_n_bad = sum(not o.answer_kept for o in calibration)
    stats: dict[str, Any] = {
        "tau": tau,
        "n": n,
        "n_bad": n_bad,
        "calibration_n": len(calibration),
        "calibration_n_bad": calibration_n_bad,
        "held_out_n": len(held_out),
        "held_out_n_bad": sum(not o.answer_kept for o in held_out),
        "held_out_accepted": len(accepted),
        "held_out_rate": rate,
    }
    note = ""
    needs = _conformal_rank_needs(alpha)
    if calibration_n_bad < needs:
        note = (
            f" (only {calibration_n_bad} lost-answer case(s) in the calibration half, fewer than the "
            f"{needs} the conformal rank at alpha={alpha:g} needs, so τ sits just above the highest one)"
        )
    if rate is None:
        reason = (
            f"no held-out case reaches τ={describe_tau(tau)} ({len(held_out)} held out), so the "
            f"answer-kept rate of accepted cases cannot be measured{note}"
        )
        return Evaluation(activate=False, reason=reason, **stats)
    measured = (
        f"held-out answer-kept rate {rate:.4g} ({kept} of {len(accepted)} accepted at τ={describe_tau(tau)})"
    )
    if rate + RATE_TOLERANCE >= target_recall:
        return Evaluation(
            activate=True, reason=f"{measured} meets the target {target_recall:g}{note}", **stats
        )
    return Evaluation(
        activate=False, reason=f"{measured} is below the target {target_recall:g}{note}", **stats
    )


# ---------------------------------------------------------------------------
# Recompute over the store
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ActiveThreshold:
    """The τ gates use now; ``version`` None means no version is active and τ is COVERAGE_THRESHOLD."""

    tau: float
    version: int | None


FALLBACK = ActiveThreshold(COVERAGE_THRESHOLD, None)


@dataclass(frozen=True)
class ThresholdResult:
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
    n: int
    n_bad: int
    calibration_n: int = 0
    calibration_n_bad: int = 0
    held_out_n: int = 0
    held_out_n_bad: int = 0
    held_out_accepted: int = 0
    held_out_rate: float | None = None

    @property
    def activated(self) -> bool:
        return self.outcome == "activated"

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["active"] = {"tau": self.active.tau, "version": self.active.version}
        return data


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


def load_observations(session: Session) -> list[Observation]:
    rows = session.execute(
        select(
            CalibrationObservation.id, CalibrationObservation.coverage, CalibrationObservation.answer_kept
        ).order_by(CalibrationObservation.id)
    )
    return [Observation(int(id_), float(coverage), bool(kept)) for id_, coverage, kept in rows]


def _result(outcome: Any, row: CalibrationThreshold, active: ActiveThreshold) -> ThresholdResult:
    return ThresholdResult(
        outcome=outcome,
        version=row.version,
        tau=row.tau,
        reason=row.reason,
        active=active,
        n=row.n,
        n_bad=row.n_bad,
        calibration_n=row.calibration_n,
        calibration_n_bad=row.calibration_n_bad,
        held_out_n=row.held_out_n,
        held_out_n_bad=row.held_out_n_bad,
        held_out_accepted=row.held_out_accepted,
        held_out_rate=row.held_out_rate,
    )


def recompute(
    factory: sessionmaker[Session],
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
    _check_parameters(alpha, target_recall, min_observations)
    with factory.begin() as session:
        session.execute(text("SELECT pg_advisory_xact_lock(:id)"), {"id": RECOMPUTE_LOCK_ID})
        observations = load_observations(session)
        max_id = observations[-1].id if observations else None
        current = active_threshold(session)
        latest = session.scalars(
            select(CalibrationThreshold).order_by(CalibrationThreshold.version.desc()).limit(1)
        ).first()
        if (
            not force
            and latest is not None
            and (
                latest.max_observation_id,
                latest.n,
                latest.alpha,
                latest.target_recall,
                latest.min_observations,
            )
            == (max_id, len(observations), alpha, target_recall, min_observations)
        ):
            logger.info("calibration unchanged since version %s; nothing written", latest.version)
            return _result("unchanged", latest, current)

        evaluation = evaluate(
            observations, alpha=alpha, target_recall=target_recall, min_observations=min_observations
        )
        if guard is not None:
            guard()
        reason = evaluation.reason
        if evaluation.activate:
            if current.version is not None:
                reason += f"; replaces version {current.version} (τ={describe_tau(current.tau)})"
                session.execute(
                    update(CalibrationThreshold)
                    .where(CalibrationThreshold.active.is_(True))
                    .values(active=False)
                )
        elif current.version is not None:
            reason += f"; version {current.version} (τ={describe_tau(current.tau)}) stays active"
        else:
            reason += f"; no version is active, so gates keep the fallback τ={COVERAGE_THRESHOLD:g}"
        row = CalibrationThreshold(
            tau=evaluation.tau,
            alpha=alpha,
            target_recall=target_recall,
            min_observations=min_observations,
            n=evaluation.n,
            n_bad=evaluation.n_bad,
            max_observation_id=max_id,
            split_method=SPLIT_METHOD,
            calibration_n=evaluation.calibration_n,
            calibration_n_bad=evaluation.calibration_n_bad,
            held_out_n=evaluation.held_out_n,
            held_out_n_bad=evaluation.held_out_n_bad,
            held_out_accepted=evaluation.held_out_accepted,
            held_out_rate=evaluation.held_out_rate,
            active=evaluation.activate,
            activated_at=func.now() if evaluation.activate else None,
            reason=reason,
            trigger=trigger,
            job_id=job_id,
        )
        session.add(row)
        session.flush()
        if evaluation.activate:
            assert evaluation.tau is not None
            active = ActiveThreshold(evaluation.tau, row.version)
        else:
            active = current
        result = _result("activated" if evaluation.activate else "kept", row, active)
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
# Reading it back
# ---------------------------------------------------------------------------


def threshold_history(session: Session, limit: int = 50) -> list[CalibrationThreshold]:
    """Threshold versions, newest first."""
    return list(
        session.scalars(
            select(CalibrationThreshold).order_by(CalibrationThreshold.version.desc()).limit(limit)
        )
    )


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
    return ObservationStats(n, kept, n - kept, observations_since_last_version(session), last_at)


def coverages_by_label(session: Session) -> tuple[list[float], list[float]]:
    """(coverages of cases that kept the answer, of cases that lost it)."""
    kept: list[float] = []
    lost: list[float] = []
    for observation in load_observations(session):
        (kept if observation.answer_kept else lost).append(observation.coverage)
    return kept, lost


class ThresholdCache:
    """The active τ for gates, re-read from the store at most every ``ttl`` seconds; thread-safe.

    A compaction worker gates every summary on it, so reads are one dictionary look-up almost always.
    If the store cannot be read, the last known value is served (and a warning logged) until the next
    refresh; with no value known yet the error propagates rather than inventing a threshold.
    """

    def __init__(
        self, factory: sessionmaker[Session], ttl: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._factory = factory
        self._ttl = ttl
        self._clock = clock
        self._lock = threading.Lock()
        self._value: ActiveThreshold | None = None
        self._read_at = 0.0

    def get(self) -> ActiveThreshold:
        with self._lock:
            current = self._clock()
            if self._value is not None and current - self._read_at < self._ttl:
                return self._value
            try:
                with self._factory() as session:
                    value = active_threshold(session)
            except SQLAlchemyError as exc:
                if self._value is None:
                    raise
                logger.warning(
                    "could not read the active threshold; using version %s: %s", self._value.version, exc
                )
                self._read_at = current
                return self._value
            self._value, self._read_at = value, current
            return value

    def tau(self) -> float:
        return self.get().tau

    def invalidate(self) -> None:
        with self._lock:
            self._value = None


# ---------------------------------------------------------------------------
# Running one recompute job (the calibration queue)
# ---------------------------------------------------------------------------


def run_calibration_job(rt: Runtime, job_id: int, policy: RetryPolicy | None = None) -> JobOutcome:
    """Lease the job, honour the kill switch, recompute, record the outcome on the job."""
    policy = policy or RetryPolicy()
    settings = rt.settings
    lease = begin_job(rt, job_id, CALIBRATION)
    if isinstance(lease, JobOutcome):
        return lease
    job, token = lease.job, lease.token

    with Heartbeat(rt.factory, job_id, token, settings.job_heartbeat_seconds) as beat:
        try:
            result = recompute(
                rt.factory,
                alpha=settings.calibration_alpha,
                target_recall=settings.calibration_target_recall,
                min_observations=settings.calibration_min_observations,
                trigger=str(job.options.get("trigger", "manual")),
                job_id=job.id,
                guard=beat.check,
            )
        except LeaseLostError as exc:
            return JobOutcome("lost", detail=str(exc))
        except OperationalError as exc:
            return retry_or_fail(rt, lease, f"{type(exc).__name__}: {exc}", policy)
        except ValueError as exc:  # bad settings: retrying cannot help
            finish(rt.factory, job_id, token, "failed", last_error=str(exc))
            return JobOutcome("failed", detail=str(exc))
    rerun = finish(rt.factory, job_id, token, "succeeded", counters=result.as_dict())
    if rerun is not None:
        enqueue(rt.factory, [rerun])
    return JobOutcome("succeeded", detail=result.reason)


__all__ = [
    "FALLBACK",
    "SPLIT_METHOD",
    "SUBJECT",
    "ActiveThreshold",
    "AddReport",
    "CsvFormatError",
    "Evaluation",
    "ImportReport",
    "Observation",
    "ObservationError",
    "ObservationIn",
    "ThresholdCache",
    "ThresholdResult",
    "active_threshold",
    "add_observation",
    "add_observations",
    "describe_tau",
    "evaluate",
    "import_csv",
    "parse_observations_csv",
    "recompute",
    "request_recompute",
    "request_recompute_if_due",
    "run_calibration_job",
    "split_observations",
    "threshold_history",
]
