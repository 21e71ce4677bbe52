"""The runtime on a CUDA device, for every supported family: a 2-stage split gives
the unsplit model's logits (a prompt, a verify window, decode steps across a KV
buffer growth, a rewind) with eager kernels and with CUDA graphs (one session's
step and the bucketed frames); a batched frame gives every segment the logits it
gets alone; in bfloat16 the replayed frames agree with the eager ones; the
quantised linears compute their dequantised weights' products.

Skipped without a GPU. ``MESH_TEST_DEVICE=cpu`` runs the same checks on the CPU
(the graph steps then run eagerly: their arithmetic, not their capture), which is
how they are checked before they reach a GPU."""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import tiny_config
from runtime_support import (
    FAMILIES,
    LAYERS,
    SPLITS,
    batch_round,
    full_logits,
    load_chain,
    max_diff,
    package_of,
    reference_model,
    run_batch,
    run_chain,
)
from transformers import AutoModelForCausalLM

from mesh import quant
from mesh.runtime import Span, StageRuntime
from mesh.runtime.linear import DenseLinear, Int4Linear, Int8Linear, LinearSpec, build_linear
from mesh.runtime.sessions import CAPACITY_STEP_TOKENS

DEVICE = os.environ.get("MESH_TEST_DEVICE", "cuda")
ON_GPU = DEVICE.startswith("cuda")
pytestmark = pytest.mark.skipif(
    ON_GPU and not torch.cuda.is_available(), reason="needs a CUDA GPU (or MESH_TEST_DEVICE=cpu)"
)
VOCAB = 512
# Relative to the logits' magnitude: a GPU's float32 kernels sum in other orders than
# the CPU's (the reference runs on the CPU).
FLOAT32_TOLERANCE = 1e-3
# Replayed bfloat16 frames against eager ones: rounding differs (a masked, padded key
# range against the exact one).
BFLOAT16_TOLERANCE = 5e-2
SPARSE = {"qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple]:
    """(reference model on the CPU, package directory) per family, built once. No
    tokenizer: the runtime needs none, and a GPU machine may lack SmolLM2's."""
    cache: dict[str, tuple] = {}

    def get(family: str) -> tuple:
        if family not in cache:
            torch.manual_seed(3)
            model = AutoModelForCausalLM.from_config(
                tiny_config(family, layers=LAYERS, vocab_size=VOCAB)
            )
            with torch.no_grad():
                for name, param in model.named_parameters():
                    # Gemma's norms scale by 1 + weight and start at 0; a router's
                    # choice bias starts at 0: random ones, so both are exercised.
                    if family.startswith("gemma") and "norm" in name:
                        param.normal_(0.0, 0.3)
                for name, buffer in model.named_buffers():
                    if name.endswith("e_score_correction_bias"):
                        buffer.normal_(0.0, 0.5)
            model.config.architectures = [type(model).__name__]
            root = tmp_path_factory.mktemp(f"cuda-{family}")
            model.save_pretrained(root / "model")
            package = package_of(root / "model", root / "pkg")
            cache[family] = (reference_model(root / "model"), package)
        return cache[family]

    return get


def chain(package: Path, dtype: str, graphs: bool, family: str) -> list[StageRuntime]:
    if ON_GPU:
        stages = load_chain(package, SPLITS[2], device=DEVICE, dtype=dtype, cuda_graphs=graphs)
        # The check at load passed: replays agree with eager steps. Routed experts
        # pick their rows from the data, which a graph cannot capture: those stages
        # turn graphs off at load (with a logged reason) and run eagerly.
        assert all(stage.cuda_graphs for stage in stages) == (graphs and family not in SPARSE)
        return stages
    stages = load_chain(package, SPLITS[2], device=DEVICE, dtype=dtype)
    if graphs:
        for stage in stages:
            stage.use_static_decode(capture=False)
    return stages


def tokens(count: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (count,), generator=torch.Generator().manual_seed(seed))


def close(got: torch.Tensor, want: torch.Tensor, tolerance: float) -> bool:
    scale = max(want.abs().max().item(), 1.0)
    return max_diff(got.float().cpu(), want.float().cpu()) <= tolerance * scale


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_split_on_the_device_gives_the_unsplit_model_s_logits(
    tiny: Callable[[str], tuple], family: str, graphs: bool
) -> None:
    model, package = tiny(family)
    stages = chain(package, "float32", graphs, family)
    length = CAPACITY_STEP_TOKENS + 6
    sequence = tokens(length, seed=8)
    want = full_logits(model, sequence)
    got = [run_chain(stages, "s", 0, sequence[:10])]
    got.append(run_chain(stages, "s", 10, sequence[10:14]))  # a verify window
    got += [run_chain(stages, "s", p, sequence[p : p + 1]) for p in range(14, length)]
    assert close(torch.cat(got), want, FLOAT32_TOLERANCE)
    # Rewind: a window replacing the last 8 positions, then a decode step.
    cut = length - 8
    other = torch.cat([sequence[:cut], tokens(4, seed=9)])
    want_other = full_logits(model, other)
    replaced = run_chain(stages, "s", cut, other[cut : cut + 3])
    after = run_chain(stages, "s", cut + 3, other[cut + 3 : cut + 4])
    assert close(torch.cat([replaced, after]), want_other[cut:], FLOAT32_TOLERANCE)
    if graphs:
        assert (stages[1].graph_frames["session"] > 0) == (family not in SPARSE or not ON_GPU)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_batched_frame_on_the_device_gives_each_segment_its_logits_alone(
    tiny: Callable[[str], tuple], family: str, graphs: bool
) -> None:
    _, package = tiny(family)
    batched = chain(package, "float32", graphs, family)
    alone = chain(package, "float32", graphs, family)
    rng = random.Random(f"cuda-{family}")
    sessions = [f"s{i}" for i in range(5)]
    sequences = {s: tokens(60, seed=20 + i) for i, s in enumerate(sessions)}
    lengths = dict.fromkeys(sessions, 0)
    for _ in range(6):
        plan = batch_round(rng, lengths, sequences)
        spans = [Span(s, start, count) for s, start, count in plan]
        ids = torch.cat([sequences[s][start : start + count] for s, start, count in plan])
        got = run_batch(batched, spans, ids)
        for (session, start, count), logits in zip(plan, got, strict=True):
            want = run_chain(alone, session, start, sequences[session][start : start + count])
            assert close(logits, want, FLOAT32_TOLERANCE), (session, start, count)
            lengths[session] = start + count
    if graphs:
        assert (batched[1].graph_frames["bucket"] > 0) == (family not in SPARSE)


@pytest.mark.skipif(not ON_GPU, reason="compares replayed CUDA graphs with eager frames")
@pytest.mark.parametrize("family", sorted(set(FAMILIES) - SPARSE))
def test_replayed_bfloat16_frames_agree_with_eager_ones(
    tiny: Callable[[str], tuple], family: str
) -> None:
    """Frames of 3 or 6 sessions mixing decode tokens and windows of 3, replayed by
    bucket, against the same frames on eager kernels."""
    _, package = tiny(family)
    graphed = chain(package, "bfloat16", True, family)
    eager = chain(package, "bfloat16", False, family)
    sequences = [tokens(50, seed=50 + i) for i in range(6)]
    for stages in (graphed, eager):
        for i, sequence in enumerate(sequences):
            run_chain(stages, f"s{i}", 0, sequence[:10])
    held = dict.fromkeys(range(6), 10)
    for step in range(12):
        members = range(6) if step % 4 else range(3)
        counts = {i: 3 if step % 2 and i % 2 else 1 for i in members}
        spans = [Span(f"s{i}", held[i], counts[i]) for i in members]
        inputs = torch.cat([sequences[i][held[i] : held[i] + counts[i]] for i in members])
        got = run_batch(graphed, spans, inputs)
        want = run_batch(eager, spans, inputs)
        assert close(torch.cat(got), torch.cat(want), BFLOAT16_TOLERANCE), step
        for i in members:
            held[i] += counts[i]
    assert graphed[1].graph_frames["bucket"] > 0


@pytest.mark.parametrize("rows", [1, 3, 8, 32, 40])
@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_quantised_linears_on_the_device_multiply_by_their_dequantised_weights(
    kind: str, rows: int
) -> None:
    """A weight the CUDA int4 layout takes whole (K a multiple of 128), and int8."""
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(256, 1536, generator=generator) * 0.05
    bias = torch.randn(256, generator=generator) * 0.1
    if kind == "int4":
        parts = quant.quantize_int4(weight, 32)
        dequantised = quant.dequantize_int4(parts, torch.float32)
    else:
        parts = quant.quantize_int8(weight)
        dequantised = quant.dequantize_int8(parts, torch.float32)
    spec = LinearSpec(256, 1536, kind, parts=parts, bias=bias)
    linear = build_linear(spec, torch.device(DEVICE), torch.bfloat16)
    if ON_GPU:
        assert isinstance(linear, Int4Linear if kind == "int4" else Int8Linear)
    else:
        assert not isinstance(linear, DenseLinear)
    inputs = torch.randn(rows, 1536, generator=generator).to(torch.bfloat16)
    got = linear(inputs.to(DEVICE)).float().cpu()
    want = inputs.float() @ dequantised.t() + bias
    assert got.shape == (rows, 256)
    # bfloat16 activations and outputs: about 3 significant digits.
    assert close(got, want, 2e-2)
