"""The status table an operator reads from `mesh-coordinator status`."""

from __future__ import annotations

import pytest

from coordinator.planner import ModelFootprint, plan_layers
from coordinator.registry import (
    HeartbeatReceived,
    HeartbeatsChecked,
    LoadStarted,
    LoadSucceeded,
    ModelSelected,
    NodeJoined,
    StageReady,
    State,
    apply,
    planner_nodes,
)
from coordinator.topology_view import render_status, status_from_state
from mesh.types import LayerRange


def serving_state() -> State:
    state = apply(State(), ModelSelected(model_id="smollm2", package_ref="pkg/dir", layer_count=30))
    state = apply(
        state,
        NodeJoined(
            node_id="head",
            address="10.0.0.1:7071",
            device="cuda:0",
            memory_bytes=16 << 30,
            frontend=True,
            http_url="http://10.0.0.1:8000",
            now=0.0,
        ),
    )
    state = apply(
        state,
        NodeJoined(node_id="w1", address="10.0.0.2:7071", device="cpu", now=1.0),
    )
    state = apply(state, NodeJoined(node_id="spare", address="10.0.0.3:7071", now=1.0))
    footprint = ModelFootprint(30, 1 << 20, 0, 0, 0)
    nodes = [n for n in planner_nodes(state) if n.node_id != "spare"]
    state = apply(state, LoadStarted(term=1, plan=plan_layers(nodes, footprint)))
    state = apply(state, StageReady(node_id="head", param_bytes=3 << 20))
    state = apply(state, StageReady(node_id="w1", param_bytes=int(2.5 * (1 << 20))))
    state = apply(
        state,
        HeartbeatReceived(
            node_id="w1",
            now=9.0,
            term=1,
            stage_state="serving",
            active_sessions=2,
            kv_bytes=3 << 20,
            prefix_bytes=1 << 19,
        ),
    )
    return apply(state, LoadSucceeded(term=1))


def test_status_lists_assigned_stages_first() -> None:
    status = status_from_state(serving_state(), now=10.0, coordinator_id="coord-1")
    assert [s.node_id for s in status.stages] == ["head", "w1", "spare"]
    head, w1, spare = status.stages
    assert (head.assigned, head.stage_index) == (True, 0)
    assert w1.layer_range == LayerRange(head.layer_range.end, 30)
    assert (spare.assigned, spare.layer_range) == (False, None)
    assert w1.heartbeat_age_s == pytest.approx(1.0)
    assert (w1.kv_bytes, w1.prefix_bytes) == (3 << 20, 1 << 19)
    assert (status.term, status.state, status.http_url) == (1, "serving", "http://10.0.0.1:8000")


def test_render_shows_header_and_one_row_per_node() -> None:
    text = render_status(serving_state(), now=10.0, coordinator_id="coord-1")
    lines = text.splitlines()
    assert lines[0] == "coordinator: coord-1"
    assert "model:       smollm2 from pkg/dir, 30 layers" in lines
    assert "term:        1" in lines
    assert "mesh state:  serving" in lines
    assert "http url:    http://10.0.0.1:8000" in lines
    table = lines[lines.index("") + 1 :]
    assert table[0].split() == [
        "stage",
        "node",
        "address",
        "device",
        "layers",
        "health",
        "state",
        "term",
        "heartbeat",
        "params",
        "kv",
        "memory",
        "step",
        "sessions",
        "slice",
    ]
    rows = {line.split()[1]: line for line in table[2:]}
    assert set(rows) == {"head", "w1", "spare"}
    assert rows["w1"].split()[0] == "1"
    assert "[15, 30)" in rows["w1"]
    assert "2.5 MiB" in rows["w1"]
    # KV: the live sessions' and the kept prefixes' together.
    assert "3.5 MiB" in rows["w1"]
    assert "serving" in rows["w1"]
    assert "1.0s ago" in rows["w1"]
    assert rows["w1"].split()[-2:] == ["2", "-"]
    assert "16.0 GiB" in rows["head"]
    assert rows["spare"].split()[0] == "-"
    assert "unknown" in rows["spare"]
    # Columns line up: every row starts each column at the same offset.
    offset = table[0].index("address")
    assert all(row[offset:].startswith("10.0.0.") for row in table[2:])


def test_render_shows_the_error_of_a_degraded_mesh() -> None:
    state = apply(serving_state(), HeartbeatReceived(node_id="head", now=30.0))
    state = apply(state, HeartbeatsChecked(now=30.0, timeout_s=10.0))
    text = render_status(state, now=30.0)
    assert "mesh state:  failed" in text
    assert "error:       stage 1 (w1 at 10.0.0.2:7071, layers [15, 30)) missed heartbeats" in text
    assert "dead" in text


def test_render_without_nodes() -> None:
    text = render_status(status_from_state(State(), now=0.0))
    assert "model:       (none)" in text
    assert "no nodes have joined" in text


def test_render_state_needs_a_clock() -> None:
    with pytest.raises(ValueError, match="needs now="):
        render_status(State())


def test_status_shows_slice_progress_and_hides_a_dead_nodes_last_state() -> None:
    from coordinator.registry import HeartbeatsChecked, SliceProgress

    state = apply(
        serving_state(), SliceProgress(node_id="w1", bytes_done=1 << 20, bytes_total=4 << 20)
    )
    state = apply(state, SliceProgress(node_id="head", bytes_done=2 << 20, bytes_total=2 << 20))
    rows = {s.node_id: s for s in status_from_state(state, now=10.0).stages}
    assert (rows["w1"].slice_bytes_done, rows["w1"].slice_bytes_total) == (1 << 20, 4 << 20)
    text = render_status(state, now=10.0)
    w1_row = next(line for line in text.splitlines() if line.startswith("1 "))
    assert w1_row.rstrip().endswith("25% of 4.0 MiB")
    head_row = next(line for line in text.splitlines() if line.startswith("0 "))
    assert head_row.rstrip().endswith("ready")
    # A node that stopped heartbeating is shown unreachable, not in its last state.
    dead = apply(state, HeartbeatsChecked(now=100.0, timeout_s=3.0))
    assert {s.state for s in status_from_state(dead, now=100.0).stages} == {"unreachable"}
