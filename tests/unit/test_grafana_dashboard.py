"""The Grafana dashboard (deploy/grafana) shows what operators need, and every PromQL query in it names
only metrics the service exports.

The exported names are read from the source: every prometheus_client metric or metric family declared
under worker/ with a literal name, expanded the way the exposition format writes them (a counter as
``<name>_total``, a histogram as ``_bucket``/``_sum``/``_count``), plus the ``process_`` series of
ProcessCollector.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = json.loads((REPO / "deploy" / "grafana" / "factmill-dashboard.json").read_text())
PANELS = DASHBOARD["panels"]

COUNTERS = {"Counter", "CounterMetricFamily"}
GAUGES = {"Gauge", "GaugeMetricFamily", "Info", "InfoMetricFamily"}
HISTOGRAMS = {"Histogram", "HistogramMetricFamily", "Summary", "SummaryMetricFamily"}
PROCESS = {
    "process_cpu_seconds_total",
    "process_open_fds",
    "process_max_fds",
    "process_virtual_memory_bytes",
    "process_resident_memory_bytes",
    "process_start_time_seconds",
}
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool"}
AGGREGATIONS = {
    "sum",
    "min",
    "max",
    "avg",
    "group",
    "stddev",
    "stdvar",
    "count",
    "count_values",
    "bottomk",
    "topk",
}
AGGREGATIONS |= {"quantile", "limitk", "limit_ratio"}
# Read from Postgres at scrape time but about the replica itself: whether *it* reaches the store.
PER_REPLICA = {
    "factmill_store_up",
    "factmill_broker_up",
    "factmill_metrics_unbuilt",
    "factmill_metrics_unread",
}


def _declared() -> dict[str, str]:
    """Metric name -> the prometheus_client class that declares it, over worker/."""
    found: dict[str, str] = {}
    for path in (REPO / "worker").rglob("*.py"):
        source = path.read_text()
        if "prometheus_client" not in source:
            continue
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
            first = node.args[0]
            if name in COUNTERS | GAUGES | HISTOGRAMS and isinstance(first, ast.Constant):
                found[str(first.value)] = name
    return found


def _expand(name: str, kind: str) -> set[str]:
    if kind in COUNTERS:
        base = name.removesuffix("_total")
        return {f"{base}_total", f"{base}_created"}
    if kind in HISTOGRAMS:
        return {f"{name}_bucket", f"{name}_sum", f"{name}_count", f"{name}_created"}
    return {name}


def store_series() -> set[str]:
    """The series every API replica reports alike: the metric families the scrape reads from Postgres
    (prometheus_client's Counter and Histogram count this process's requests instead)."""
    series: set[str] = set()
    for name, kind in _declared().items():
        if kind.endswith("MetricFamily") and name not in PER_REPLICA:
            series |= _expand(name, kind.removesuffix("MetricFamily"))
    return series


def exported_series() -> set[str]:
    series = set(PROCESS)
    for name, kind in _declared().items():
        if kind in COUNTERS:
            base = name.removesuffix("_total")
            series |= {f"{base}_total", f"{base}_created"}
        elif kind in HISTOGRAMS:
            series |= {f"{name}_bucket", f"{name}_sum", f"{name}_count", f"{name}_created"}
        else:
            series.add(name)
    return series


def _stripped(expr: str) -> str:
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # label values
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range and subquery selectors
    return re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)  # label lists


def metric_reads(expr: str) -> list[tuple[str, str | None]]:
    """Each metric a PromQL expression reads, with the aggregation nearest around it (None: none)."""
    tokens = re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*|[()]|\d[\w.]*|[^\s\w()]+", _stripped(expr))
    reads: list[tuple[str, str | None]] = []
    opened: list[str | None] = []  # per open parenthesis: the aggregation it belongs to, if any
    for i, token in enumerate(tokens):
        if token == ")":
            opened.pop()
        elif token == "(":
            before = tokens[i - 1] if i else ""
            opened.append(before if before in AGGREGATIONS else None)
        elif token[0].isdigit() or not re.fullmatch(r"[A-Za-z_:][A-Za-z0-9_:]*", token):
            continue  # a number (1e3, 0.99) or an operator
        elif token not in PROMQL_WORDS and tokens[i + 1 : i + 2] != ["("]:  # not a function or aggregation
            reads.append((token, next((a for a in reversed(opened) if a is not None), None)))
    return reads


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (functions, keywords, labels and durations removed)."""
    return {name for name, _ in metric_reads(expr)}


def _exprs() -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in PANELS for t in p.get("targets", [])]


def test_the_metric_name_parser():
    assert metric_names('histogram_quantile(0.99, sum by (le, route) (rate(a_bucket{x="y"}[5m])))') == {
        "a_bucket"
    }
    assert metric_names('sum(increase(b_total{o="s"}[1h])) / sum by (p) (c)') == {"b_total", "c"}
    assert metric_names("max by (switch) (d) > 0 and on (k) e") == {"d", "e"}


