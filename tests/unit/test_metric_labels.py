"""Every label a dashboard panel or an alert rule matches on is one its metric has, with a value the
service can give it: a typo (status="faild", reason="budgets") left an alert that could never fire, and
the name checks (test_grafana_dashboard) passed, as they strip the matchers."""

from __future__ import annotations

import ast
import re

import pytest

import worker.jobs.celery_app  # noqa: F401  (registers every job kind)
from models import JOB_STATUSES, SEGMENT_OUTCOMES
from tests.unit.test_grafana_dashboard import (
    COUNTERS,
    HISTOGRAMS,
    REPO,
    _exprs,
    _rule_exprs,
    metric_names,
)
from worker.config_store import KILL_SWITCHES
from worker.jobs.registry import kind_names, pause_reasons

_SELECTOR = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)\{([^}]*)\}")
_MATCHER = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"\s*,?')


def declared_labels() -> dict[str, set[str]]:
    """Series name -> its label names, read from every metric declared under worker/ with literal
    labels (a counter's series end in _total, a histogram's _bucket takes "le" too)."""
    found: dict[str, set[str]] = {}
    for path in (REPO / "worker").rglob("*.py"):
        source = path.read_text()
        if "prometheus_client" not in source:
            continue
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, ast.Call) or not node.args or not isinstance(node.args[0], ast.Constant):
                continue
            kind = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
            labels: set[str] = set()
            for keyword in node.keywords:
                if keyword.arg in ("labels", "labelnames") and isinstance(
                    keyword.value, (ast.List, ast.Tuple)
                ):
                    labels = {e.value for e in keyword.value.elts if isinstance(e, ast.Constant)}
            if len(node.args) >= 3 and isinstance(node.args[2], (ast.List, ast.Tuple)):
                labels = {e.value for e in node.args[2].elts if isinstance(e, ast.Constant)}
            name = str(node.args[0].value)
            if kind in COUNTERS:
                found[name.removesuffix("_total") + "_total"] = labels
            elif kind in HISTOGRAMS:
                found[f"{name}_bucket"] = labels | {"le"}
                found[f"{name}_sum"] = found[f"{name}_count"] = labels
            elif kind:
                found[name] = labels
    return found


# The values a label can take, where the service's own sets say (others, such as a route, are open).
KNOWN_VALUES: dict[str, set[str]] = {
    "kind": set(kind_names()),
    "reason": set(pause_reasons()),
    "switch": set(KILL_SWITCHES),
    "direction": {"cached", "in", "out"},
    "step": {"embedding", "consolidation"},
}
STATUS_VALUES = {
    "factmill_jobs": set(JOB_STATUSES),
    "factmill_job_attempts": set(JOB_STATUSES),
    "factmill_job_worker_losses": set(JOB_STATUSES),
    "factmill_jobs_ended_total": {"succeeded", "failed", "cancelled"},
}
OUTCOME_VALUES = {"factmill_segments_total": set(SEGMENT_OUTCOMES)}


def known_values(series: str, label: str) -> set[str] | None:
    if label == "status":
        return STATUS_VALUES.get(series)
    if label == "outcome":
        return OUTCOME_VALUES.get(series)
    return KNOWN_VALUES.get(label)


def selectors(expr: str) -> list[tuple[str, list[tuple[str, str, str]]]]:
    found = []
    for series, body in _SELECTOR.findall(expr):
        matchers = _MATCHER.findall(body)
        assert not _MATCHER.sub("", body).strip(), f"unparsed matchers in {body!r}"
        found.append((series, matchers))
    return found


ALL_EXPRS = _exprs() + _rule_exprs()


def test_the_rules_and_the_dashboard_match_on_labels() -> None:
    """(Else the check below checks nothing.)"""
    assert sum(len(matchers) for _, e in ALL_EXPRS for _, matchers in selectors(e)) > 10


def test_the_selector_parser() -> None:
    assert selectors('max by (kind) (a{kind!="x", status=~"b|c"}) and b') == [
        ("a", [("kind", "!=", "x"), ("status", "=~", "b|c")])
    ]


@pytest.mark.parametrize(("name", "expr"), ALL_EXPRS, ids=[n for n, _ in ALL_EXPRS])
def test_every_matched_label_is_the_metric_s_and_every_value_one_it_can_take(name: str, expr: str) -> None:
    labels = declared_labels()
    for series, matchers in selectors(expr):
        assert series in labels, f"{name}: {series} has no declared labels"
        for label, op, value in matchers:
            assert label in labels[series], (
                f"{name}: {series} has no label {label!r} ({sorted(labels[series])})"
            )
            allowed = known_values(series, label)
            if allowed is None:
                continue
            words = value.split("|") if op in ("=~", "!~") else [value]
            for word in words:
                assert word in allowed, (
                    f"{name}: {series}{{{label}{op}{value!r}}}: {word!r} is not one of {sorted(allowed)}"
                )


_GROUPING = re.compile(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)")


