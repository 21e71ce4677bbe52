"""Compute balance from measurements: calibration, planned and measured step times,
and the 15% rule that plans again."""

from __future__ import annotations

import pytest

from coordinator import balance
from coordinator.planner import ModelFootprint, plan_layers
from coordinator.registry import (
    HeartbeatReceived,
    LoadStarted,
    LoadSucceeded,
    ModelSelected,
    NodeJoined,
    StageReady,
    State,
    apply,
    next_term,
    planner_nodes,
)

FOOTPRINT = ModelFootprint(
    layer_count=30, layer_bytes=1 << 20, embed_bytes=0, head_bytes=0, kv_bytes_per_layer=0
)
NODES = ("a", "b", "c")


def serving(probes: dict[str, tuple[float, float]] | None = None) -> State:
    """Three nodes serving [0, 10) [10, 20) [20, 30), with their step probes."""
    state = apply(State(), ModelSelected(model_id="m", package_ref="pkg", layer_count=30))
    for i, node_id in enumerate(NODES):
        state = apply(
            state,
            NodeJoined(
                node_id=node_id,
                address=f"10.0.0.{i + 1}:7071",
                now=0.0,
                memory_bytes=8 << 30,
                memory_source="measured",
                frontend=i == 0,
            ),
        )
    plan = plan_layers(planner_nodes(state), FOOTPRINT)
    state = apply(state, LoadStarted(term=next_term(state), plan=plan))
    probes = probes or {"a": (1.0, 0.0), "b": (1.0, 0.0), "c": (1.0, 4.0)}
    for node_id in NODES:
        layer_ms, head_ms = probes[node_id]
        state = apply(
            state,
            StageReady(
                node_id=node_id, param_bytes=1, term=state.term, layer_ms=layer_ms, head_ms=head_ms
            ),
        )
    return apply(state, LoadSucceeded(term=state.term))


def beat(state: State, steps: dict[str, float], frames: int = 64, sessions: int = 0) -> State:
    for node_id, step_ms in steps.items():
        state = apply(
            state,
            HeartbeatReceived(
                node_id=node_id,
                now=1.0,
                term=state.term,
                stage_state="serving",
                active_sessions=sessions if node_id == "a" else 0,
                step_ms=step_ms,
                step_frames=frames,
            ),
        )
    return state


def test_the_fifteen_percent_rule() -> None:
    state = serving()
    assert balance.spread(state) is None  # nothing measured yet
    assert not balance.should_rebalance(state)
    within = beat(state, {"a": 20.0, "b": 21.0, "c": 22.9})
    assert balance.spread(within) == pytest.approx(0.145)
    assert not balance.should_rebalance(within)
    apart = beat(state, {"a": 20.0, "b": 21.0, "c": 23.2})
    assert balance.should_rebalance(apart)
    # Not while stage 0 has sessions, nor on too few frames, nor with a 50% threshold.
    assert not balance.should_rebalance(beat(state, {"a": 20.0, "c": 30.0}, sessions=2))
    assert not balance.should_rebalance(beat(state, {"a": 20.0, "b": 21.0, "c": 30.0}, frames=5))
    assert not balance.should_rebalance(apart, threshold=0.5)


def test_step_times_of_an_old_term_or_a_loading_stage_do_not_count() -> None:
    state = serving()
    stale = apply(
        state,
        HeartbeatReceived(
            node_id="c",
            now=1.0,
            term=state.term,
            stage_state="claimed",
            step_ms=99.0,
            step_frames=64,
        ),
    )
    assert stale.node("c").step_ms == 0.0
    measured = beat(state, {"a": 10.0, "b": 10.0, "c": 14.0})
    assert measured.node("c").step_ms == 14.0
    # A new load forgets the step times (not the probes).
    plan = measured.topology
    reloading = apply(measured, LoadStarted(term=next_term(measured), plan=plan))
    assert reloading.node("c").step_ms == 0.0
    assert reloading.node("c").head_ms == 4.0


def test_calibration_finds_the_frontend_overhead() -> None:
    # Probe: 10 ms of layers on a and b, 10 + 4 on c. Serving takes twice the probe's
    # time on b and c, and stage 0 measures 26 ms: 6 ms of frontend overhead.
    state = beat(serving(), {"a": 26.0, "b": 20.0, "c": 28.0})
    calibration = balance.calibrate(state, FOOTPRINT)
    assert calibration.scale == pytest.approx(2.0)
    assert calibration.overhead_ms == pytest.approx(6.0)
    assert calibration.frontend_node == "a"
    steps = balance.stage_steps(state, FOOTPRINT)
    assert [s.planned_ms for s in steps] == pytest.approx([26.0, 20.0, 28.0])
    assert [s.measured_ms for s in steps] == [26.0, 20.0, 28.0]
    # The next plan balances with the overhead and the head: stage 0 and the last
    # stage give layers to stage 1, and its slowest stage is estimated faster.
    plan = plan_layers(balance.planning_nodes(state, FOOTPRINT), FOOTPRINT)
    assert [len(s.layer_range) for s in plan.stages] == [10, 12, 8]
    assert max(s.planned_step_ms for s in plan.stages) == pytest.approx(26.0)


def test_the_scale_is_the_median_and_relative_speed_the_probes() -> None:
    # b serves at 3x its probe, c at 2x: serving ms are 2.5 probe ms; stage 0's 26 ms
    # are 1 ms above its scaled 25. b probed twice as fast as a per layer: it still
    # takes more layers, whatever its serving figure said this time.
    probes = {"a": (1.0, 0.0), "b": (0.5, 0.0), "c": (1.0, 4.0)}
    state = beat(serving(probes), {"a": 26.0, "b": 15.0, "c": 28.0})
    calibration = balance.calibrate(state, FOOTPRINT)
    assert calibration.scale == pytest.approx(2.5)
    assert calibration.overhead_ms == pytest.approx(1.0)
    plan = plan_layers(balance.planning_nodes(state, FOOTPRINT), FOOTPRINT)
    layers = [len(s.layer_range) for s in plan.stages]
    assert layers[1] > layers[0] > layers[2] and sum(layers) == 30
    assert max(s.planned_step_ms for s in plan.stages) < 28.0


def test_probes_average_over_loads_and_keep_the_head() -> None:
    state = serving({"a": (1.0, 0.0), "b": (2.0, 0.0), "c": (1.0, 4.0)})
    reloaded = apply(state, LoadStarted(term=next_term(state), plan=state.topology))
    for node_id, layer_ms in (("a", 3.0), ("b", 2.0), ("c", 2.0)):
        reloaded = apply(
            reloaded,
            StageReady(node_id=node_id, param_bytes=1, term=reloaded.term, layer_ms=layer_ms),
        )
    assert [reloaded.node(n).layer_ms for n in NODES] == [2.0, 2.0, 1.5]
    # c measured no head this time (say it was not the last stage): its figure stays.
    assert reloaded.node("c").head_ms == 4.0


def test_before_serving_measurements_planned_is_the_probe_estimate() -> None:
    steps = balance.stage_steps(serving(), FOOTPRINT)
    assert [s.planned_ms for s in steps] == [10.0, 10.0, 14.0]
    assert [s.measured_ms for s in steps] == [0.0, 0.0, 0.0]
    assert balance.stage_steps(State(), FOOTPRINT) == []
