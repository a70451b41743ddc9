"""Calibration's pure logic: observation checks, the deterministic split and the activation rule.

A CSV file's rows are read into observations by ``worker.core.calibration_csv``.
"""

from __future__ import annotations

import hashlib
import math
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Any

from worker.core.jsonvalues import BIGINT_MAX, INT4_MAX
from worker.core.labels import clean_label
from worker.core.quality import COVERAGE_THRESHOLD, CoverageScore, calibrate_threshold, conformal_rank

SPLIT_METHOD = "stratified-sha256-alternate-v1"
SPLIT_SALT = "factmill-calibration-split-v1"
MAX_ORIGIN_LENGTH = 200
MAX_KEY_LENGTH = 255
# An observations CSV is read whole; past this size (or MAX_CSV_ROWS rows) it is refused, to be split.
MAX_CSV_BYTES = 64 * 1024 * 1024
RATE_TOLERANCE = 1e-9  # the same slack calibrate_threshold gives its own recall check
# A version activates only on a rate measured over at least this many accepted held-out cases: "1 of 1
# kept" met any target, and a τ just above the highest lost coverage (0.95, say) replaced a well-founded
# one on the strength of one case, after which the gate rejected nearly every summary.
MIN_HELD_OUT_ACCEPTED = 5
# How a version is computed, as each stores it (its split_method): the split and the activation rule. A
# release that changes either names it anew here, and the next scheduled recompute writes a version
# under it (else "unchanged" kept one made under the old rules active until new feedback came).
# (Not renamed for one case per compaction: it computes the same version wherever no compaction is
# labelled twice, and where one is, the counts of cases differ from the version's and it is recomputed.)
METHOD = f"{SPLIT_METHOD}; activates on >= {MIN_HELD_OUT_ACCEPTED} accepted held-out cases"
# Below it the conformal rank needs over a million lost-answer cases (and near 1e-16, 1 - alpha is 1.0).
MIN_ALPHA = 1e-6
RECORDED_FIELDS = ("coverage", "answer_kept", "origin", "compaction_id")  # an observation's stored claim


def describe_tau(tau: float) -> str:
    """τ for people: 4 significant digits, and ``+ε`` when it sits just above a round value.

    calibrate_threshold puts τ one machine epsilon above a lost case's coverage so that case is
    rejected; printing it as plain ``0.5`` would suggest a summary at exactly 0.5 passes.
    """
    # The round value it sits by, written in up to 8 significant digits: rounded to 4 places, 0.99996+ε
    # read "τ = 1" (no τ of 1 is ever activated) and 1e-05+ε lost its mark.
    for digits in range(4, 9):
        for sign, mark in ((1, "+ε"), (-1, "-ε")):
            base = float(f"{tau - sign * sys.float_info.epsilon:.{digits}g}")
            if base != tau and base + sign * sys.float_info.epsilon == tau:
                return f"{base:.{digits}g}{mark}"
    rounded = round(tau, 4)  # a few steps off a round value (0.30000000000000004): marked too
    if rounded not in (0.0, 1.0) and tau != rounded and abs(tau - rounded) < 1e-9:
        return f"{rounded:g}+ε" if tau > rounded else f"{rounded:g}-ε"
    digits = 4
    while digits < 17 and tau not in (0.0, 1.0) and float(f"{tau:.{digits}g}") in (0.0, 1.0):
        digits += 1  # never "1" (or "0") for a τ that is not
    return f"{tau:.{digits}g}"


class ObservationError(ValueError):
    """An observation a user sent is not usable; the message says which field and why."""


class UnknownCompactionError(ObservationError):
    """The observation names a compaction that is not stored: a conflict with the stored state, not a
    malformed observation (the API answers 409)."""


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
    cleaned = clean_label(value, limit)
    if cleaned is None:
        raise ObservationError(f"{name} must be 1 to {limit} printable characters, got {value!r}")
    return cleaned


def checked_origin(value: object) -> str:
    """An origin as observations store it (ObservationError says what is wrong)."""
    return _check_text(value, "origin", MAX_ORIGIN_LENGTH)