@pytest.mark.parametrize(("name", "expr"), ALL_EXPRS, ids=[n for n, _ in ALL_EXPRS])
def test_every_label_grouped_or_joined_on_is_one_of_the_metrics_read(name: str, expr: str) -> None:
    """``max by (knd)`` summed every series into one, and ``{{ $labels.kind }}`` read empty."""
    labels = declared_labels()
    read = {series for series in metric_names(expr) if series in labels}
    # (instance and job: the labels Prometheus adds to every series it scrapes)
    available = {"instance", "job"}.union(*(labels[series] for series in read))
    for clause in _GROUPING.findall(expr):
        for label in (word.strip() for word in clause.split(",") if word.strip()):
            assert label in available, f"{name}: {label!r} is a label of none of {sorted(read)}"


def _rules() -> list[dict[str, object]]:
    import yaml

    rules = yaml.safe_load((REPO / "deploy" / "prometheus-rules.yaml").read_text())
    groups = rules.get("groups") or rules.get("spec", {}).get("groups", [])
    return [r for g in groups for r in g["rules"] if "alert" in r]


# An aggregation operator and the grouping written before its parentheses (``max by (kind) (...)``); the
# same grouping written after them (``max(...) by (kind)``) reads as none here: write it before.
_AGGREGATION = re.compile(
    r"\b(?:sum|min|max|avg|group|stddev|stdvar|count|count_values|bottomk|topk|quantile|limitk|limit_ratio)"
    r"\s*(?:(by|without)\s*\(([^)]*)\))?\s*\("
)


# The right operand of ``and`` / ``unless`` (``... unless on() max(switch) == 0``) only decides which of
# the left's series stay; their labels are the left's.
_FILTER_BEFORE = re.compile(r"\b(?:and|unless)\s*(?:(?:on|ignoring)\s*\([^)]*\)\s*)?$")


@pytest.mark.parametrize("rule", _rules(), ids=[str(r["alert"]) for r in _rules()])
def test_every_label_an_alert_s_text_names_survives_its_aggregation(rule: dict[str, object]) -> None:
    """Every aggregation the series pass through must keep the label (a ``by`` naming it, or a
    ``without`` that does not): only some ``by (...)`` naming it was asked, and a bare ``max(...)``
    or ``sum without (kind)`` let ``{{ $labels.kind }}`` read empty."""
    expr = str(rule["expr"])
    groupings = [
        (match[1] or "", {w.strip() for w in (match[2] or "").split(",")})
        for match in _AGGREGATION.finditer(expr)
        if not _FILTER_BEFORE.search(expr[: match.start()])  # a filter: the result keeps the left's labels
    ]
    for text in dict(rule.get("annotations") or {}).values():  # type: ignore[call-overload]
        for label in re.findall(r"\$labels\.([A-Za-z_][A-Za-z0-9_]*)", str(text)):
            for mode, clause in groupings:
                kept = label in clause if mode == "by" else mode == "without" and label not in clause
                assert kept, (
                    f"{rule['alert']}: $labels.{label} is not kept by an aggregation of the expression"
                )


def test_the_alerts_that_say_the_others_are_blind_fire_only_when_no_replica_sees() -> None:
    """The other alerts take max over the API's replicas, so one replica that reads (and builds) the
    figures keeps them seeing; with max these fired when one replica of two lost its connection."""
    exprs = {rule["alert"]: str(rule["expr"]) for rule in _rules()}
    assert exprs["FactmillMetricsUnbuilt"].startswith("min(factmill_metrics_unbuilt)")
    assert exprs["FactmillMetricsUnread"].startswith("min by (collector) (factmill_metrics_unread)")


def test_the_label_check_sees_a_typo() -> None:
    """The check itself: a misspelt value and a label the metric lacks are caught."""
    with pytest.raises(AssertionError, match="is not one of"):
        test_every_matched_label_is_the_metric_s_and_every_value_one_it_can_take(
            "typo", 'max(factmill_jobs_paused{reason="budgets"})'
        )
    with pytest.raises(AssertionError, match="has no label"):
        test_every_matched_label_is_the_metric_s_and_every_value_one_it_can_take(
            "typo", 'max(factmill_jobs_paused{queue="x"})'
        )
    with pytest.raises(AssertionError, match="is a label of none of"):
        test_every_label_grouped_or_joined_on_is_one_of_the_metrics_read(
            "typo", "max by (knd) (factmill_jobs)"
        )
    for dropping in (
        "max by (status) (factmill_jobs) > 0",
        'max(factmill_jobs_paused{reason="kill_switch"}) > 0',
        "sum(max by (kind) (factmill_jobs_paused)) > 0",
        "sum without (kind) (factmill_jobs_paused) > 0",
        "max by (kind) (x) > 0 or max(y) > 0",  # either side of `or` answers with its own labels
        "max(x) > 0 unless on() max by (kind) (y) == 0",
    ):
        with pytest.raises(AssertionError, match="is not kept"):
            test_every_label_an_alert_s_text_names_survives_its_aggregation(
                {"alert": "A", "expr": dropping, "annotations": {"summary": "{{ $labels.kind }}"}}
            )
    for keeping in (
        "max by (kind) (max_over_time(factmill_jobs_paused[15m])) > 0",
        "sum without (reason) (x) > 0",
        "max by (kind) (x) > 0 unless on() max(y) == 0",  # a filter: the left's labels stay
        "max by (kind) (x) > 0 and on() max(y) == 0",
    ):
        test_every_label_an_alert_s_text_names_survives_its_aggregation(
            {"alert": "A", "expr": keeping, "annotations": {"summary": "{{ $labels.kind }}"}}
        )
