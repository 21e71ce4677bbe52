"""The layer planner: contiguous, proportional, fitting splits and clear refusals."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.planner import (
    ModelFootprint,
    NodeCapacity,
    Plan,
    footprint_from_manifest,
    plan_layers,
)
from mesh.errors import InvalidRequest
from mesh.package.manifest import EMBED_PATH, HEAD_PATH, PackageFile, PackageManifest, layer_path
from mesh.types import LayerRange

GIB = 1 << 30
MIB = 1 << 20


def node(node_id: str, memory_gib: float = 0, **kwargs) -> NodeCapacity:
    return NodeCapacity(
        node_id=node_id,
        address=f"10.0.0.{len(node_id)}:7071",
        memory_bytes=int(memory_gib * GIB),
        **kwargs,
    )


def footprint(layers: int = 30, **kwargs) -> ModelFootprint:
    values = dict(
        layer_count=layers,
        layer_bytes=100 * MIB,
        embed_bytes=0,
        head_bytes=0,
        kv_bytes_per_layer=0,
    )
    values.update(kwargs)
    return ModelFootprint(**values)


def counts(plan: Plan) -> list[int]:
    return [len(stage.layer_range) for stage in plan.stages]


def assert_covers(plan: Plan, layer_count: int) -> None:
    start = 0
    for index, stage in enumerate(plan.stages):
        assert stage.stage_index == index
        assert stage.layer_range.start == start
        assert len(stage.layer_range) >= 1
        start = stage.layer_range.end
    assert start == layer_count


def test_equal_nodes_split_evenly() -> None:
    plan = plan_layers([node("a", 8), node("b", 8), node("c", 8)], footprint(30))
    assert counts(plan) == [10, 10, 10]
    assert [s.node_id for s in plan.stages] == ["a", "b", "c"]
    assert_covers(plan, 30)


def test_uneven_layer_count_spreads_the_remainder() -> None:
    plan = plan_layers([node("a"), node("b"), node("c"), node("d")], footprint(30))
    assert sorted(counts(plan), reverse=True) == [8, 8, 7, 7]
    assert_covers(plan, 30)


def test_split_is_proportional_to_memory() -> None:
    plan = plan_layers([node("a", 24), node("b", 8)], footprint(40))
    assert counts(plan) == [30, 10]
    assert_covers(plan, 40)


def test_uneven_memory_splits_by_memory_and_stays_within_it() -> None:
    # 64 : 3 : 32 GiB of 20 layers at 1 GiB each (weights plus KV) -> 13.5 : 0.6 : 6.5.
    fp = footprint(20, layer_bytes=GIB // 2, kv_bytes_per_layer=GIB // 2)
    plan = plan_layers([node("big", 64), node("small", 3), node("mid", 32)], fp)
    assert counts(plan) == [13, 1, 6]
    for stage, offered in zip(plan.stages, (64, 3, 32), strict=True):
        assert stage.planned_bytes <= offered * GIB
    assert_covers(plan, 20)


def test_speed_hint_splits_equal_memory_nodes() -> None:
    plan = plan_layers(
        [node("slow", 8, speed_hint=1.0), node("fast", 8, speed_hint=3.0)], footprint(40)
    )
    assert counts(plan) == [10, 30]


def test_speed_hint_alone_decides_when_memory_is_unknown() -> None:
    plan = plan_layers([node("a", speed_hint=2.0), node("b", speed_hint=1.0)], footprint(30))
    assert counts(plan) == [20, 10]


def test_stage0_extras_shift_layers_to_later_stages() -> None:
    fp = footprint(20, layer_bytes=GIB // 4, embed_bytes=GIB, stage0_extra_bytes=GIB)
    plan = plan_layers([node("a", 6), node("b", 6)], fp)
    # Stage 0 has 4 GiB left for layers, stage 1 all 6 GiB: 8 and 12 layers.
    assert counts(plan) == [8, 12]
    assert plan.stages[0].planned_bytes == 2 * GIB + 8 * (GIB // 4)
    assert plan.stages[1].planned_bytes == 12 * (GIB // 4)


def test_head_is_budgeted_on_the_last_stage() -> None:
    fp = footprint(10, layer_bytes=GIB, head_bytes=3 * GIB)
    plan = plan_layers([node("a", 8), node("b", 8)], fp)
    assert counts(plan) == [6, 4]
    assert plan.stages[1].planned_bytes == 7 * GIB


def test_the_head_counts_as_layers_of_work_when_memory_is_not_stated() -> None:
    fp = footprint(10, layer_bytes=GIB, head_bytes=8 * GIB)  # 4 layers of work
    assert counts(plan_layers([node("a", 0), node("b", 0)], fp)) == [7, 3]
    assert counts(plan_layers([node("a", 0), node("b", 0), node("c", 0)], fp)) == [5, 4, 1]
    # Without a head, equal nodes share evenly.
    assert counts(plan_layers([node("a", 0), node("b", 0)], footprint(10, layer_bytes=GIB))) == [
        5,
        5,
    ]


def test_frontend_node_is_stage_zero() -> None:
    plan = plan_layers([node("w1", 8), node("head", 8, frontend=True), node("w2", 8)], footprint())
    assert [s.node_id for s in plan.stages] == ["head", "w1", "w2"]
    assert plan.stages[0].layer_range.start == 0


def test_single_node_holds_the_whole_model() -> None:
    fp = footprint(30, embed_bytes=GIB, head_bytes=GIB)
    plan = plan_layers([node("solo", 16)], fp)
    assert len(plan.stages) == 1
    only = plan.stages[0]
    assert only.layer_range == LayerRange(0, 30)
    assert only.planned_bytes == 2 * GIB + 30 * 100 * MIB


def test_more_nodes_than_layers_leaves_the_smallest_out() -> None:
    nodes = [node("a", 8, frontend=True), node("b", 2), node("c", 16), node("d", 4)]
    plan = plan_layers(nodes, footprint(3))
    assert [s.node_id for s in plan.stages] == ["a", "c", "d"]
    assert counts(plan) == [1, 1, 1]
    assert_covers(plan, 3)


def test_max_stages_limits_the_chain() -> None:
    nodes = [node("a", 8), node("b", 8), node("c", 8)]
    plan = plan_layers(nodes, footprint(30), max_stages=2)
    assert [s.node_id for s in plan.stages] == ["a", "b"]
    assert counts(plan) == [15, 15]


def test_node_too_small_for_one_layer_is_left_out() -> None:
    fp = footprint(10, layer_bytes=GIB)
    plan = plan_layers([node("a", 8), node("tiny", 0.5), node("b", 8)], fp)
    assert [s.node_id for s in plan.stages] == ["a", "b"]
    assert_covers(plan, 10)


def test_cannot_fit_names_the_need_and_the_offer() -> None:
    fp = footprint(30, layer_bytes=GIB // 2, kv_bytes_per_layer=GIB // 2, embed_bytes=GIB)
    with pytest.raises(InvalidRequest) as caught:
        plan_layers([node("a", 8), node("b", 8)], fp)
    message = caught.value.message
    assert "the model needs 31.00 GiB" in message
    assert "30 layers" in message
    assert "the 2 stage(s) offer 16.00 GiB" in message
    assert "add a stage, or hold KV for fewer sessions" in message


def test_cannot_fit_when_stage0_extras_leave_no_room() -> None:
    fp = footprint(4, layer_bytes=GIB, stage0_extra_bytes=4 * GIB)
    with pytest.raises(InvalidRequest, match=r"stage 0 \(a\) alone needs 5.00 GiB"):
        plan_layers([node("a", 4, frontend=True), node("b", 64)], fp)


def test_unknown_memory_is_unlimited_and_known_memory_caps() -> None:
    fp = footprint(30, layer_bytes=GIB)
    plan = plan_layers([node("known", 2), node("unknown", 0)], fp)
    assert counts(plan) == [2, 28]


def test_refuses_bad_inputs() -> None:
    with pytest.raises(InvalidRequest, match="no stage nodes"):
        plan_layers([], footprint())
    with pytest.raises(InvalidRequest, match="twice"):
        plan_layers([node("a"), node("a")], footprint())
    with pytest.raises(InvalidRequest, match="only one may be stage 0"):
        plan_layers([node("a", frontend=True), node("b", frontend=True)], footprint())
    with pytest.raises(InvalidRequest, match="max_stages"):
        plan_layers([node("a")], footprint(), max_stages=0)
    with pytest.raises(InvalidRequest, match="speed hint"):
        plan_layers([node("a", speed_hint=0.0)], footprint())


def test_plan_is_deterministic_and_describes_itself() -> None:
    nodes = [node("a", 7), node("b", 9, speed_hint=1.5), node("c", 5)]
    first = plan_layers(nodes, footprint(25))
    assert first == plan_layers(list(nodes), footprint(25))
    text = first.describe()
    assert text.splitlines()[0].startswith("stage 0: a (")
    assert "layers [0, " in text
    assert first.stage_of("b") == first.stages[1]
    assert first.node_ids() == ("a", "b", "c")


def _manifest(dtype: str = "float32") -> PackageManifest:
    digest = "0" * 64
    files = [
        PackageFile("config.json", "meta", 700, digest),
        PackageFile(EMBED_PATH, "embed", 4000, digest),
        PackageFile(HEAD_PATH, "head", 4100, digest),
    ]
    files += [
        PackageFile(layer_path(i), "layer", 1000 + i, digest, layer_index=i) for i in range(3)
    ]
    return PackageManifest(
        model_id="tiny",
        architecture="LlamaForCausalLM",
        model_type="llama",
        layer_count=3,
        hidden_size=64,
        vocab_size=100,
        dtype=dtype,
        tied_embeddings=True,
        source={},
        files=tuple(files),
    )


def test_footprint_from_manifest_scales_to_serving_dtype() -> None:
    fp = footprint_from_manifest(
        _manifest("float32"),
        dtype="bfloat16",
        max_sessions=4,
        max_tokens_per_session=128,
        num_kv_heads=2,
        head_dim=16,
    )
    assert fp.layer_count == 3
    assert fp.layer_bytes == 501  # largest layer, 1002 bytes at float32, halved
    assert fp.embed_bytes == 2000
    assert fp.head_bytes == 2050
    assert fp.kv_bytes_per_layer == 4 * 128 * 2 * 2 * 16 * 2
    same = footprint_from_manifest(
        _manifest("float32"),
        dtype="auto",
        max_sessions=1,
        max_tokens_per_session=1,
        num_kv_heads=1,
        head_dim=1,
    )
    assert same.layer_bytes == 1002
    assert same.kv_bytes_per_layer == 2 * 4


def test_footprint_from_manifest_refuses_unknown_dtype() -> None:
    with pytest.raises(InvalidRequest, match="unknown dtype 'int3'"):
        footprint_from_manifest(
            _manifest(),
            dtype="int3",
            max_sessions=1,
            max_tokens_per_session=1,
            num_kv_heads=1,
            head_dim=1,
        )


@settings(max_examples=300, deadline=None)
@given(
    memories=st.lists(st.integers(min_value=0, max_value=40), min_size=1, max_size=6),
    speeds=st.lists(st.sampled_from([0.5, 1.0, 2.0]), min_size=6, max_size=6),
    frontend=st.integers(min_value=-1, max_value=5),
    layers=st.integers(min_value=1, max_value=48),
    extras=st.tuples(*(st.integers(min_value=0, max_value=3) for _ in range(3))),
    max_stages=st.one_of(st.none(), st.integers(min_value=1, max_value=6)),
)
def test_any_plan_covers_every_layer_within_memory(
    memories, speeds, frontend, layers, extras, max_stages
) -> None:
    nodes = [
        NodeCapacity(f"n{i}", f"h{i}:1", m * GIB // 2, speeds[i], frontend == i)
        for i, m in enumerate(memories)
    ]
    embed, head, stage0 = (x * GIB // 4 for x in extras)
    fp = ModelFootprint(layers, GIB // 4, embed, head, GIB // 8, stage0)
    try:
        plan = plan_layers(nodes, fp, max_stages=max_stages)
    except InvalidRequest as error:
        assert "add a stage, or hold KV for fewer sessions" in error.message
        return
    assert_covers(plan, layers)
    assert len(plan.stages) <= min(len(nodes), layers, max_stages or len(nodes))
    expected_head = nodes[frontend] if 0 <= frontend < len(nodes) else nodes[0]
    assert plan.stages[0].node_id == expected_head.node_id
    offered = {n.node_id: n.memory_bytes for n in nodes}
    for stage in plan.stages:
        assert offered[stage.node_id] == 0 or stage.planned_bytes <= offered[stage.node_id]
    # Later stages keep join order.
    order = [n.node_id for n in nodes if n.node_id != expected_head.node_id]
    later = [s.node_id for s in plan.stages[1:]]
    assert later == [n for n in order if n in later]
