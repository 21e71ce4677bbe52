"""Rotary angles: the lookup table matches the model's own rotary module, and stages
follow HF for the rope types that scale their angles."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_config
from runtime_support import LAYERS, SPLITS, full_logits, max_diff, run_chain
from transformers import AutoModelForCausalLM, LlamaConfig

from mesh.runtime import StateDictWeights, build_stage_runtime
from mesh.runtime.block import rotate_into
from mesh.runtime.rotary import TABLE_STEP_POSITIONS, RotaryAngles, signed_sin

ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
        "rope_theta": 500000.0,
    },
    "dynamic": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
}


def llama_with_rope(rope: str) -> AutoModelForCausalLM:
    base = tiny_config("llama", layers=LAYERS, vocab_size=512).to_dict()
    base["rope_parameters"] = ROPES[rope]
    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**base)).eval()
    model.config.architectures = [type(model).__name__]
    return model


def rotary_module(rope: str) -> torch.nn.Module:
    model = llama_with_rope(rope)
    return model.model.rotary_emb


def reference_angles(module: torch.nn.Module, start: int, end: int) -> tuple:
    positions = torch.arange(start, end).unsqueeze(0)
    cos, sin = module(torch.empty(0), positions)
    return cos[0].unsqueeze(1), sin[0].unsqueeze(1)


@pytest.mark.parametrize("rope", ["default", "linear", "llama3"])
def test_the_table_holds_exactly_what_the_module_computes(rope: str) -> None:
    module = rotary_module(rope)
    angles = RotaryAngles(module, torch.float32, torch.device("cpu"))
    assert angles.static
    # Frames inside the first table, then one that makes it grow past a step.
    for start, count in [(0, 7), (7, 1), (100, 3), (TABLE_STEP_POSITIONS - 2, 5), (400, 1)]:
        cos, sin = angles(start, count)
        want_cos, want_sin = reference_angles(module, start, start + count)
        assert cos.shape == (count, 1, want_cos.shape[-1])
        assert torch.equal(cos, want_cos)
        assert torch.equal(sin, signed_sin(want_sin))


def test_dynamic_rope_is_computed_per_frame() -> None:
    assert not RotaryAngles(rotary_module("dynamic"), torch.float32, torch.device("cpu")).static


def test_rotating_with_the_folded_sign_matches_rotate_half() -> None:
    generator = torch.Generator().manual_seed(3)
    states = torch.randn(5, 6, 16, generator=generator)
    cos, sin = torch.randn(2, 5, 1, 16, generator=generator)
    rotated = torch.cat((-states[..., 8:], states[..., :8]), dim=-1)
    want = states * cos + rotated * sin
    out = torch.empty_like(states)
    rotate_into(out, states, cos, signed_sin(sin))
    assert torch.allclose(out, want, atol=1e-6)
    in_place = states.clone()
    rotate_into(in_place, in_place, cos, signed_sin(sin))
    assert torch.equal(in_place, out)


@pytest.mark.parametrize("rope", sorted(ROPES))
def test_stages_follow_hf_for_each_rope_type(rope: str) -> None:
    model = llama_with_rope(rope)
    weights = StateDictWeights(model.state_dict(), tied=model.config.tie_word_embeddings)
    stages = [build_stage_runtime(model.config, weights, r) for r in SPLITS[2]]
    length = TABLE_STEP_POSITIONS + 12
    sequence = torch.randint(0, 512, (length,), generator=torch.Generator().manual_seed(9))
    prefill = TABLE_STEP_POSITIONS - 3
    got = [run_chain(stages, "r", 0, sequence[:prefill])]
    got += [run_chain(stages, "r", pos, sequence[pos : pos + 1]) for pos in range(prefill, length)]
    assert max_diff(torch.cat(got), full_logits(model, sequence)) <= 1e-4
