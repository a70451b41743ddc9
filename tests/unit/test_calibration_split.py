"""Calibration's pure parts: the stratified split, the activation rule, observation checks, CSV rows."""

from __future__ import annotations

import itertools
import math
import random
import sys
from typing import Any

import numpy as np
import pytest
from hypothesis import Phase, find, given, settings
from hypothesis import strategies as st

from worker.calibration import (
    Observation,
    ObservationIn,
    describe_tau,
    evaluate,
    one_case_per_compaction,
    parse_observations_csv,
    split_observations,
)
from worker.core.quality import calibrate_threshold, conformal_rank


def observations(kept: list[float], lost: list[float], start: int = 1) -> list[Observation]:
    values = [(c, True) for c in kept] + [(c, False) for c in lost]
    return [Observation(start + i, c, k) for i, (c, k) in enumerate(values)]


def separated(kept: int = 30, lost: int = 30) -> list[Observation]:
    """Kept cases at 0.6 to 1.0, lost ones at 0.0 to 0.45 with the top third pinned at 0.5."""
    good = [0.6 + 0.4 * i / max(1, kept - 1) for i in range(kept)]
    pinned = lost // 3
    bad = [0.45 * i / max(1, lost - pinned - 1) for i in range(lost - pinned)] + [0.5] * pinned
    return observations(good, bad)


# ---------------------------------------------------------------------------
# split_observations
# ---------------------------------------------------------------------------


def test_split_is_stratified_by_label() -> None:
    data = observations([0.9] * 11, [0.1] * 7)
    calibration, held_out = split_observations(data)
    assert sum(o.answer_kept for o in calibration) == 6 and sum(o.answer_kept for o in held_out) == 5
    assert sum(not o.answer_kept for o in calibration) == 4 and sum(not o.answer_kept for o in held_out) == 3


def test_split_halves_partition_the_input_and_come_back_sorted_by_id() -> None:
    data = separated()
    calibration, held_out = split_observations(data)
    assert sorted(calibration + held_out, key=lambda o: o.id) == data
    assert not {o.id for o in calibration} & {o.id for o in held_out}
    assert calibration == sorted(calibration, key=lambda o: o.id)
    assert held_out == sorted(held_out, key=lambda o: o.id)


def test_split_is_deterministic_whatever_the_input_order() -> None:
    data = separated()
    shuffled = data[:]
    random.Random(7).shuffle(shuffled)
    assert split_observations(shuffled) == split_observations(data)
    assert split_observations(data) == split_observations(data)


def test_split_does_not_follow_arrival_order() -> None:
    data = observations([0.9] * 40, [])
    calibration, _ = split_observations(data)
    assert [o.id for o in calibration] != [o.id for o in data[0::2]]


def test_split_salt_changes_the_split() -> None:
    data = separated()
    assert split_observations(data, salt="a") != split_observations(data, salt="b")


def test_split_of_nothing_is_two_empty_halves() -> None:
    assert split_observations([]) == ([], [])


def test_split_refuses_repeated_ids() -> None:
    with pytest.raises(ValueError, match="unique"):
        split_observations([Observation(1, 0.5, True), Observation(1, 0.2, False)])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 1), st.booleans()), max_size=60))
def test_split_properties(cases: list[tuple[float, bool]]) -> None:
    data = [Observation(i + 1, c, k) for i, (c, k) in enumerate(cases)]
    calibration, held_out = split_observations(data)
    for label in (True, False):
        total = sum(o.answer_kept is label for o in data)
        assert sum(o.answer_kept is label for o in calibration) == math.ceil(total / 2)
        assert sum(o.answer_kept is label for o in held_out) == total // 2


# ---------------------------------------------------------------------------
# evaluate: the activation rule
# ---------------------------------------------------------------------------

PARAMS: dict[str, Any] = {"alpha": 0.1, "target_recall": 0.9, "min_observations": 20}


