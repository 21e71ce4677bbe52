"""The fixed-shape decode step (what CUDA graphs replay) computes what the regular
decode path computes: checked eagerly on the CPU, and captured on CUDA where a GPU
is present."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import tiny_config
from runtime_support import LAYERS, SPLITS, full_logits, max_diff, package_of, run_chain
from transformers import AutoModelForCausalLM

from mesh.runtime import (
    Span,
    StageRuntime,
    StateDictWeights,
    batch_graphs,
    build_stage_runtime,
    invariant,
    load_stage_runtime,
)
from mesh.runtime.batch_graphs import FrameAttention, bucket_for, key_length
from mesh.runtime.graphs import DecodeGraph, StaticDecode
from mesh.runtime.sessions import CAPACITY_STEP_TOKENS
from mesh.types import LayerRange

TOLERANCE = 1e-4


def tiny_model(family: str, **overrides) -> AutoModelForCausalLM:
    config = tiny_config(family, layers=LAYERS, vocab_size=512)
    config_class = type(config)
    torch.manual_seed(21)
    model = AutoModelForCausalLM.from_config(config_class(**{**config.to_dict(), **overrides}))
    model.eval()
    model.config.architectures = [type(model).__name__]
    return model


def chain(model: AutoModelForCausalLM, device: str = "cpu") -> list[StageRuntime]:
    weights = StateDictWeights(model.state_dict(), tied=model.config.tie_word_embeddings)
    return [build_stage_runtime(model.config, weights, r, device=device) for r in SPLITS[2]]


def static_chain(model: AutoModelForCausalLM) -> list[StageRuntime]:
    """A 2-stage split whose graph steps run eagerly (the arithmetic CUDA replays)."""
    stages = chain(model)
    for stage in stages:
        stage.use_static_decode(capture=False)
    return stages


def tokens(count: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 512, (count,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    ("family", "overrides"),
    [
        ("llama", {}),
        ("qwen3", {}),
        ("mistral", {"sliding_window": 6, "layer_types": None}),
        ("qwen3_moe", {}),
        ("mixtral", {}),
        ("gemma2", {}),
        ("gemma3", {}),
        ("glm4", {}),
    ],
)
def test_static_decode_steps_match_the_unsplit_model(family: str, overrides: dict) -> None:
    """Decode steps through the fixed-shape step on both stages of a split, across a
    KV buffer growth, after a rewind, and for a session that starts with one token."""
    model = tiny_model(family, **overrides)
    stages = static_chain(model)
    length = CAPACITY_STEP_TOKENS + 6
    sequence = tokens(length, seed=4)
    want = full_logits(model, sequence)
    prefill = CAPACITY_STEP_TOKENS - 4
    got = [run_chain(stages, "s", 0, sequence[:prefill])]
    first_graph = stages[0]._sessions._sessions["s"].decode_graph  # noqa: SLF001
    assert first_graph is None  # prefill frames take the regular path
    got += [run_chain(stages, "s", p, sequence[p : p + 1]) for p in range(prefill, length)]
    assert max_diff(torch.cat(got), want) <= TOLERANCE
    graph = stages[1]._sessions._sessions["s"].decode_graph  # noqa: SLF001
    assert isinstance(graph, DecodeGraph) and graph.capacity > CAPACITY_STEP_TOKENS
    assert stages[1].graph_frames == {"session": length - prefill, "bucket": 0}

    # Rewind ten positions and decode them again: the same logits.
    again = [run_chain(stages, "s", p, sequence[p : p + 1]) for p in range(length - 10, length)]
    assert max_diff(torch.cat(again), want[length - 10 :]) <= TOLERANCE

    # A session whose every frame is one token, from position 0.
    single = [run_chain(stages, "one", p, sequence[p : p + 1]) for p in range(12)]
    assert max_diff(torch.cat(single), want[:12]) <= TOLERANCE


def test_static_decode_keeps_sessions_apart() -> None:
    model = tiny_model("llama")
    stages = static_chain(model)
    first, second = tokens(20, seed=5), tokens(20, seed=6)
    run_chain(stages, "a", 0, first[:10])
    run_chain(stages, "b", 0, second[:10])
    steps_a, steps_b = [], []
    for p in range(10, 20):
        steps_a.append(run_chain(stages, "a", p, first[p : p + 1]))
        steps_b.append(run_chain(stages, "b", p, second[p : p + 1]))
    assert max_diff(torch.cat(steps_a), full_logits(model, first)[10:]) <= TOLERANCE
    assert max_diff(torch.cat(steps_b), full_logits(model, second)[10:]) <= TOLERANCE
    stages[0].disable_graphs()
    assert stages[0]._sessions._sessions["a"].decode_graph is None  # noqa: SLF001


def test_cuda_graphs_need_a_cuda_device(caplog: pytest.LogCaptureFixture) -> None:
    stage = chain(tiny_model("llama"))[0]
    with caplog.at_level(logging.WARNING):
        assert stage.enable_cuda_graphs() is False
    assert not stage.cuda_graphs
    assert "CUDA graphs need a CUDA device" in caplog.text
    with pytest.raises(ValueError, match="CUDA device"):
        stage.use_static_decode(capture=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_replays_match_eager_decode_on_a_gpu() -> None:
    model = tiny_model("llama")
    stages = chain(model, device="cuda")
    for stage in stages:
        assert stage.enable_cuda_graphs()
    sequence = tokens(40, seed=8)
    got = [run_chain(stages, "g", 0, sequence[:20])]
    got += [run_chain(stages, "g", p, sequence[p : p + 1]) for p in range(20, 40)]
    assert all(stage.cuda_graphs for stage in stages)
    graph = stages[0]._sessions._sessions["g"].decode_graph  # noqa: SLF001
    assert graph is not None and graph.graph is not None
    assert max_diff(torch.cat(got).cpu(), full_logits(model, sequence)) <= 1e-3


def test_the_load_time_check_turns_a_disagreeing_step_off(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    stages = static_chain(tiny_model("llama"))
    for stage in stages:
        assert stage.check_graphs()  # the same arithmetic: stays on
        assert stage.sessions() == []
    original = StaticDecode.run

    def skewed(self: StaticDecode) -> torch.Tensor:
        return original(self) + 1.0

    monkeypatch.setattr(StaticDecode, "run", skewed)
    with caplog.at_level(logging.WARNING):
        assert not stages[1].check_graphs()
    assert "differs from the eager step" in caplog.text
    assert stages[1]._graph_capture is None  # noqa: SLF001
    assert stages[1].sessions() == []


def test_loading_with_cuda_graphs_on_a_cpu_runs_eagerly(
    tiny_model_factory: Callable[..., Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    package = package_of(tiny_model_factory("llama", layers=LAYERS), tmp_path / "pkg")
    with caplog.at_level(logging.WARNING):
        runtime = load_stage_runtime(package, LayerRange(0, LAYERS), cuda_graphs=True)
    assert not runtime.cuda_graphs
    assert "CUDA graphs need a CUDA device" in caplog.text
    logits = runtime.forward("s", 0, tokens(3, seed=1))
    assert logits.shape == (3, runtime.vocab_size)


def batch_chain(stages: list[StageRuntime], spans: list[Span], inputs: torch.Tensor) -> list:
    """Each span's last-stage logits (or its error) after a batched frame through the
    chain, in span order."""
    live = list(range(len(spans)))
    errors: dict[int, Exception] = {}
    activations = inputs
    for stage in stages:
        out = stage.forward_batch([spans[i] for i in live], activations)
        errors.update({live[local]: error for local, error in out.errors.items()})
        if stage.is_last:
            return [errors[i] if i in errors else out.of(live.index(i)) for i in range(len(spans))]
        live = [i for local, i in enumerate(live) if local not in out.errors]
        activations = out.rows
    raise AssertionError("no last stage")


@pytest.mark.parametrize(
    ("family", "overrides", "how"),
    [
        ("llama", {}, "batched"),
        ("qwen3", {}, "batched"),
        ("mistral", {"sliding_window": 6, "layer_types": None}, "batched"),
        ("llama", {}, "gathered layer by layer"),
        ("qwen3", {}, "per session (over the gather limit)"),
        ("mistral", {"sliding_window": 6, "layer_types": None}, "row-invariant"),
        ("gemma3", {}, "batched"),
        ("gemma2", {}, "per session (capped scores)"),
        ("glm", {}, "batched"),
    ],
)
def test_decode_frames_of_several_sessions_run_by_bucket_as_alone(
    family: str, overrides: dict, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Frames of 2..9 sessions' decode rows go through the step of their bucket (2, 4,
    8, 16), padded, and every session gets the logits of the unsplit model; sessions
    at different positions, one rewound, one new (position 0), a session in two
    buckets in a row. Attention batched over the sessions (its history gathered for
    all layers at once, or a layer at a time), or per session (a gather over its
    limit; row-invariant stages)."""
    if how == "gathered layer by layer":
        monkeypatch.setattr(batch_graphs, "GATHER_BYTES", 1)
    if how.startswith("per session"):
        monkeypatch.setattr(batch_graphs, "LAYER_GATHER_LIMIT", 1)
    if how == "row-invariant":
        monkeypatch.setattr(invariant, "MODE", "on")
    batched_steps: list[int] = []
    write_back = FrameAttention.write_back

    def counted(self: FrameAttention) -> None:
        batched_steps.append(len(self.caches))
        write_back(self)

    monkeypatch.setattr(FrameAttention, "write_back", counted)
    model = tiny_model(family, **overrides)
    stages = static_chain(model)
    assert all(stage.row_invariant == (how == "row-invariant") for stage in stages)
    count = 10
    sequences = [tokens(40, seed=30 + i) for i in range(count)]
    wants = [full_logits(model, sequence) for sequence in sequences]
    held = {count - 1: 0}
    for i, sequence in enumerate(sequences[:-1]):
        held[i] = 5 + 2 * i
        run_chain(stages, f"s{i}", 0, sequence[: held[i]])
    rounds = [[0, 1], [0, 1, 2], list(range(5)), list(range(10)), [3, 8], list(range(6))]
    for step, members in enumerate(rounds):
        if step == 4:
            held[3] -= 3  # a rewind: the next frame crops it
        spans = [Span(f"s{i}", held[i], 1) for i in members]
        inputs = torch.stack([sequences[i][held[i]] for i in members])
        got = batch_chain(stages, spans, inputs)
        for i, logits in zip(members, got, strict=True):
            assert max_diff(logits, wants[i][held[i] : held[i] + 1]) <= TOLERANCE, (step, i)
            held[i] += 1
    assert stages[0]._batch_graphs.buckets() == [2, 4, 8, 16]  # noqa: SLF001
    assert bool(batched_steps) == (how in ("batched", "gathered layer by layer"))
    assert stages[1].graph_frames["bucket"] == len(rounds)