def idempotency_dedupe_key(sender: str, key: str) -> str:
    """The stored form of a submission's idempotency key: a digest of its sender and the key. Two senders'
    equal keys collided (one's observation was dropped as the other's duplicate), and the key was kept as
    sent, though a key a client chose may name a person. Migration 0033 rewrote the keys kept before, as
    the operator's own (sender "")."""
    return "key:" + hashlib.sha256(f"{sender}\x1f{key}".encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class ObservationIn:
    """One labelled case to store, validated on construction (ObservationError says what is wrong)."""

    coverage: float
    answer_kept: bool
    origin: str
    compaction_id: int | None = None
    idempotency_key: str | None = None
    # False: the origin is a default (a file import's name or --origin for rows that leave it blank),
    # not the row's own: it does not make a copy of the same row another observation.
    origin_given: bool = True
    # Who submitted it, for the idempotency key's scope: "" for the operator's own (a signed webhook, a
    # file import), else the API key ("key:<id>"). Two tenants sending the same key are two submissions.
    sender: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "coverage", _check_coverage(self.coverage))
        if not isinstance(self.answer_kept, bool):
            raise ObservationError(f"answer_kept must be true or false, got {self.answer_kept!r}")
        object.__setattr__(self, "origin", checked_origin(self.origin))
        if self.compaction_id is not None and (
            isinstance(self.compaction_id, bool)
            or not isinstance(self.compaction_id, int)
            or not 1 <= self.compaction_id <= BIGINT_MAX  # an id past bigint failed the import's query
        ):
            raise ObservationError(
                f"compaction_id must be a positive integer up to {BIGINT_MAX}, got {self.compaction_id!r}"
            )
        if self.idempotency_key is not None:
            key = _check_text(self.idempotency_key, "idempotency_key", MAX_KEY_LENGTH)
            object.__setattr__(self, "idempotency_key", key)

    def recorded(self) -> dict[str, Any]:
        """What the observation says, as stored (the idempotency key only identifies the submission)."""
        return {name: getattr(self, name) for name in RECORDED_FIELDS}

    def dedupe_key(self) -> str | None:
        """The key that makes a repeated submission a duplicate; None means never deduplicated.

        A client key wins. Otherwise a judgement of a known compaction is identified by everything it
        says (origin, compaction, coverage, label), so resending it is a no-op. Without either, two equal
        labels may be two real cases, and both are kept.
        """
        if self.idempotency_key is not None:
            return idempotency_dedupe_key(self.sender, self.idempotency_key)
        if self.compaction_id is not None:
            origin = self.origin if self.origin_given else ""
            said = f"{origin}\x1f{self.compaction_id}\x1f{self.coverage!r}\x1f{self.answer_kept}"
            return "compaction:" + hashlib.sha256(said.encode("utf-8")).hexdigest()
        return None


# ---------------------------------------------------------------------------
# The split and the activation rule
# ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Observation:
    """A stored observation as the recompute sees it."""

    id: int
    coverage: float
    answer_kept: bool
    compaction_id: int | None = None

    def score(self) -> CoverageScore:
        return CoverageScore(self.coverage, self.answer_kept)


def one_case_per_compaction(observations: Iterable[Observation]) -> list[Observation]:
    """The cases a version is computed from: the labels of one compaction (a person's, an eval's, each
    judge of a panel) are one case, lost if any of them says the answer was lost, at the newest one's
    coverage, named by the first one's id. Counted apart, the copies of one compaction fell in both
    halves (the held-out check judged τ on the case that set it) and filled the minimums: five
    compactions labelled four times each passed 20 observations and 5 accepted held-out cases.
    Observations of no compaction are a case each."""
    observations = list(observations)
    named = [o.compaction_id for o in observations if o.compaction_id is not None]
    if len(set(named)) == len(named):  # no compaction labelled twice (the usual case: 0.1 s a million)
        return observations
    cases: list[Observation] = []
    # compaction -> its case so far: (first, newest, kept by all); one pass, no list per compaction
    labelled: dict[int, tuple[Observation, Observation, bool]] = {}
    for o in observations:
        if o.compaction_id is None:
            cases.append(o)
        elif (seen := labelled.get(o.compaction_id)) is None:
            labelled[o.compaction_id] = (o, o, o.answer_kept)
        else:
            first, newest, kept = seen
            first = o if o.id < first.id else first
            newest = o if o.id > newest.id else newest
            labelled[o.compaction_id] = (first, newest, kept and o.answer_kept)
    for first, newest, kept in labelled.values():
        if first is newest:
            cases.append(first)
        else:
            cases.append(Observation(first.id, newest.coverage, kept, first.compaction_id))
    return cases


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
    """Fewest lost-answer cases for which ceil((n+1)(1-alpha)) <= n, i.e. the rank needs no clamping.

    That is about (1-alpha)/alpha; the search starts just below it (counting up from 1 took 1/alpha
    steps: twelve seconds at alpha 1e-8) and checks each step as the rank is taken."""
    n = max(1, math.ceil((1.0 - alpha) / alpha) - 2)
    while conformal_rank(n, alpha) > n:
        n += 1
    return n