def test_separated_data_activates_with_tau_in_the_gap() -> None:
    result = evaluate(separated(), **PARAMS)
    assert result.activate, result.reason
    assert result.tau is not None and 0.5 < result.tau < 0.6
    assert result.held_out_rate == 1.0
    assert (result.n, result.n_bad) == (60, 30)
    assert (result.calibration_n, result.calibration_n_bad, result.held_out_n, result.held_out_n_bad) == (
        30,
        15,
        30,
        15,
    )
    assert result.held_out_accepted == 15
    assert "meets the target 0.9" in result.reason


def test_the_tau_is_the_one_calibrate_threshold_gives_on_the_calibration_half() -> None:
    data = separated()
    calibration, _ = split_observations(data)
    expected = calibrate_threshold([o.score() for o in calibration], 0.9, 0.1)
    assert evaluate(data, **PARAMS).tau == expected


def test_coverage_that_does_not_separate_is_refused() -> None:
    # Every lost case scored full coverage: no τ in [0, 1] can reject it, whatever the split.
    data = observations([0.7 + 0.01 * i for i in range(20)], [1.0] * 20)
    result = evaluate(data, **PARAMS)
    assert not result.activate
    assert result.tau == 1.0
    assert result.held_out_rate == 0.0 and result.held_out_accepted == 10
    assert "full coverage (1.0)" in result.reason


def test_no_accepted_held_out_case_is_refused_as_unmeasurable() -> None:
    data = observations([0.9] * 20, [0.9] * 20)  # τ lands just above 0.9: nothing is accepted
    result = evaluate(data, **PARAMS)
    assert not result.activate and result.held_out_rate is None and result.held_out_accepted == 0
    assert "cannot be measured" in result.reason


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        ([], "no observations yet"),
        (observations([0.9] * 10, [0.1] * 9), "too few observations: 19 (10 kept, 9 lost); at least 20"),
        (observations([0.9] * 30, []), "no observation lost the answer (all 30 kept)"),
        (observations([], [0.2] * 30), "every observation lost the answer (30 lost)"),
        (observations([0.9] * 29, [0.2]), "only 1 observation lost the answer"),
    ],
)
def test_data_that_cannot_support_a_threshold_gets_none(data: list[Observation], reason: str) -> None:
    result = evaluate(data, **PARAMS)
    assert result.tau is None and not result.activate
    assert reason in result.reason
    assert result.held_out_rate is None


