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


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (functions, keywords, labels and durations removed)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # label values
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range and subquery selectors
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)  # label lists
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", expr):
        word = match.group()
        after = expr[match.end() :].lstrip()
        if word in PROMQL_WORDS or after.startswith("(") or expr[match.start() - 1 : match.start()].isdigit():
            continue  # a function or aggregation, a keyword, or part of a number like 1e3
        names.add(word)
    return names


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