@dataclass(frozen=True)
class SplitCounts:
    """How many cases a recompute saw, how they split, and how the held-out half fared at τ."""

    n: int
    n_bad: int
    calibration_n: int = 0
    calibration_n_bad: int = 0
    held_out_n: int = 0
    held_out_n_bad: int = 0
    held_out_accepted: int = 0
    held_out_rate: float | None = None

    def counts(self) -> dict[str, Any]:
        """These counts by field name (as a threshold version stores them)."""
        return {name: getattr(self, name) for name in COUNT_FIELDS}


COUNT_FIELDS = tuple(f.name for f in fields(SplitCounts))


@dataclass(frozen=True, kw_only=True)
class Evaluation(SplitCounts):
    """What a recompute found: the candidate τ (None: none computed), whether it may gate, and why."""

    tau: float | None
    activate: bool
    reason: str


def check_parameters(alpha: float, target_recall: float, min_observations: int) -> None:
    """Raise ValueError, saying which and why, unless the recompute parameters are usable."""
    for name, value in (("alpha", alpha), ("target_recall", target_recall)):
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 < value < 1.0:
            raise ValueError(f"{name} must be strictly between 0 and 1, got {value!r}")
    if alpha < MIN_ALPHA:
        raise ValueError(
            f"alpha must be at least {MIN_ALPHA:g}, got {alpha!r}: its conformal rank needs some "
            f"{math.ceil(1 / alpha):,} lost-answer cases"
        )
    if isinstance(min_observations, bool) or not isinstance(min_observations, int) or min_observations < 4:
        raise ValueError(
            f"min_observations must be an integer of at least 4 (two kept and two lost cases), "
            f"got {min_observations!r}"
        )
    if min_observations > INT4_MAX:
        raise ValueError(
            f"min_observations must be at most {INT4_MAX:,} (a version stores it), got {min_observations:,}"
        )


def _refusal(n: int, n_bad: int, min_observations: int) -> str | None:
    """Why these counts cannot support any τ, or None when a τ can be computed."""
    n_good = n - n_bad
    if n == 0:
        return "no observations yet; add some with POST /v1/feedback or `factmill calibration add`"
    if n < min_observations:
        return (
            f"too few observations: {n} ({n_good} kept, {n_bad} lost); "
            f"at least {min_observations} are needed before a threshold is computed"
        )
    if n_bad == 0:
        return (
            f"no observation lost the answer (all {n} kept): the data cannot tell which coverage is too "
            "low, so no threshold is claimed"
        )
    if n_good == 0:
        return (
            f"every observation lost the answer ({n} lost): no coverage is shown to keep it, "
            "so no threshold is claimed"
        )
    if n_bad == 1:
        return (
            "only 1 observation lost the answer; at least 2 are needed (one sets the threshold, "
            "one checks it on the held-out half)"
        )
    return None