def test_few_lost_cases_note_the_clamped_conformal_rank() -> None:
    data = observations([0.6 + 0.01 * i for i in range(30)], [0.1, 0.2, 0.3, 0.4])
    result = evaluate(data, **PARAMS)
    assert "fewer than the 9 the conformal rank at alpha=0.1 needs" in result.reason


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"alpha": 0.0}, "alpha must be strictly between 0 and 1"),
        ({"alpha": math.nan}, "alpha must be strictly between 0 and 1"),
        ({"target_recall": 1.0}, "target_recall must be strictly between 0 and 1"),
        ({"min_observations": 3}, "min_observations must be an integer of at least 4"),
    ],
)
def test_bad_parameters_raise(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        evaluate(separated(), **(PARAMS | kwargs))


@st.composite
def mostly_separable(draw: st.DrawFn) -> list[tuple[float, bool]]:
    """Coverages whose answer was kept above a cut and lost below it, a few flipped: data a threshold
    can serve (independent coins almost never activate, and the activation branch went untested)."""
    cut = draw(st.floats(0.2, 0.8))
    coverages = draw(st.lists(st.floats(0, 1), min_size=20, max_size=80))
    flips = draw(st.lists(st.integers(0, 24), min_size=len(coverages), max_size=len(coverages)))
    return [(c, (c >= cut) != (flip == 0)) for c, flip in zip(coverages, flips, strict=True)]


CALIBRATION_CASES = st.one_of(
    st.lists(st.tuples(st.floats(0, 1), st.booleans()), min_size=20, max_size=80), mostly_separable()
)


def as_observations(cases: list[tuple[float, bool]]) -> list[Observation]:
    return [Observation(i + 1, c, k) for i, (c, k) in enumerate(cases)]


def test_the_calibration_cases_reach_activation() -> None:
    """The property below checks activation only where it happens: its cases must reach it."""
    found = find(
        mostly_separable(),
        lambda cases: evaluate(as_observations(cases), **PARAMS).activate,
        settings=settings(phases=[Phase.generate], database=None),  # any example: shrinking took 30 s
    )
    assert evaluate(as_observations(found), **PARAMS).activate


@settings(max_examples=200, deadline=None)
@given(CALIBRATION_CASES)
def test_activation_means_the_held_out_rate_met_the_target(cases: list[tuple[float, bool]]) -> None:
    data = as_observations(cases)
    result = evaluate(data, **PARAMS)
    if result.activate:
        assert result.tau is not None and result.held_out_rate is not None
        assert result.held_out_rate + 1e-9 >= 0.9 and result.held_out_accepted > 0
        _, held_out = split_observations(data)
        accepted = [o for o in held_out if o.coverage >= result.tau]
        assert len(accepted) == result.held_out_accepted
        assert sum(o.answer_kept for o in accepted) / len(accepted) == result.held_out_rate
    if result.tau is None:
        assert not result.activate


# ---------------------------------------------------------------------------
# ObservationIn
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"coverage": math.nan}, "coverage must be a number from 0 to 1"),
        ({"coverage": 1.5}, "coverage must be a number from 0 to 1"),
        ({"coverage": -0.1}, "coverage must be a number from 0 to 1"),
        ({"coverage": math.inf}, "coverage must be a number from 0 to 1"),
        ({"coverage": True}, "coverage must be a number from 0 to 1"),
        ({"coverage": "0.5"}, "coverage must be a number from 0 to 1"),
        ({"answer_kept": 1}, "answer_kept must be true or false"),
        ({"origin": "  "}, "origin must be 1 to 200 printable characters"),
        ({"origin": "x" * 201}, "origin must be 1 to 200 printable characters"),
        ({"compaction_id": 0}, "compaction_id must be a positive integer"),
        ({"compaction_id": True}, "compaction_id must be a positive integer"),
        ({"idempotency_key": "a\nb"}, "idempotency_key must be 1 to 255 printable characters"),
    ],
)
def test_invalid_observations_raise_a_clear_value_error(kwargs: dict[str, object], message: str) -> None:
    values: dict[str, object] = {"coverage": 0.5, "answer_kept": True, "origin": "test"} | kwargs
    with pytest.raises(ValueError, match=message):
        ObservationIn(**values)  # type: ignore[arg-type]


def test_dedupe_keys() -> None:
    assert ObservationIn(0.5, True, "a").dedupe_key() is None
    keyed = ObservationIn(0.5, True, "a", idempotency_key=" k1 ").dedupe_key()
    assert keyed == ObservationIn(0.5, True, "b", idempotency_key="k1").dedupe_key()  # the key alone
    assert keyed is not None and keyed.startswith("key:") and "k1" not in keyed  # a digest
    assert keyed != ObservationIn(0.5, True, "a", idempotency_key="k1", sender="key:7").dedupe_key()
    judged = ObservationIn(0.5, True, "a", compaction_id=7).dedupe_key()
    assert judged is not None and judged.startswith("compaction:")
    assert judged == ObservationIn(0.5, True, " a ", compaction_id=7).dedupe_key()
    assert judged != ObservationIn(0.5, False, "a", compaction_id=7).dedupe_key()
    assert judged != ObservationIn(0.5, True, "b", compaction_id=7).dedupe_key()


def test_integer_coverage_is_a_float() -> None:
    observation = ObservationIn(1, False, "a")
    assert observation.coverage == 1.0 and isinstance(observation.coverage, float)


# ---------------------------------------------------------------------------
# CSV rows
# ---------------------------------------------------------------------------