@pytest.mark.parametrize(
    ("family", "overrides", "how"),
    [
        ("llama", {}, "batched"),
        ("qwen3", {}, "batched"),
        ("mistral", {"sliding_window": 5, "layer_types": None}, "batched"),
        ("mistral", {"sliding_window": 5, "layer_types": None}, "gathered layer by layer"),
        ("llama", {}, "row-invariant"),
    ],
)
def test_mixed_frames_of_windows_and_prompt_chunks_run_by_bucket_as_alone(
    family: str, overrides: dict, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Frames of up to 32 rows mixing decode tokens, verify windows of 2-7 tokens,
    rewinds and a new session's whole prompt, in random order, go through the step of
    their row count's bucket; every row's logits equal the unsplit model's. A frame
    of one session's window takes its bucket too; one over 32 rows runs eagerly."""
    if how == "gathered layer by layer":
        monkeypatch.setattr(batch_graphs, "GATHER_BYTES", 1)
    if how == "row-invariant":
        monkeypatch.setattr(invariant, "MODE", "on")
    model = tiny_model(family, **overrides)
    stages = static_chain(model)
    rng = random.Random(7)
    sequences = {f"m{i}": tokens(60, seed=60 + i) for i in range(6)}
    wants = {name: full_logits(model, sequence) for name, sequence in sequences.items()}
    held = {name: 0 for name in sequences}
    for name in list(sequences)[:4]:
        held[name] = rng.randint(3, 12)
        run_chain(stages, name, 0, sequences[name][: held[name]])
    for step in range(14):
        names = rng.sample(sorted(sequences), rng.randint(1, len(sequences)))
        spans, inputs = [], []
        for name in names:
            at = max(0, held[name] - rng.choice([0, 0, 0, 2]))  # some rewind
            count = 1 if at else rng.randint(4, 9)  # a new session: its whole prompt
            if at and rng.random() < 0.5:
                count = rng.randint(2, 7)  # a verify window
            count = min(count, 60 - at)
            spans.append(Span(name, at, count))
            inputs.append(sequences[name][at : at + count])
        frame = torch.cat(inputs)
        got = batch_chain(stages, spans, frame)
        for span, logits in zip(spans, got, strict=True):
            want = wants[span.session_id][span.pos_start : span.pos_start + span.count]
            assert max_diff(logits, want) <= TOLERANCE, (step, span)
            held[span.session_id] = span.pos_start + span.count
    buckets = stages[1]._batch_graphs.buckets()  # noqa: SLF001
    assert len(buckets) >= 3, buckets
    # One session's window alone, and a frame over the largest bucket.
    window = Span("m0", held["m0"], 5)
    got = batch_chain(stages, [window], sequences["m0"][held["m0"] : held["m0"] + 5])
    assert max_diff(got[0], wants["m0"][held["m0"] : held["m0"] + 5]) <= TOLERANCE
    long = tokens(40, seed=99)
    got = batch_chain(stages, [Span("long", 0, 40)], long)
    assert max_diff(got[0], full_logits(model, long)) <= TOLERANCE


def test_a_bad_segment_is_refused_alone_in_a_bucketed_frame() -> None:
    model = tiny_model("llama")
    stages = static_chain(model)
    first, second = tokens(20, seed=40), tokens(20, seed=41)
    run_chain(stages, "a", 0, first[:10])
    run_chain(stages, "b", 0, second[:10])
    spans = [Span("a", 10, 1), Span("ghost", 3, 1, creates=False), Span("b", 10, 1)]
    got = batch_chain(stages, spans, torch.stack([first[10], first[0], second[10]]))
    assert "holds no session" in str(got[1])
    assert max_diff(got[0], full_logits(model, first)[10:11]) <= TOLERANCE
    assert max_diff(got[2], full_logits(model, second)[10:11]) <= TOLERANCE


def test_last_stage_rows_without_logits_in_a_bucketed_frame() -> None:
    """A decode row that wants no logits (``logit_rows=0``) gets none; the others do."""
    model = tiny_model("llama")
    stage = chain(model)[0]
    whole = build_stage_runtime(
        model.config,
        StateDictWeights(model.state_dict(), tied=model.config.tie_word_embeddings),
        LayerRange(0, LAYERS),
    )
    whole.use_static_decode(capture=False)
    assert stage.is_first and whole.is_last
    sequence = tokens(12, seed=42)
    for name in ("x", "y", "z"):
        whole.forward(name, 0, sequence[:8])
    spans = [Span("x", 8, 1), Span("y", 8, 1, logit_rows=0), Span("z", 8, 1)]
    out = whole.forward_batch(spans, sequence[8:9].repeat(3))
    want = full_logits(model, sequence)[8:9]
    assert out.of(1).shape[0] == 0
    assert max_diff(out.of(0), want) <= TOLERANCE and max_diff(out.of(2), want) <= TOLERANCE


def test_the_load_time_check_fits_a_stage_of_one_session(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stage that may hold one session checks a frame of that session's two tokens
    instead of two sessions' frame; a skewed bucket step still turns graphs off."""
    model = tiny_model("llama")
    weights = StateDictWeights(model.state_dict(), tied=model.config.tie_word_embeddings)
    stage = build_stage_runtime(model.config, weights, SPLITS[2][1], max_sessions=1)
    stage.use_static_decode(capture=False)
    assert stage.check_graphs() and stage.sessions() == []
    assert stage.graph_frames["bucket"] == 1  # the replayed frame (the eager one runs apart)
    original = batch_graphs.BucketStep.__call__

    def skewed(self, *args):  # noqa: ANN001, ANN202
        return original(self, *args) + 1.0

    monkeypatch.setattr(batch_graphs.BucketStep, "__call__", skewed)
    assert not stage.check_graphs()
    assert stage._batch_graphs is None and stage.sessions() == []  # noqa: SLF001


def test_sparse_experts_keep_batched_decode_eager() -> None:
    stages = chain(tiny_model("qwen3_moe"))
    stages[0].use_static_decode(capture=False)
    assert stages[0]._batch_graphs is None  # noqa: SLF001


def test_buckets() -> None:
    assert [bucket_for(n) for n in (1, 2, 3, 4, 5, 9, 32, 33)] == [2, 2, 4, 4, 8, 16, 32, None]
    # Gathered keys come in blocks, so frames of neighbouring lengths share shapes.
    assert [key_length(n) for n in (1, 63, 64, 65, 200)] == [64, 64, 64, 128, 256]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_cuda_stage_keeps_attention_off_the_per_shape_cudnn_backend() -> None:
    model = tiny_model("llama")
    weights = StateDictWeights(model.state_dict(), tied=model.config.tie_word_embeddings)
    torch.backends.cuda.enable_cudnn_sdp(True)
    build_stage_runtime(model.config, weights, SPLITS[2][0], device="cuda", dtype="bfloat16")
    assert not torch.backends.cuda.cudnn_sdp_enabled()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bucketed_cuda_graphs_match_eager_frames_on_a_gpu(dtype: str) -> None:
    model = tiny_model("llama")
    weights = StateDictWeights(model.state_dict(), tied=model.config.tie_word_embeddings)
    graphed = [
        build_stage_runtime(model.config, weights, r, device="cuda", dtype=dtype) for r in SPLITS[2]
    ]
    eager = [
        build_stage_runtime(model.config, weights, r, device="cuda", dtype=dtype) for r in SPLITS[2]
    ]
    for stage in graphed:
        assert stage.enable_cuda_graphs() and stage.check_graphs()
    sequences = [tokens(50, seed=50 + i) for i in range(6)]
    for stages in (graphed, eager):
        for i, sequence in enumerate(sequences):
            run_chain(stages, f"s{i}", 0, sequence[:10])
    tolerance = 1e-3 if dtype == "float32" else 5e-2
    held = dict.fromkeys(range(6), 10)
    for step in range(12):
        # Decode frames of 3 or 6 sessions, and frames mixing windows of 3 tokens.
        members = range(6) if step % 4 else range(3)
        counts = {i: 3 if step % 2 and i % 2 else 1 for i in members}
        spans = [Span(f"s{i}", held[i], counts[i]) for i in members]
        inputs = torch.cat([sequences[i][held[i] : held[i] + counts[i]] for i in members])
        got = batch_chain(graphed, spans, inputs)
        want = batch_chain(eager, spans, inputs)
        scale = max(torch.cat(want).abs().max().item(), 1.0)
        assert max_diff(torch.cat(got), torch.cat(want)) <= tolerance * scale, step
        for i in members:
            held[i] += counts[i]
    step = graphed[1]._batch_graphs.step_for(6)  # noqa: SLF001
    assert step is not None and step.captured and all(s.cuda_graphs for s in graphed)
