"""Every process's Prometheus exposition: naming rules, the series each kind of
process carries, the metrics port and its flags, and counters that need a rule of
their own (speculation by a composite's child, the coordinator's loads)."""

from __future__ import annotations

import socket

import httpx
import pytest
from metrics_support import naming_problems, process_expositions, series_names, value
from prometheus_client import CollectorRegistry, Counter

from mesh.errors import InvalidRequest
from mesh.metrics import check_local_stage_metrics_ports, local_stage_metrics_argv, serve_metrics

# The series an operator relies on, by the kind of process that exposes them.
STAGE_SERIES = {
    "mesh_link_frames_sent_total",
    "mesh_link_bytes_sent_total",
    "mesh_link_frames_received_total",
    "mesh_link_bytes_received_total",
    "mesh_frame_queue_seconds_bucket",
    "mesh_frame_compute_seconds_bucket",
    "mesh_frame_segments_bucket",
    "mesh_frame_tokens_bucket",
    "mesh_stage_sessions",
    "mesh_stage_kv_bytes",
    "mesh_stage_term",
    "mesh_stage_loads_total",
    "mesh_stage_releases_total",
    "mesh_stage_graph_frames",
}
STAGE_ZERO_SERIES = STAGE_SERIES | {
    "mesh_http_requests_total",
    "mesh_http_requests_in_flight",
    "mesh_time_to_first_token_seconds_bucket",
    "mesh_time_per_output_token_seconds_bucket",
    "mesh_completion_tokens_total",
    "mesh_generations_total",
    "mesh_stage_compute_seconds_bucket",
    "mesh_stage_queue_seconds_bucket",
    "mesh_pipeline_round_seconds_bucket",
    "mesh_step_segments_bucket",
    "mesh_step_tokens_bucket",
    "mesh_stale_results_total",
    "mesh_speculation_accepted_tokens_total",
    "mesh_request_recoveries_total",
    "mesh_request_rereads_total",
}
COORDINATOR_SERIES = {
    "mesh_coordinator_term",
    "mesh_coordinator_load_attempts_total",
    "mesh_coordinator_loads_total",
    "mesh_coordinator_load_seconds_bucket",
    "mesh_coordinator_nodes_lost_total",
    "mesh_coordinator_node_kv_bytes",
}


@pytest.fixture(scope="module")
def expositions() -> dict[str, str]:
    return process_expositions()


def test_every_process_keeps_the_naming_rules(expositions) -> None:
    for process, text in expositions.items():
        assert naming_problems(text) == [], process


def test_each_kind_of_process_exposes_its_series(expositions) -> None:
    assert STAGE_SERIES <= series_names(expositions["stage"])
    assert STAGE_ZERO_SERIES <= series_names(expositions["stage-0"])
    assert COORDINATOR_SERIES <= series_names(expositions["coordinator"])
    # Series that were milliseconds or gauges named _total are gone.
    stage_zero = series_names(expositions["stage-0"])
    assert "mesh_stage_compute_ms_bucket" not in stage_zero
    assert "mesh_speculation_tokens_total" not in stage_zero


def test_the_rules_catch_violations() -> None:
    bad = (
        "# TYPE mesh_requests_done_total gauge\nmesh_requests_done_total 3\n"
        "# TYPE mesh_round_ms histogram\n"
        'mesh_round_ms_bucket{le="+Inf"} 1\nmesh_round_ms_sum 4\nmesh_round_ms_count 1\n'
        "# TYPE mesh_frames_total counter\nmesh_frames_total 2\n"
        "# TYPE mesh_frames_created gauge\nmesh_frames_created 1.7e9\n"
        "# TYPE mesh_a_total counter\nmesh_a 1\n"
        "# TYPE mesh_x gauge\nmesh_x 1\n# TYPE mesh_y gauge\nmesh_y 1\n"
        "# TYPE mesh_x gauge\nmesh_x 2\n"
        "# TYPE Other_thing gauge\nOther_thing 1\n"
    )
    problems = naming_problems(bad)
    assert any("mesh_requests_done_total: a gauge named _total" in p for p in problems)
    assert any(p.startswith("mesh_round_ms: not in base units") for p in problems)
    assert any(p.startswith("mesh_round_ms: a histogram not in") for p in problems)
    assert "mesh_frames_created: a _created timestamp series" in problems
    assert "mesh_a: type unknown" in problems
    assert any(p.startswith("mesh_x: more than one family") for p in problems)
    assert any(p.startswith("Other_thing: not a mesh_") for p in problems)


def test_a_metrics_port_serves_the_registry() -> None:
    registry = CollectorRegistry()
    Counter("mesh_probe_total", "A probe.", registry=registry).inc(3)
    assert serve_metrics(registry, "127.0.0.1", None) is None
    port = serve_metrics(registry, "127.0.0.1", 0)
    assert port
    reply = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
    assert reply.status_code == 200
    assert value(reply.text, "mesh_probe_total") == 3
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        with pytest.raises(InvalidRequest, match="--metrics-port"):
            serve_metrics(registry, "127.0.0.1", taken)


def test_a_taken_local_stage_metrics_port_names_the_flag_up_takes() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        # Stage 1 of base taken - 1 would serve on the taken port.
        with pytest.raises(InvalidRequest, match="local stage 1 .*--stage-metrics-port-base"):
            check_local_stage_metrics_ports("127.0.0.1", taken - 1, range(1, 2))
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        free = closed.getsockname()[1]
    check_local_stage_metrics_ports("127.0.0.1", free, range(0, 1))
    # No base, or 0 (each stage a free port): nothing to check.
    check_local_stage_metrics_ports("127.0.0.1", None, range(0, 4))
    check_local_stage_metrics_ports("127.0.0.1", 0, range(0, 4))


def test_metrics_ports_are_settings_and_the_local_stages_get_theirs() -> None:
    from coordinator.cli import build_parser, resolve_up

    def up(*flags: str):
        return resolve_up(build_parser().parse_args(["up", *flags])).coordinator.value

    off = up()
    assert (
        off.metrics_port is None and local_stage_metrics_argv(off.stage_metrics_port_base, 1) == []
    )
    based = up("--metrics-port", "9300", "--stage-metrics-port-base", "9301")
    assert based.metrics_port == 9300
    assert local_stage_metrics_argv(based.stage_metrics_port_base, 0) == ["--metrics-port", "9301"]
    assert local_stage_metrics_argv(based.stage_metrics_port_base, 2) == ["--metrics-port", "9303"]
    free = up("--stage-metrics-port-base", "0")
    assert local_stage_metrics_argv(free.stage_metrics_port_base, 3) == ["--metrics-port", "0"]
    with pytest.raises(InvalidRequest, match="coordinator.metrics_port from CLI --metrics-port"):
        up("--metrics-port", "70000")