def parse(content: str) -> tuple[list[tuple[int, ObservationIn]], list[tuple[int, str]], int]:
    parsed = parse_observations_csv(content, default_origin="csv:test.csv", file_digest="d1")
    return parsed.good, parsed.errors, parsed.rows


def test_lines_skipped_as_comments_are_listed() -> None:
    """A data row whose first value starts with # (an origin "#nightly", a key "#1") is a comment line:
    the import said "0 row(s) ... 0 error(s)" and exited 0, with every such row silently gone."""
    parsed = parse_observations_csv(
        "origin,coverage,answer_kept\n# exported 2026-12-01\n#nightly,0.4,false\nnightly,0.5,true\n",
        default_origin="csv:test.csv",
        file_digest="d1",
    )
    assert (parsed.rows, parsed.comments, [line for line, _ in parsed.good]) == (1, [2, 3], [4])


def test_csv_positional_rows_with_blank_and_comment_lines() -> None:
    good, errors, rows = parse("0.8,true,eval\n\n# a comment\n0.2,lost,,42\n0.4,kept\n")
    assert errors == [] and rows == 3
    assert [(line, o.coverage, o.answer_kept, o.origin, o.compaction_id) for line, o in good] == [
        (1, 0.8, True, "eval", None),
        (4, 0.2, False, "csv:test.csv", 42),
        (5, 0.4, True, "csv:test.csv", None),
    ]
    assert good[0][1].idempotency_key == "csv:d1:1"
    assert good[1][1].idempotency_key is None  # a judged compaction is identified by itself


def test_csv_header_maps_columns_by_name() -> None:
    good, errors, _ = parse("answer_kept,coverage,idempotency_key\nyes,0.7,k-1\nno,0.3,\n")
    assert errors == []
    assert [(line, o.coverage, o.answer_kept, o.idempotency_key) for line, o in good] == [
        (2, 0.7, True, "k-1"),
        (3, 0.3, False, "csv:d1:3"),
    ]


def test_csv_bad_rows_are_reported_by_line_and_good_rows_kept() -> None:
    content = "\n".join(
        [
            "coverage,answer_kept,origin,compaction_id",  # 1
            "0.9,true,a",  # 2
            "nan,true,a",  # 3
            "1.5,false,a",  # 4
            "abc,true,a",  # 5
            "0.5,maybe,a",  # 6
            "0.5,true,a,x",  # 7
            "0.5,true,a,1,extra",  # 8
            '0.1,false,"multi',  # 9
            'line origin"',  # 10
            "0.3",  # 11 (one column: answer_kept is missing)
        ]
    )
    good, errors, rows = parse(content)
    assert rows == 9  # the quoted record on lines 9-10 is one row, reported at its first line
    assert [(line, o.coverage) for line, o in good] == [(2, 0.9)]
    messages = dict(errors)
    assert sorted(messages) == [3, 4, 5, 6, 7, 8, 9, 11]
    assert "lines 9 to 10 were read as one row" in messages[9]  # no value here may hold a line end
    assert "coverage must be a number from 0 to 1" in messages[3] and "nan" in messages[3]
    assert "got 1.5" in messages[4]
    assert messages[5] == "coverage 'abc' is not a number"
    assert "answer_kept 'maybe' is not one of" in messages[6]
    assert "compaction_id 'x' is not a positive integer" in messages[7]
    assert "at most 4 columns" in messages[8]
    assert "answer_kept '' is not one of" in messages[11]


def test_csv_without_header_checks_the_column_count() -> None:
    _, errors, _ = parse("0.5,true,a,1,2\n")
    assert errors == [(1, "expected 2 to 4 columns (coverage,answer_kept,origin[,compaction_id]), got 5")]


def test_csv_unknown_header_column_is_a_file_error() -> None:
    with pytest.raises(ValueError, match="line 1: unknown column"):
        parse("coverage,answer_kept,colour\n0.5,true,red\n")
    with pytest.raises(ValueError, match="no answer_kept column"):
        parse("coverage,origin\n0.5,a\n")