def test_exported_series_are_read_from_the_source():
    series = exported_series()
    assert {
        "factmill_jobs",
        "factmill_segments_total",
        "factmill_http_request_duration_seconds_bucket",
    } <= series
    assert "factmill_segments" not in series  # a counter is exposed with _total


@pytest.mark.parametrize(("title", "expr"), _exprs(), ids=[t for t, _ in _exprs()])
def test_every_query_names_an_exported_metric(title, expr):
    names = metric_names(expr)
    assert names, f"{title}: no metric in {expr!r}"
    unknown = names - exported_series()
    assert not unknown, f"{title}: {sorted(unknown)} not exported by the service"


def test_the_dashboard_has_the_panels_operators_need():
    exprs = " ".join(e for _, e in _exprs())
    titles = " ".join(p["title"].lower() for p in PANELS)
    for word in ("queue depth", "jobs by status", "segments per second", "llm calls", "llm errors", "spend"):
        assert word in titles
    for word in ("cached share", "skipped segments", "kill switch", "api latency"):
        assert word in titles
    assert 'direction="cached"' in exprs and "factmill_kill_switch_enabled" in exprs
    assert all("by (purpose" in e for t, e in _exprs() if t.startswith("LLM"))
    # Queue depth is the jobs due (what KEDA and the backlog alert read): all queued ones, which include
    # jobs waiting out a backoff or a provider outage, showed a whole outage's backlog as work to scale for.
    depth = next(p for p in PANELS if p["title"].lower().startswith("queue depth"))
    assert "factmill_jobs_due" in depth["targets"][0]["expr"] and "KEDA reads it" not in depth["description"]


def test_the_dashboard_is_importable():
    assert DASHBOARD["uid"] and DASHBOARD["title"]
    assert [i["name"] for i in DASHBOARD["__inputs"]] == ["DS_PROMETHEUS"]
    ids = [p["id"] for p in PANELS]
    assert len(ids) == len(set(ids))
    for p in PANELS:
        assert p["datasource"]["uid"] == "${DS_PROMETHEUS}"
        assert {"h", "w", "x", "y"} <= set(p["gridPos"])
        assert all(t["refId"] for t in p["targets"])


def _rule_exprs() -> list[tuple[str, str]]:
    import yaml

    rules = yaml.safe_load((REPO / "deploy" / "prometheus-rules.yaml").read_text())
    groups = rules.get("groups") or rules.get("spec", {}).get("groups", [])
    return [(r.get("alert") or r.get("record"), r["expr"]) for g in groups for r in g["rules"]]


@pytest.mark.parametrize(("name", "expr"), _rule_exprs(), ids=[n for n, _ in _rule_exprs()])
def test_every_alert_rule_names_an_exported_metric(name, expr):
    unknown = metric_names(expr) - exported_series()
    assert not unknown, f"{name}: {sorted(unknown)} not exported by the service"


def test_the_aggregation_reader():
    assert metric_reads('sum by (status) (max by (status, kind) (a{x="y"}))') == [("a", "max")]
    assert metric_reads("histogram_quantile(0.99, sum by (le) (rate(b_bucket[5m]))) > 1e3") == [
        ("b_bucket", "sum")
    ]
    assert metric_reads("max(c) / d > 0 and on (k) max by (k) (deriv(e[15m]))") == [
        ("c", "max"),
        ("d", None),
        ("e", "max"),
    ]
    assert metric_reads("sum(rate(f[5m])) by (p)") == [("f", "sum")]


def test_store_series_are_the_families_read_from_postgres():
    store = store_series()
    assert {"factmill_jobs", "factmill_llm_calls_total", "factmill_segments_skipped"} <= store
    assert "factmill_store_up" not in store  # whether this replica reaches Postgres
    assert "factmill_http_request_duration_seconds_bucket" not in store  # this process's requests


@pytest.mark.parametrize(
    ("name", "expr"), _exprs() + _rule_exprs(), ids=[n for n, _ in _exprs() + _rule_exprs()]
)
def test_figures_every_replica_reports_alike_are_not_added_up(name, expr):
    # Each API replica reads the same totals from Postgres: with the two replicas of deploy/k8s a sum
    # over them showed twice the jobs, segments and spend, and an alert without max fired once a replica.
    for metric, aggregation in metric_reads(expr):
        if metric in store_series():
            assert aggregation in {"max", "min"}, f"{name}: {metric} is read under {aggregation!r}, not max"


def test_an_alert_fires_when_no_metrics_arrive():
    """Every other rule reads series that vanish when no API is scraped (down, or a scrape key without
    the metrics scope): without this one, silence."""
    assert ("FactmillMetricsAbsent", "absent(factmill_store_up)") in _rule_exprs()
