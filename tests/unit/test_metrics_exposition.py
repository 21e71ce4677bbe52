"""Every process's Prometheus exposition: naming rules, the series each kind of
process carries, the metrics port and its flags, and counters that need a rule of
their own (speculation by a composite's child, the coordinator's loads)."""

from __future__ import annotations

import argparse
import socket

import httpx
import pytest
from metrics_support import naming_problems, process_expositions, series_names, value
from prometheus_client import CollectorRegistry, Counter, generate_latest

from mesh.errors import InvalidRequest
from mesh.metrics import add_metrics_arguments, local_stage_metrics_argv, serve_metrics

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


def test_metrics_flags_and_the_local_stages_ports() -> None:
    parser = argparse.ArgumentParser()
    add_metrics_arguments(parser, local_stages=True)
    off = parser.parse_args([])
    assert off.metrics_port is None and local_stage_metrics_argv(off, 1) == []
    based = parser.parse_args(["--metrics-port", "9300", "--stage-metrics-port-base", "9301"])
    assert based.metrics_port == 9300
    assert local_stage_metrics_argv(based, 0) == ["--metrics-port", "9301"]
    assert local_stage_metrics_argv(based, 2) == ["--metrics-port", "9303"]
    free = parser.parse_args(["--stage-metrics-port-base", "0"])
    assert local_stage_metrics_argv(free, 3) == ["--metrics-port", "0"]
    with pytest.raises(SystemExit):
        parser.parse_args(["--metrics-port", "70000"])


def test_a_composite_strategy_counts_each_child_it_drafted_with(tmp_path) -> None:
    from mesh.speculative import AdaptiveWindow, CompositeDrafter, MemoryNgramDrafter, NgramDrafter
    from mesh.types import SamplingParams
    from stage.frontend.backend import GenerationRequest
    from stage.frontend.engine_types import EngineLimits
    from stage.frontend.request_run import RequestRun
    from stage.frontend.scheduler import PipelineScheduler
    from stage.node import NodeSettings, StageNode

    # The first child needs a repeated 4-gram, the second a repeated 2-gram.
    composite = CompositeDrafter(NgramDrafter(4, 6), MemoryNgramDrafter(2, 6))
    prompt = (1, 2, 3, 1, 2)
    composite.begin(prompt)
    request = GenerationRequest("r", prompt, 32, SamplingParams(), frozenset())
    run = RequestRun(request, (composite, AdaptiveWindow(4, 1, 8), "composite"))
    node = StageNode(NodeSettings("n", cache_dir=tmp_path), "127.0.0.1:1")
    try:
        metrics = PipelineScheduler(node, "tiny", EngineLimits()).metrics
        drafts = composite.propose(4)  # only the 2-gram child matches [1, 2] -> [3, ...]
        assert drafts and composite.last_source is composite.draft
        run.observe(drafts, 1, [drafts[0], 9], 0.01, 0.001)
        assert metrics.rounds(run).windows == 1
        run.observe([], 0, [7], 0.01, 0.0)  # a round without drafts
        assert metrics.rounds(run).windows == 0
        assert metrics.rounds(run) is None  # nothing new
        text = generate_latest(node.metrics.registry).decode()
    finally:
        node.stop()
    child = {"strategy": "composite", "drafter": "ngram-memory"}
    assert value(text, "mesh_speculation_drafted_tokens_total", **child) == len(drafts)
    assert value(text, "mesh_speculation_accepted_tokens_total", **child) == 1
    assert value(text, "mesh_speculation_windows_total", **child) == 1
    assert value(text, "mesh_speculation_drafted_tokens_total", drafter="ngram") == 0
    assert value(text, "mesh_speculation_rounds_total", strategy="composite") == 2
    assert value(text, "mesh_speculation_emitted_tokens_total", strategy="composite") == 3


def test_the_coordinator_counts_loads_and_lost_nodes(expositions) -> None:
    text = expositions["coordinator"]
    assert value(text, "mesh_coordinator_load_attempts_total") == 1
    assert value(text, "mesh_coordinator_loads_total", outcome="ok") == 1
    assert value(text, "mesh_coordinator_loads_total", outcome="failed") == 0
    assert value(text, "mesh_coordinator_load_seconds_count") == 1
    assert value(text, "mesh_coordinator_nodes_lost_total") == 2
    assert value(text, "mesh_coordinator_term") == 1
    assert value(text, "mesh_coordinator_nodes", health="dead") == 2