def test_describe_tau_marks_the_epsilon_bump() -> None:
    assert describe_tau(0.5 + sys.float_info.epsilon) == "0.5+ε"
    assert describe_tau(0.5) == "0.5"
    assert describe_tau(0.0) == "0"
    assert describe_tau(1.0) == "1"
    assert describe_tau(0.123456) == "0.1235"
    # Rounded to 4 places these read "1" (a τ of 1 is never activated) and lost their mark.
    eps = sys.float_info.epsilon
    assert describe_tau(0.99996 + eps) == "0.99996+ε"
    assert describe_tau(1e-05 + eps) == "1e-05+ε"
    assert describe_tau(0.999996) == "0.999996"
    assert describe_tau(0.6153846153846154 + eps) == "0.6154"  # no round value under it: 4 digits
    assert describe_tau(0.30000000000000004) == "0.3+ε"  # a few steps above: marked still
    assert describe_tau(0.7999999999999999 + eps) == "0.8+ε"


def histogram_bin(value: float, edges: list[float]) -> int:
    """The bin matplotlib's hist puts ``value`` in: numpy.histogram's (every bin closed on the left,
    the last one on both sides)."""
    counts, _ = np.histogram([value], bins=edges)
    (index,) = np.flatnonzero(counts)
    return int(index)


def test_histogram_bin_follows_the_numpy_convention() -> None:
    edges = [0.0, 0.25, 0.5, 1.0]
    assert [histogram_bin(v, edges) for v in (0.0, 0.2499, 0.25, 0.5, 0.99, 1.0)] == [0, 0, 1, 2, 2, 2]


@pytest.mark.parametrize("tau", [0.0, 0.5 + sys.float_info.epsilon, 0.4237, 0.999, 1.0])
def test_plot_bins_put_tau_on_an_edge(tau: float) -> None:
    from worker.cli.calibration import plot_bins

    edges = plot_bins(tau)
    assert edges[0] == 0.0 and edges[-1] == 1.0
    assert all(a < b for a, b in itertools.pairwise(edges))
    assert tau in edges
    if 0 < tau < 1:
        # A case just below τ is drawn left of the τ line, a case at τ right of it.
        index = edges.index(tau)
        assert histogram_bin(tau - 1e-12 if tau > 0.01 else 0.0, edges) == index - 1
        assert histogram_bin(tau, edges) == index


def _rank_needs_by_counting(alpha: float) -> int:
    n = 1
    while conformal_rank(n, alpha) > n:
        n += 1
    return n


@pytest.mark.parametrize("alpha", [0.5, 1 / 3, 0.2, 0.1, 0.05, 0.01, 0.003, 0.001, 1e-4, 0.999, 0.7])
def test_the_conformal_rank_is_found_from_its_closed_form_as_counting_found_it(alpha: float) -> None:
    from worker.core.calibration import _conformal_rank_needs

    assert _conformal_rank_needs(alpha) == _rank_needs_by_counting(alpha)


def test_an_alpha_whose_rank_needs_millions_of_lost_cases_is_refused() -> None:
    """Counting up to the rank took 1/alpha steps (twelve seconds at 1e-8), and below about 1.1e-16
    never ended, inside the recompute's lock."""
    from worker.core.calibration import _conformal_rank_needs, check_parameters

    assert _conformal_rank_needs(1e-6) == 999_999
    for alpha in (1e-7, 1e-17):
        with pytest.raises(ValueError, match="alpha must be at least 1e-06"):
            check_parameters(alpha, 0.9, 20)
    with pytest.raises(ValueError, match="min_observations must be at most 2,147,483,647"):
        check_parameters(0.1, 0.9, 2**31)


def test_a_csv_compaction_id_of_thousands_of_digits_is_a_line_error() -> None:
    """int() refuses 4,300 digits and more with its own ValueError: a traceback from the import."""
    good, errors, _ = parse("coverage,answer_kept,origin,compaction_id\n0.5,true,x," + "9" * 5000 + "\n")
    assert good == [] and len(errors) == 1 and "at most 19 digits" in errors[0][1]