def evaluate(
    observations: Sequence[Observation],
    *,
    alpha: float,
    target_recall: float,
    min_observations: int,
    salt: str = SPLIT_SALT,
) -> Evaluation:
    """Compute a candidate τ on the calibration half and decide whether the held-out half supports it.
    The counts are of cases: a compaction labelled more than once is one (``one_case_per_compaction``).

    No τ is computed (tau None, not activated) when the data cannot support one: fewer than
    ``min_observations``; no case that lost the answer (τ would be 0, accepting coverages nobody ever
    observed); no case that kept it; or a single lost case (it cannot both set τ and test it).
    Otherwise τ = calibrate_threshold(calibration half) and the held-out cases with coverage ≥ τ are
    the accepted ones: the version activates only if at least MIN_HELD_OUT_ACCEPTED are accepted and
    the share of them that kept the answer is at least ``target_recall``. Nor does one whose τ is 1.0
    (a lost case it was computed from has full coverage, or all but): τ = 1 reverts every summary
    short of full coverage, and no τ in [0, 1] rejects a lost case at full coverage.
    """
    check_parameters(alpha, target_recall, min_observations)
    observations = one_case_per_compaction(observations)
    n = len(observations)
    n_bad = sum(not o.answer_kept for o in observations)
    refusal = _refusal(n, n_bad, min_observations)
    if refusal is not None:
        return Evaluation(tau=None, activate=False, reason=refusal, n=n, n_bad=n_bad)
    calibration, held_out = split_observations(observations, salt=salt)
    tau = calibrate_threshold([o.score() for o in calibration], target_recall, alpha)
    accepted = [o for o in held_out if o.coverage >= tau]
    kept = sum(o.answer_kept for o in accepted)
    counts = SplitCounts(
        n=n,
        n_bad=n_bad,
        calibration_n=len(calibration),
        calibration_n_bad=sum(not o.answer_kept for o in calibration),
        held_out_n=len(held_out),
        held_out_n_bad=sum(not o.answer_kept for o in held_out),
        held_out_accepted=len(accepted),
        held_out_rate=kept / len(accepted) if accepted else None,
    )
    if tau >= 1.0:  # (calibrate_threshold caps it there)
        at_full = any(not o.answer_kept and o.coverage >= 1.0 for o in calibration)
        why = (
            "a case that lost the answer has full coverage (1.0), and the rank puts τ on it: no τ in "
            "[0, 1] rejects it, and τ=1 would revert every summary short of full coverage while still "
            "accepting it"
            if at_full
            else "a case that lost the answer sits just below full coverage: τ=1 accepts full coverage only"
        )
        reason = (
            f"{why}, so the version is not activated (the coverage's query words miss what such answers need)"
        )
        return Evaluation(tau=tau, activate=False, reason=reason, **counts.counts())
    return _judge(tau, kept, counts, alpha=alpha, target_recall=target_recall)


def _judge(tau: float, kept: int, counts: SplitCounts, *, alpha: float, target_recall: float) -> Evaluation:
    """Activate τ only if the held-out cases it accepts kept the answer at the target rate."""
    note = ""
    needs = _conformal_rank_needs(alpha)
    if counts.calibration_n_bad < needs:
        note = (
            f" (only {counts.calibration_n_bad} lost-answer case(s) in the calibration half, fewer than the "
            f"{needs} the conformal rank at alpha={alpha:g} needs, so τ sits just above the highest one)"
        )
    rate = counts.held_out_rate
    if rate is None:
        reason = (
            f"no held-out case reaches τ={describe_tau(tau)} ({counts.held_out_n} held out), so the "
            f"answer-kept rate of accepted cases cannot be measured{note}"
        )
        return Evaluation(tau=tau, activate=False, reason=reason, **counts.counts())
    measured = (
        f"held-out answer-kept rate {rate:.4g} ({kept} of {counts.held_out_accepted} accepted at "
        f"τ={describe_tau(tau)})"
    )
    if counts.held_out_accepted < MIN_HELD_OUT_ACCEPTED:
        reason = (
            f"{measured}: too few accepted cases to measure the rate (at least {MIN_HELD_OUT_ACCEPTED} "
            f"are needed), so the version is not activated{note}"
        )
        return Evaluation(tau=tau, activate=False, reason=reason, **counts.counts())
    activate = rate + RATE_TOLERANCE >= target_recall
    verdict = "meets" if activate else "is below"
    reason = f"{measured} {verdict} the target {target_recall:g}{note}"
    return Evaluation(tau=tau, activate=activate, reason=reason, **counts.counts())


# ---------------------------------------------------------------------------
# The threshold gates use
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ActiveThreshold:
    """The τ gates use now; ``version`` None means no version is active and τ is COVERAGE_THRESHOLD."""

    tau: float
    version: int | None


FALLBACK = ActiveThreshold(COVERAGE_THRESHOLD, None)


def describe_succession(activate: bool, current: ActiveThreshold) -> str:
    """What a new version means for the active one, appended to the version's reason."""
    if activate:
        if current.version is None:
            return ""
        return f"; replaces version {current.version} (τ={describe_tau(current.tau)})"
    if current.version is not None:
        return f"; version {current.version} (τ={describe_tau(current.tau)}) stays active"
    return f"; no version is active, so gates keep the fallback τ={COVERAGE_THRESHOLD:g}"
