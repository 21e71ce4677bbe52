"""deploy/grafana/mesh-dashboard.json: an importable dashboard whose every query names
series the mesh's processes expose."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from metrics_support import process_expositions, series_names

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "mesh-dashboard.json"
SERIES = re.compile(r"\bmesh_[a-z0-9_]+\b")
# What an operator opens it for, each by a series it must chart.
MUST_CHART = {
    "tokens per second": "mesh_completion_tokens_total",
    "time to first token": "mesh_time_to_first_token_seconds_bucket",
    "requests by status": "mesh_http_requests_total",
    "per-stage step time": "mesh_stage_compute_seconds_sum",
    "per-stage queue time": "mesh_stage_queue_seconds_sum",
    "batch sizes": "mesh_step_segments_sum",
    "KV bytes": "mesh_stage_kv_bytes",
    "link bytes": "mesh_link_bytes_sent_total",
    "speculation acceptance": "mesh_speculation_accepted_tokens_total",
    "terms": "mesh_coordinator_term",
    "reloads": "mesh_stage_loads_total",
}


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def queries(dashboard: dict) -> list[tuple[str, str]]:
    return [
        (panel["title"], target["expr"])
        for panel in dashboard["panels"]
        for target in panel.get("targets", ())
    ]


def test_the_dashboard_imports_with_a_prometheus_input(dashboard) -> None:
    (source,) = dashboard["__inputs"]
    assert source["name"] == "DS_PROMETHEUS" and source["pluginId"] == "prometheus"
    graphs = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert graphs
    for panel in graphs:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${DS_PROMETHEUS}"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        place = panel["gridPos"]
        assert place["x"] + place["w"] <= 24, panel["title"]


def test_every_query_names_series_the_processes_expose(dashboard) -> None:
    exposed = set().union(*(series_names(text) for text in process_expositions().values()))
    charted = set()
    for title, expr in queries(dashboard):
        names = set(SERIES.findall(expr))
        assert names, f"{title}: {expr} names no mesh series"
        assert names <= exposed, f"{title}: {sorted(names - exposed)} is exposed by no process"
        assert expr.count("(") == expr.count(")"), f"{title}: unbalanced parentheses"
        assert expr.count("[") == expr.count("]"), f"{title}: unbalanced brackets"
        charted |= names
    missing = {what: name for what, name in MUST_CHART.items() if name not in charted}
    assert not missing, f"no panel charts {missing}"