def test_a_version_never_activates_on_a_rate_of_a_handful_of_held_out_cases() -> None:
    """Forty observations near min_observations: a τ just above the highest lost coverage often accepts
    one or two held-out cases, and "1 of 1 kept" met any target (a simulation activated over half its
    versions so). Now a rate over fewer than MIN_HELD_OUT_ACCEPTED cases activates nothing."""
    from worker.core.calibration import MIN_HELD_OUT_ACCEPTED, Observation, evaluate

    rng = random.Random(7)
    refused_small = 0
    for trial in range(400):
        observations = []
        for i in range(40):
            kept = rng.random() < 0.7
            coverage = rng.betavariate(5, 2) if kept else rng.betavariate(2, 3)
            observations.append(Observation(trial * 100 + i, coverage, kept))
        verdict = evaluate(observations, alpha=0.1, target_recall=0.9, min_observations=20)
        if verdict.activate:
            assert verdict.held_out_accepted >= MIN_HELD_OUT_ACCEPTED, verdict
        elif verdict.held_out_rate is not None and verdict.held_out_accepted < MIN_HELD_OUT_ACCEPTED:
            assert "too few accepted cases" in verdict.reason
            refused_small += verdict.held_out_rate >= 0.9  # what activated before
    assert refused_small > 0


def test_a_lost_case_at_full_coverage_never_activates_a_tau_of_one() -> None:
    """τ = min(1.0 + ε, 1.0) = 1.0 accepts the lost case at 1.0 and reverts every good summary below it;
    the held-out check looked only at cases at exactly 1.0, mostly kept, and activated it."""
    kept = [0.6 + 0.01 * i for i in range(30)] + [1.0] * 30
    lost = [0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 1.0]
    at_one = [
        evaluate(observations(kept, lost), alpha=0.1, target_recall=0.9, min_observations=20, salt=f"s{i}")
        for i in range(40)
    ]
    at_one = [verdict for verdict in at_one if verdict.tau == 1.0]
    assert at_one  # the split put the lost case at 1.0 in the calibration half
    for verdict in at_one:
        assert not verdict.activate and "full coverage (1.0)" in verdict.reason
    # Just below full coverage, τ is capped at 1.0 as well: it would accept full coverage only.
    below = [0.9999999999999998] * 20
    verdict = evaluate(observations([1.0] * 40, below), alpha=0.1, target_recall=0.9, min_observations=20)
    assert verdict.tau == 1.0 and not verdict.activate and "just below full coverage" in verdict.reason


def test_an_observations_csv_past_the_row_cap_is_refused_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """The byte cap was to mean about two million rows; rows of "0,1" fit 16.7 million into it, parsed
    whole (gigabytes) into one transaction holding the observations' lock."""
    from worker.core import calibration_csv

    monkeypatch.setattr(calibration_csv, "MAX_CSV_ROWS", 4)
    ok = calibration_csv.parse_observations_csv(
        "0.5,1\n0.2,0\n# note\n\n0.9,1\n", default_origin="csv", file_digest="d"
    )
    assert ok.rows == 3 and not ok.errors and ok.comments == [3]
    past = "more than 4 rows \\(comment lines included\\); import it in parts"
    with pytest.raises(calibration_csv.CsvFormatError, match=past):
        calibration_csv.parse_observations_csv("0.5,1\n" * 5, default_origin="csv", file_digest="d")
    # Comment lines were listed without a cap: a 64 MiB file of "#" lines held 33 million numbers.
    with pytest.raises(calibration_csv.CsvFormatError, match=past):
        calibration_csv.parse_observations_csv("#\n" * 5, default_origin="csv", file_digest="d")


