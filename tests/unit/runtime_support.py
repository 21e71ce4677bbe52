"""Helpers shared by the runtime tests: packages of tiny models, chains of stages."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import torch
from conftest import TINY_FAMILIES, reference_attention
from transformers import AutoModelForCausalLM, PreTrainedModel

from mesh.package.builder import build_package
from mesh.runtime import Span, StageRuntime, load_stage_runtime
from mesh.types import LayerRange

# Every family tiny_config builds (tests/conftest.py).
FAMILIES = TINY_FAMILIES
LAYERS = 6
# A vision tower as small as transformers allows, for multimodal checkpoints whose
# language model is packaged alone (mesh/package/textonly.py).
TINY_VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    image_size=28,
    patch_size=14,
)
SPLITS: dict[int, tuple[LayerRange, ...]] = {
    1: (LayerRange(0, 6),),
    2: (LayerRange(0, 3), LayerRange(3, 6)),
    3: (LayerRange(0, 1), LayerRange(1, 4), LayerRange(4, 6)),
}


def reference_model(model_dir: Path, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, **reference_attention(model_dir)
    )
    return model.eval()


def package_of(model_dir: Path, out: Path) -> Path:
    """A model package built from an HF directory with the package builder."""
    if not (out / "model-package.json").is_file():
        build_package(str(model_dir), out)
    return out


def load_chain(package_dir: Path, ranges: Sequence[LayerRange], **kwargs) -> list[StageRuntime]:
    return [load_stage_runtime(package_dir, layer_range, **kwargs) for layer_range in ranges]


def run_chain(
    stages: Sequence[StageRuntime], session_id: str, pos_start: int, token_ids: torch.Tensor
) -> torch.Tensor:
    """Pass a frame through every stage in order; the last stage's logits come back."""
    activations = token_ids
    for stage in stages:
        activations = stage.forward(session_id, pos_start, activations)
    return activations


def full_logits(model: PreTrainedModel, token_ids: torch.Tensor) -> torch.Tensor:
    """The unsplit model's logits ``[T, vocab]`` for a whole sequence, no cache."""
    with torch.inference_mode():
        return model(token_ids.unsqueeze(0), use_cache=False).logits[0].float()


def max_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape, (got.shape, want.shape)
    return (got - want).abs().max().item()


def run_batch(stages: list[StageRuntime], spans: list[Span], ids: torch.Tensor) -> list:
    """Each span's logits (or its error) after the chain, in span order."""
    activations = ids
    live = list(range(len(spans)))
    errors: dict[int, Exception] = {}
    for stage in stages:
        out = stage.forward_batch([spans[i] for i in live], activations)
        for local, error in out.errors.items():
            errors[live[local]] = error
        kept = [i for local, i in enumerate(live) if local not in out.errors]
        if stage.is_last:
            return [
                errors.get(i) if i in errors else out.of(live.index(i)) for i in range(len(spans))
            ]
        activations = out.rows
        live = kept
    raise AssertionError("no last stage")


def batch_round(
    rng: random.Random, lengths: dict[str, int], tokens: dict[str, torch.Tensor]
) -> list[tuple[str, int, int]]:
    """(session, pos_start, count) per session: prefill chunks, decode steps, verify
    windows and crops (pos_start below the held length), in random order."""
    plan = []
    for session in rng.sample(sorted(lengths), k=len(lengths)):
        held = lengths[session]
        kind = rng.choice(["prefill", "decode", "verify", "crop"]) if held else "prefill"
        if kind == "prefill":
            start, count = held, rng.randint(2, 9)
        elif kind == "decode":
            start, count = held, 1
        elif kind == "verify":
            start, count = held, rng.randint(2, 6)
        else:
            start, count = rng.randint(1, held), rng.randint(1, 4)
        count = min(count, tokens[session].shape[0] - start)
        if count > 0:
            plan.append((session, start, count))
    return plan
