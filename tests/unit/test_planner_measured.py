"""The planner with what the nodes measured: memory stated or measured, stage 0's
draft budget, and layers split by measured compute."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from coordinator.planner import (
    HEAD_LOAD_FACTOR,
    ModelFootprint,
    NodeCapacity,
    Plan,
    plan_layers,
    step_estimates,
)
from coordinator.stage0_budget import draft_budget, draft_kv_bytes, stage0_extra_bytes
from mesh.config import DraftRef, SpeculationConfig
from mesh.errors import InvalidRequest
from stage.hardware import offered_memory

GIB = 1 << 30
MIB = 1 << 20


def node(node_id: str, memory_gib: float = 0, **kwargs) -> NodeCapacity:
    return NodeCapacity(node_id, f"10.0.0.{len(node_id)}:7071", int(memory_gib * GIB), **kwargs)


def footprint(layers: int = 30, **kwargs) -> ModelFootprint:
    values = dict(
        layer_count=layers, layer_bytes=GIB // 4, embed_bytes=0, head_bytes=0, kv_bytes_per_layer=0
    )
    values.update(kwargs)
    return ModelFootprint(**values)


def counts(plan: Plan) -> list[int]:
    return [len(stage.layer_range) for stage in plan.stages]


def test_stated_memory_is_a_share_and_measured_memory_only_a_limit() -> None:
    fp = footprint(40)
    assert counts(plan_layers([node("a", 24), node("b", 8)], fp)) == [30, 10]
    # The same figures measured: both nodes hold all 40 layers, so they share evenly.
    measured = [node("a", 24, memory_measured=True), node("b", 8, memory_measured=True)]
    assert counts(plan_layers(measured, fp)) == [20, 20]
    # A measured figure still caps: 3 GiB holds 12 layers of 1/4 GiB.
    capped = [node("a", 24, memory_measured=True), node("b", 3, memory_measured=True)]
    assert counts(plan_layers(capped, fp)) == [28, 12]


def test_draft_and_its_kv_are_budgeted_on_stage_0() -> None:
    nodes = [node("a", 6, frontend=True), node("b", 6)]
    assert counts(plan_layers(nodes, footprint(40))) == [20, 20]
    # A 1 GiB draft plus 1 GiB of draft KV on stage 0: it gets fewer layers by 2 GiB.
    with_draft = plan_layers(nodes, footprint(40, stage0_extra_bytes=2 * GIB))
    assert counts(with_draft) == [16, 24]
    assert with_draft.stages[0].planned_bytes == 2 * GIB + 16 * (GIB // 4)
    # Measured memory: the draft leaves stage 0 room for 16 layers at most.
    measured = [node("a", 6, frontend=True, memory_measured=True), node("b", 16)]
    assert counts(plan_layers(measured, footprint(40, stage0_extra_bytes=2 * GIB)))[0] <= 16


def test_draft_budget_reads_a_local_draft(tmp_path: Path) -> None:
    config = {
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "hidden_size": 256,
        "torch_dtype": "bfloat16",
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 4096)
    spec = SpeculationConfig(type="draft-model", draft_model=DraftRef(str(tmp_path), None, True))
    budget = draft_budget(spec, max_sessions=16, max_tokens_per_session=1024)
    # 16 sessions * 1024 positions * K and V * 4 layers * 2 heads * 32 dims * 2 bytes.
    assert budget is not None
    assert budget.kv_bytes == 16 * 1024 * 2 * 4 * 2 * 32 * 2 == draft_kv_bytes(config, 16, 1024)
    assert budget.weight_bytes == 4096
    assert stage0_extra_bytes(spec, 16, 1024) == budget.total_bytes
    # No draft model (the suffix drafter): nothing on stage 0.
    assert stage0_extra_bytes(SpeculationConfig(), 16, 1024) == 0


def test_measured_compute_shifts_layers_off_the_slow_stages() -> None:
    fp = footprint(30)
    even = [node(n, layer_ms=1.0) for n in ("a", "b", "c")]
    assert counts(plan_layers(even, fp)) == [10, 10, 10]
    # The last stage's head costs as much as 6 layers; stage 0's frontend 3.
    loaded = [
        node("a", layer_ms=1.0, overhead_ms=3.0),
        node("b", layer_ms=1.0),
        node("c", layer_ms=1.0, head_ms=6.0),
    ]
    plan = plan_layers(loaded, fp)
    assert counts(plan) == [10, 13, 7]
    assert [s.planned_step_ms for s in plan.stages] == [13.0, 13.0, 13.0]
    # A node twice as fast per layer takes twice the layers.
    assert counts(plan_layers([node("a", layer_ms=2.0), node("b", layer_ms=1.0)], fp)) == [10, 20]


def test_measurement_replaces_the_prior() -> None:
    fp = footprint(30, layer_bytes=GIB, head_bytes=8 * GIB)  # the prior: 4 layers of head
    assert HEAD_LOAD_FACTOR * 8 == 4
    assert counts(plan_layers([node("a"), node("b"), node("c")], fp)) == [12, 11, 7]
    # Measured: the head costs one layer.
    measured = [
        node("a", layer_ms=2.0),
        node("b", layer_ms=2.0),
        node("c", layer_ms=2.0, head_ms=2.0),
    ]
    assert counts(plan_layers(measured, fp)) == [11, 10, 9]
    # The head measured on another node (the last stage changed): scaled to this one.
    moved = [node("a", layer_ms=1.0, head_ms=6.0), node("b", layer_ms=2.0)]
    assert step_estimates(moved, [20, 10], fp) == [20.0, 32.0]
    # A node not measured yet counts as the mean of the others.
    fresh = [node("a", layer_ms=1.0), node("b", layer_ms=3.0), node("c")]
    assert step_estimates(fresh, [1, 1, 1], footprint(3)) == [1.0, 3.0, 2.0]


def test_memory_caps_the_balance() -> None:
    # b is 3x faster, but its stated 2 GiB holds only 8 layers.
    nodes = [node("a", 100, layer_ms=3.0), node("b", 2, layer_ms=1.0)]
    assert counts(plan_layers(nodes, footprint(30))) == [22, 8]


def test_bad_measurements_and_too_little_memory_are_refused_clearly() -> None:
    with pytest.raises(InvalidRequest, match="layer_ms -1.0; it must be >= 0"):
        plan_layers([node("a", layer_ms=-1.0)], footprint())
    with pytest.raises(InvalidRequest, match="head_ms nan"):
        plan_layers([node("a", head_ms=float("nan"))], footprint())
    # --memory 100MiB on the only stage: not one layer of 256 MiB fits.
    with pytest.raises(InvalidRequest, match=r"stage 0 \(a\) alone needs 0.25 GiB"):
        plan_layers([node("a", 100 / 1024)], footprint(4))


def test_memory_is_measured_unless_stated() -> None:
    from mesh.doctor.host import host_memory

    assert offered_memory("cpu", 3 * GIB, GIB) == offered_memory("cpu", 3 * GIB, 0)
    assert offered_memory("cpu", 3 * GIB, GIB).source == "stated"
    offered = offered_memory("cpu", 0, MIB)
    assert offered.source == "measured"
    assert 0 < offered.bytes_total <= host_memory().total_bytes - MIB
    with pytest.raises(InvalidRequest, match="lower --memory-margin or state the memory"):
        offered_memory("cpu", 0, 1 << 60)


def test_a_node_below_one_layer_is_left_out_with_a_warning(caplog) -> None:
    fp = footprint(8)  # layers of 1/4 GiB
    with caplog.at_level("WARNING", logger="coordinator.planner"):
        plan = plan_layers([node("a", 8), node("small", 0.1), node("b", 8)], fp)
    assert [s.node_id for s in plan.stages] == ["a", "b"]
    assert "node small offers 0.10 GiB (stated), less than one layer at stage 1 needs" in (
        caplog.text
    )
    assert "state more (mesh-stage join --memory)" in caplog.text


def test_an_address_space_limit_bounds_the_memory_offered() -> None:
    """Under ``ulimit -v`` (a service's LimitAS=) allocations fail past the limit
    whatever the host has free: the offer is what the limit leaves."""
    import subprocess
    import sys

    script = """
import resource
from pathlib import Path
import torch
from stage.hardware import offered_memory
size = next(int(l.split()[1]) * 1024 for l in Path("/proc/self/status").read_text().splitlines()
            if l.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (size + (768 << 20), resource.RLIM_INFINITY))
offered = offered_memory("cpu", 0, 0)
print(offered.bytes_total, offered.detail)
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    offered, detail = done.stdout.split(" ", 1)
    assert 0 < int(offered) <= 768 << 20
    assert "ulimit -v" in detail