def test_a_stray_quote_names_every_line_it_swallowed() -> None:
    """Lines 2 to 4 were read as one record and only line 2 was named: 'rows' said 3 for 5 data rows,
    and once line 2 was mended a re-import stored the others a second time."""
    content = '0.9,1\n0.4,false,"b\n0.5,1\n0.6,1,"c\n0.7,1\n'
    parsed = parse_observations_csv(content, default_origin="csv", file_digest="d")
    assert [line for line, _ in parsed.good] == [1, 5]
    [(line, message)] = parsed.errors
    assert line == 2 and "lines 2 to 4 were read as one row" in message
    # Opened in a comment or past the field limit, it named nothing, or only its first line.
    commented = 'coverage,answer_kept,origin\n#note,"oops\n0.5,true,a\n0.7,true,"c"\n0.8,true,d\n'
    parsed = parse_observations_csv(commented, default_origin="csv", file_digest="d")
    assert [line for line, _ in parsed.good] == [5] and "lines 2 to 4 were read" in parsed.errors[0][1]
    overlong = '0.5,1,"oops\n' + "0.5,1,a\n" * 20_000
    parsed = parse_observations_csv(overlong, default_origin="csv", file_digest="d")
    assert any("lines 1 to " in message and "gave up" in message for _, message in parsed.errors)
    # A comment carried across lines is still a comment: the header after it is read as one.
    before_header = '#c,"x\ny"\ncoverage,answer_kept,compaction_id\n0.5,1,7\n'
    parsed = parse_observations_csv(before_header, default_origin="csv", file_digest="d")
    [(line, observation)] = parsed.good
    assert (line, observation.compaction_id, observation.origin) == (4, 7, "csv")


def test_a_files_digest_is_its_bytes_in_the_usual_form_and_its_text_otherwise() -> None:
    """Rows without a key are known by the file's digest and their line. It was the bytes' digest: a
    file imported before keeps its digest (else every row was stored again), and a spreadsheet's re-save
    (a byte-order mark, CRLF, no last newline) has the same one."""
    import hashlib

    from worker.core.calibration_csv import content_digest, decode_csv

    usual = b"coverage,answer_kept\n0.5,1\n0.2,0\n"
    assert content_digest(decode_csv(usual, "f")) == hashlib.sha256(usual).hexdigest()[:16]
    resaved = b"\xef\xbb\xbfcoverage,answer_kept\r\n0.5,1\r\n0.2,0"
    assert content_digest(decode_csv(resaved, "f")) == content_digest(decode_csv(usual, "f"))


def test_the_labels_of_one_compaction_are_one_case() -> None:
    """Five compactions (three kept at 0.80-0.82, two lost at 0.30/0.35) labelled four times each were 20
    observations: the version activated on "6 of 6 accepted", three compactions, some of them the very
    cases that set τ. As five cases they are too few."""
    values = [(0.80, True), (0.81, True), (0.82, True), (0.30, False), (0.35, False)]
    labels = [
        Observation(1 + round_ * 5 + c, coverage, kept, compaction_id=100 + c)
        for round_ in range(4)
        for c, (coverage, kept) in enumerate(values)
    ]
    result = evaluate(labels, alpha=0.1, target_recall=0.9, min_observations=20)
    assert (result.activate, result.n, result.n_bad) == (False, 5, 2), result.reason
    assert "too few observations: 5" in result.reason


def test_a_compaction_any_label_says_lost_is_a_lost_case_at_its_newest_coverage() -> None:
    same = [
        Observation(4, 0.7, True, compaction_id=9),
        Observation(2, 0.6, True, compaction_id=9),
        Observation(7, 0.65, False, compaction_id=9),
        Observation(3, 0.2, False),
        Observation(5, 0.2, False),  # (labels of no compaction: a case each)
        Observation(6, 0.9, True, compaction_id=11),
    ]
    assert sorted(one_case_per_compaction(same), key=lambda o: o.id) == [
        Observation(2, 0.65, False, compaction_id=9),
        Observation(3, 0.2, False),
        Observation(5, 0.2, False),
        Observation(6, 0.9, True, compaction_id=11),
    ]
