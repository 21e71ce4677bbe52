"""A stage's layers in one call of the C loop (mesh/runtime/native_layers.py): chosen
for bfloat16 stages whose linears are all on the quantised kernels, and giving the
layer-by-layer Python path's logits for frames mixing prompt chunks, decode steps,
verify windows and crops."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from runtime_support import SPLITS, load_chain

from mesh.runtime import Span, StageRuntime, invariant, native, qkernels

VOCAB = 49152

pytestmark = pytest.mark.skipif(
    native.library() is None,
    reason="the stage's C kernels need x86-64 with AVX-512 VNNI and a C compiler",
)

FORMATS = {
    "int4": {"dtype": "bfloat16", "quant": "int4", "group_size": 32},
    "int8": {"dtype": "bfloat16", "quant": "int8"},
}


@pytest.fixture(autouse=True)
def kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(invariant, "MODE", "auto")
    monkeypatch.setattr(qkernels, "MODE", "auto")


def run_frames(stages: list[StageRuntime], seed: str) -> list[torch.Tensor]:
    """Eight frames of random segments of four sessions through the stages; the last
    stage's output of each frame."""
    rng = random.Random(seed)
    sessions = [f"s{i}" for i in range(4)]
    tokens = {
        s: torch.randint(0, VOCAB, (80,), generator=torch.Generator().manual_seed(i))
        for i, s in enumerate(sessions)
    }
    held = dict.fromkeys(sessions, 0)
    outputs = []
    for _ in range(8):
        plan = []
        for session in rng.sample(sessions, k=rng.randint(1, len(sessions))):
            start = rng.randint(max(0, held[session] - 3), held[session]) if held[session] else 0
            count = min(rng.choice([1, 1, 3, 7, 16]), len(tokens[session]) - start)
            if count > 0:
                plan.append((session, start, count))
                held[session] = start + count
        spans = [Span(s, start, count) for s, start, count in plan]
        activations: torch.Tensor = torch.cat(
            [tokens[s][start : start + count] for s, start, count in plan]
        )
        for stage in stages:
            out = stage.forward_batch(spans, activations)
            assert not out.errors
            activations = out.rows
        outputs.append(activations)
    return outputs


@pytest.mark.parametrize("stage_count", [1, 2])
@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_c_loop_gives_the_python_path_logits(
    tiny_package_factory: Callable[..., Path], family: str, fmt: str, stage_count: int
) -> None:
    package = tiny_package_factory(family, **FORMATS[fmt])
    fused = load_chain(package, SPLITS[stage_count])
    python = load_chain(package, SPLITS[stage_count])
    assert all(stage.native_layers for stage in fused)
    assert not any(stage.set_native_layers(False) for stage in python)
    got = run_frames(fused, f"{family}-{fmt}-{stage_count}")
    want = run_frames(python, f"{family}-{fmt}-{stage_count}")
    for frame, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.shape == b.shape
        # The same rounding at every step; only SiLU's exp is the loop's own, so allow
        # a rare neighbouring bfloat16 and require the same greedy tokens.
        assert torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2), frame
        assert torch.equal(a.argmax(-1), b.argmax(-1)), frame
        assert (a != b).float().mean().item() < 0.01, frame


@pytest.mark.parametrize(
    ("family", "fmt", "chosen"),
    [
        ("llama", {"dtype": "bfloat16", "quant": "int4", "group_size": 32}, True),
        ("llama", {"dtype": "bfloat16", "quant": "int8"}, True),
        ("llama", {"dtype": "float32"}, False),
        ("llama", {"dtype": "bfloat16"}, False),
        # Linear biases (Qwen2's q/k/v) are added in the loop.
        ("qwen2", {"dtype": "bfloat16", "quant": "int8"}, True),
        # q/k norms and experts stay on the Python path.
        ("qwen3", {"dtype": "bfloat16", "quant": "int4", "group_size": 32}, False),
        ("qwen3_moe", {"dtype": "bfloat16", "quant": "int4", "group_size": 32}, False),
    ],
)
def test_the_c_loop_is_chosen_by_the_layers_alone(
    tiny_package_factory: Callable[..., Path], family: str, fmt: dict, chosen: bool
) -> None:
    stage = load_chain(tiny_package_factory(family, **fmt), SPLITS[1])[0]
    assert stage.native_layers is chosen


def test_torch_kernels_keep_the_python_path(
    tiny_package_factory: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(qkernels, "MODE", "torch")
    stage = load_chain(tiny_package_factory("llama", **FORMATS["int4"]), SPLITS[1])[0]
    assert not stage.native_layers
