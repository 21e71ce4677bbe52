"""GGUF mixture-of-experts models (Qwen3-MoE, and Mixtral as llama.cpp writes it: a
``llama`` file with experts): the stacked expert tensors become one package weight
per expert, read one expert's rows at a time, and the package computes what
transformers computes with those weights."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from runtime_support import full_logits, max_diff
from transformers import AutoConfig, AutoModelForCausalLM

from mesh.package import weight_store
from mesh.package.builder import build_package
from mesh.package.gguf_file import GgufModel
from mesh.package.synthetic_gguf import LlamaShape, write_llama_gguf
from mesh.package.tensors import load_hf_state_dict
from mesh.runtime import load_stage_runtime
from mesh.types import LayerRange

COMMON = dict(hidden=64, intermediate=128, heads=4, kv_heads=2, vocab=512, layers=3)
MOE = dict(experts=4, experts_used=2, expert_intermediate=32)
SHAPES = {
    # Layer 1 keeps a dense FFN, as Qwen3-MoE's mlp_only_layers allow.
    "qwen3moe": LlamaShape(**COMMON, **MOE, qk_norm=True, head_dim=16, dense_layers=(1,)),
    # Qwen2-MoE: q/k/v biases, a shared expert beside the routed ones.
    "qwen2moe": LlamaShape(**COMMON, **MOE, attn_bias=True, shared_expert_intermediate=64),
    "llama": LlamaShape(**COMMON, **MOE),
}
ARCHITECTURES = {
    "qwen3moe": "Qwen3MoeForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "llama": "MixtralForCausalLM",
}
TYPES = ("Q4_0", "Q8_0", "F16", "Q4_1")


def mixed_types(name: str, layer: int | None, shape: LlamaShape) -> str:
    if name.endswith("norm.weight") or ".ffn_gate_inp." in name:
        return "F32"
    return TYPES[(len(name) + (layer or 0)) % len(TYPES)]


def q4_0_experts(name: str, layer: int | None, shape: LlamaShape) -> str:
    return "Q4_0" if "_exps." in name else mixed_types(name, layer, shape)


def gguf_floats(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a GGUF dequantised whole by the gguf package (torch order)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    return {
        t.name: torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
        for t in reader.tensors
    }


def hf_model_of(package: Path) -> torch.nn.Module:
    """transformers' model of the package's config holding the package's weights
    (experts stacked back the way transformers holds them)."""
    config = AutoConfig.from_pretrained(package)
    state = load_hf_state_dict(package)
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}.mlp.experts."
        if prefix + "0.gate_proj.weight" not in state:
            continue
        experts = range(sum(1 for name in state if name.startswith(prefix)) // 3)
        take = [
            {p: state.pop(f"{prefix}{e}.{p}_proj.weight") for p in ("gate", "up", "down")}
            for e in experts
        ]
        state[prefix + "gate_up_proj"] = torch.stack(
            [torch.cat((t["gate"], t["up"])) for t in take]
        )
        state[prefix + "down_proj"] = torch.stack([t["down"] for t in take])
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    model = AutoModelForCausalLM.from_config(config).eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    return model


@pytest.mark.parametrize("arch", sorted(SHAPES))
def test_each_expert_of_the_stack_is_stored_and_computes_like_transformers(
    tmp_path: Path, arch: str
) -> None:
    shape = SHAPES[arch]
    gguf = write_llama_gguf(tmp_path / "model.gguf", shape, types=mixed_types, seed=4, arch=arch)[0]
    manifest = build_package(str(gguf), tmp_path / "pkg")
    assert manifest.architecture == ARCHITECTURES[arch]
    config = json.loads((tmp_path / "pkg" / "config.json").read_text())
    if arch == "qwen3moe":
        assert config["moe_intermediate_size"] == 32 and config["mlp_only_layers"] == [1]
        assert config["norm_topk_prob"] is True
    elif arch == "qwen2moe":
        assert config["moe_intermediate_size"] == 32 and config["mlp_only_layers"] == []
        assert config["shared_expert_intermediate_size"] == 64
        assert config["norm_topk_prob"] is False
    else:
        assert config["intermediate_size"] == 32 and config["num_local_experts"] == 4
    assert config["num_experts_per_tok"] == 2
    ours = load_hf_state_dict(tmp_path / "pkg")
    source = gguf_floats(gguf)
    for layer in range(shape.layers):
        prefix = f"model.layers.{layer}.mlp."
        if layer in shape.dense_layers:
            assert prefix + "gate.weight" not in ours and prefix + "up_proj.weight" in ours
            continue
        assert torch.equal(ours[prefix + "gate.weight"], source[f"blk.{layer}.ffn_gate_inp.weight"])
        for projection in ("gate", "up", "down"):
            stack = source[f"blk.{layer}.ffn_{projection}_exps.weight"]
            for expert in range(shape.experts):
                name = f"{prefix}experts.{expert}.{projection}_proj.weight"
                assert torch.equal(ours[name], stack[expert]), name
        if shape.shared_expert_intermediate:
            gate = source[f"blk.{layer}.ffn_gate_inp_shexp.weight"]
            assert torch.equal(ours[prefix + "shared_expert_gate.weight"], gate.reshape(1, -1))
            for projection in ("gate", "up", "down"):
                name = f"{prefix}shared_expert.{projection}_proj.weight"
                assert torch.equal(ours[name], source[f"blk.{layer}.ffn_{projection}_shexp.weight"])
        if shape.attn_bias:
            bias = source[f"blk.{layer}.attn_k.bias"]
            assert torch.equal(ours[f"model.layers.{layer}.self_attn.k_proj.bias"], bias)

    model = hf_model_of(tmp_path / "pkg")
    stages = [load_stage_runtime(tmp_path / "pkg", r) for r in (LayerRange(0, 2), LayerRange(2, 3))]
    tokens = torch.randint(0, 512, (12,), generator=torch.Generator().manual_seed(2))
    hidden = stages[0].forward("s", 0, tokens)
    assert max_diff(stages[1].forward("s", 0, hidden), full_logits(model, tokens)) <= 1e-4


@pytest.mark.parametrize("arch", sorted(SHAPES))
def test_experts_are_read_one_at_a_time_and_keep_their_codes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arch: str
) -> None:
    """An int4 build keeps the Q4_0 experts' own codes; with small reads no read
    crosses from one expert into the next, and the package is the same."""
    shape = SHAPES[arch]
    gguf = write_llama_gguf(tmp_path / "model.gguf", shape, types=q4_0_experts, arch=arch)[0]
    manifest = build_package(str(gguf), tmp_path / "whole", quant="int4")
    sparse = shape.layers - len(shape.dense_layers)
    assert manifest.quantization["from_source_codes"]["Q4_0"] >= sparse * shape.experts * 3
    monkeypatch.setattr(weight_store, "CHUNK_BYTES", 4096)
    reads: list[tuple[str, int, int]] = []
    original = GgufModel.raw_rows

    def recording(self: GgufModel, name: str, first: int, count: int):  # noqa: ANN202
        reads.append((name, first, count))
        return original(self, name, first, count)

    monkeypatch.setattr(GgufModel, "raw_rows", recording)
    build_package(str(gguf), tmp_path / "chunked", quant="int4")
    stacked = [(n, f, c) for n, f, c in reads if "_exps." in n]
    assert len(stacked) > sparse * shape.experts * 3
    for name, first, count in stacked:
        rows = shape.hidden if "down" in name else shape.expert_intermediate
        assert first // rows == (first + count - 1) // rows, (name, first, count)
        assert count * (shape.expert_intermediate if "down" in name else shape.hidden) * 4 <= 4096
    for path in sorted((tmp_path / "whole").rglob("*.safetensors")):
        from safetensors.torch import load_file

        left = load_file(str(path))
        right = load_file(str(tmp_path / "chunked" / path.relative_to(tmp_path / "whole")))
        assert left.keys() == right.keys()
        assert all(torch.equal(left[k], right[k]) for k in left), path.name
    runtime = load_stage_runtime(tmp_path / "whole", LayerRange(0, shape.layers))
    logits = runtime.forward("s", 0, torch.tensor([1, 2, 3, 4]))
    assert logits.shape == (4, shape.vocab) and torch.isfinite(logits).all()


def test_a_split_moe_gguf_gives_the_same_package(tmp_path: Path) -> None:
    shape = SHAPES["qwen3moe"]
    single = write_llama_gguf(
        tmp_path / "one" / "m.gguf", shape, seed=7, types=mixed_types, arch="qwen3moe"
    )
    parts = write_llama_gguf(
        tmp_path / "parts" / "m.gguf",
        shape,
        seed=7,
        types=mixed_types,
        arch="qwen3moe",
        split_max_tensors=6,
    )
    assert len(single) == 1 and len(parts) > 3
    build_package(str(single[0]), tmp_path / "a")
    build_package(str(parts[-1]), tmp_path / "b")
    for path in sorted((tmp_path / "a").rglob("*.safetensors")):
        from safetensors.torch import load_file

        left, right = (
            load_file(str(path)),
            load_file(str(tmp_path / "b" / path.relative_to(tmp_path / "a"))),
        )
        assert left.keys() == right.keys() and all(torch.equal(left[k], right[k]) for k in left)
