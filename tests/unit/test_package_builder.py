"""mesh-package build from HF safetensors directories: layout, manifest, exact tensors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from mesh.errors import InvalidRequest, PackageError, UnsupportedArchitecture
from mesh.package.builder import build_package
from mesh.package.manifest import EMBED_PATH, HEAD_PATH, PackageManifest, layer_path
from mesh.package.tensors import load_hf_state_dict
from mesh.package.verify import verify_package
from mesh.types import LayerRange

TIED = {"llama": True, "qwen2": False, "qwen3": True, "mistral": False}
ARCH = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
}


def source_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


@pytest.mark.parametrize("family", sorted(TIED))
def test_build_reassembles_the_source_model_exactly(family, tiny_model_factory, tmp_path):
    source = tiny_model_factory(family)
    manifest = build_package(str(source), tmp_path / "pkg")
    package = tmp_path / "pkg"

    assert manifest.architecture == ARCH[family]
    assert manifest.model_type == family
    assert (manifest.layer_count, manifest.hidden_size, manifest.vocab_size) == (6, 64, 49152)
    assert manifest.tied_embeddings is TIED[family]
    assert manifest.dtype == "float32"
    assert manifest.source == {"kind": "hf-dir", "path": str(source.resolve())}
    assert PackageManifest.load(package) == manifest
    assert verify_package(package) == []

    expected = source_state_dict(source)
    rebuilt = load_hf_state_dict(package)
    assert sorted(rebuilt) == sorted(expected)
    for name, tensor in expected.items():
        assert rebuilt[name].dtype == torch.float32
        assert torch.equal(rebuilt[name], tensor), name
    if TIED[family]:
        assert torch.equal(rebuilt["lm_head.weight"], rebuilt["model.embed_tokens.weight"])


def test_layout_kinds_and_tensor_names(tiny_model_factory, tmp_path):
    manifest = build_package(str(tiny_model_factory("qwen3")), tmp_path / "pkg")
    package = tmp_path / "pkg"
    by_path = {entry.path: entry for entry in manifest.files}

    meta = sorted(path for path, entry in by_path.items() if entry.kind == "meta")
    assert meta[0] == "chat_template.jinja" and manifest.files[0].path == "config.json"
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= set(meta)
    assert "generation_config.json" in meta
    assert by_path[EMBED_PATH].kind == "embed" and by_path[HEAD_PATH].kind == "head"
    assert [by_path[layer_path(i)].layer_index for i in range(6)] == list(range(6))
    for entry in manifest.files:
        assert (package / entry.path).stat().st_size == entry.bytes

    assert list(load_file(package / EMBED_PATH)) == ["embed_tokens.weight"]
    assert sorted(load_file(package / HEAD_PATH)) == ["lm_head.weight", "norm.weight"]
    layer = load_file(package / layer_path(3))
    assert "self_attn.q_proj.weight" in layer and "self_attn.q_norm.weight" in layer
    assert not any(name.startswith("model.") for name in layer)
    assert not list(tmp_path.glob(".pkg.build-*")), "the temporary build dir must be gone"


def test_slices_list_only_the_files_a_range_needs(tiny_model_factory, tmp_path):
    manifest = build_package(str(tiny_model_factory("llama")), tmp_path / "pkg")

    def tensor_files(start: int, end: int) -> list[str]:
        files = manifest.files_for(LayerRange(start, end))
        return [entry.path for entry in files if entry.kind != "meta"]

    assert tensor_files(0, 2) == [EMBED_PATH, layer_path(0), layer_path(1)]
    assert tensor_files(2, 4) == [layer_path(2), layer_path(3)]
    assert tensor_files(4, 6) == [HEAD_PATH, layer_path(4), layer_path(5)]
    assert len(tensor_files(0, 6)) == 8


def test_sharded_checkpoint_gives_the_same_tensor_files(tiny_model_factory, tmp_path):
    sharded = tiny_model_factory("qwen2", shards=3)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) >= 3
    one = build_package(str(tiny_model_factory("qwen2")), tmp_path / "one")
    three = build_package(str(sharded), tmp_path / "three")

    def digests(manifest):
        return {e.path: e.sha256 for e in manifest.files if e.kind != "meta"}

    assert digests(one) == digests(three)
    assert verify_package(tmp_path / "three") == []


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_dtype_conversion(dtype, tiny_model_factory, tmp_path):
    source = tiny_model_factory("mistral")
    manifest = build_package(str(source), tmp_path / "pkg", dtype=dtype, model_id="tiny/mistral")
    assert manifest.dtype == dtype and manifest.model_id == "tiny/mistral"
    torch_dtype = getattr(torch, dtype)
    rebuilt = load_hf_state_dict(tmp_path / "pkg")
    for name, tensor in source_state_dict(source).items():
        assert rebuilt[name].dtype == torch_dtype
        assert torch.equal(rebuilt[name], tensor.to(torch_dtype)), name
    config = json.loads((tmp_path / "pkg" / "config.json").read_text())
    assert config["dtype"] == dtype


def test_package_config_loads_with_transformers(tiny_model_factory, tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    build_package(str(tiny_model_factory("llama")), tmp_path / "pkg")
    config = AutoConfig.from_pretrained(tmp_path / "pkg")
    assert config.num_hidden_layers == 6 and config.architectures == ["LlamaForCausalLM"]
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "pkg")
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert "<|im_start|>user" in text


def test_speculative_block_is_recorded(tiny_model_factory, tmp_path):
    speculative = {"default": "ngram", "strategies": {"ngram": {"type": "ngram"}}}
    build_package(str(tiny_model_factory("llama")), tmp_path / "pkg", speculative=speculative)
    manifest = PackageManifest.load(tmp_path / "pkg")
    assert manifest.generation == {"speculative_decoding": speculative}


@pytest.mark.parametrize(
    "speculative, message",
    [
        ({"default": "x"}, "strategies"),
        ({"strategies": {}}, "default"),
        (["default", "strategies"], "JSON object"),
        ({"default": "x", "strategies": []}, "strategies must be an object"),
    ],
)
def test_bad_speculative_block_is_refused(speculative, message, tiny_model_factory, tmp_path):
    with pytest.raises(InvalidRequest, match=message):
        build_package(str(tiny_model_factory("llama")), tmp_path / "pkg", speculative=speculative)
    assert not (tmp_path / "pkg").exists()


def copy_model(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def test_unsupported_architecture_is_refused(tiny_model_factory, tmp_path):
    model = copy_model(tiny_model_factory("llama"), tmp_path / "gpt2ish")
    config = json.loads((model / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitecture, match="'GPT2LMHeadModel' is not supported"):
        build_package(str(model), tmp_path / "pkg")
    assert not (tmp_path / "pkg").exists()
    assert not list(tmp_path.glob(".pkg.*"))


def test_untied_checkpoint_without_lm_head_is_refused(tiny_model_factory, tmp_path):
    model = copy_model(tiny_model_factory("qwen2"), tmp_path / "headless")
    tensors = load_file(model / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(PackageError, match="no lm_head.weight"):
        build_package(str(model), tmp_path / "pkg")
    assert not list(tmp_path.glob(".pkg.*"))


@pytest.mark.parametrize("same", [True, False])
def test_a_tied_config_with_a_different_stored_head_is_warned_about(
    same, tiny_model_factory, tmp_path, caplog
):
    """A tied config uses the embedding as the head, as transformers does; a stored
    lm_head.weight that differs from it is said, one equal to it is not."""
    model = copy_model(tiny_model_factory("llama"), tmp_path / "tied")
    config = json.loads((model / "config.json").read_text())
    config["tie_word_embeddings"] = True
    (model / "config.json").write_text(json.dumps(config))
    tensors = load_file(model / "model.safetensors")
    embedding = tensors["model.embed_tokens.weight"]
    tensors["lm_head.weight"] = embedding.clone() if same else torch.randn_like(embedding)
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level("WARNING"):
        build_package(str(model), tmp_path / "pkg")
    warned = "checkpoint stores a different lm_head.weight" in caplog.text
    assert warned == (not same)
    if not same:
        assert "set tie_word_embeddings to false" in caplog.text


def test_missing_layer_tensors_are_refused(tiny_model_factory, tmp_path):
    model = copy_model(tiny_model_factory("llama"), tmp_path / "short")
    tensors = load_file(model / "model.safetensors")
    tensors = {k: v for k, v in tensors.items() if not k.startswith("model.layers.5.")}
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(PackageError, match=r"missing \[5\]"):
        build_package(str(model), tmp_path / "pkg")


def _drop(tensors: dict, name: str) -> None:
    del tensors[name]


def _reshape(tensors: dict, name: str) -> None:
    rows, cols = tensors[name].shape
    tensors[name] = torch.zeros(rows // 2, cols)


def _extra(tensors: dict, name: str) -> None:
    tensors[name.replace("up_proj", "side_proj")] = torch.zeros(128, 64)


def _nan(tensors: dict, name: str) -> None:
    tensors[name][3, 5] = float("nan")


def _inf(tensors: dict, name: str) -> None:
    tensors[name][0, 0] = float("-inf")


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (_drop, r"missing: \['mlp.up_proj.weight'\]"),
        (_reshape, r"mlp.up_proj.weight has shape \(64, 64\), the config expects \(128, 64\)"),
        (_extra, r"unexpected: \['mlp.side_proj.weight"),
        (_nan, "mlp.up_proj.weight holds 1 NaN or infinite value"),
        (_inf, "mlp.up_proj.weight holds 1 NaN or infinite value"),
    ],
)
@pytest.mark.parametrize("quant", [None, "int4"])
def test_a_damaged_layer_tensor_is_refused_at_build(
    damage, message, quant, tiny_model_factory, tmp_path
):
    """What a stage would refuse at load (names, shapes, dtypes), and values a stage
    would compute garbage from, are refused where the package is built, naming the
    layer and tensor, with nothing left behind."""
    model = copy_model(tiny_model_factory("llama"), tmp_path / "damaged")
    tensors = load_file(model / "model.safetensors")
    damage(tensors, "model.layers.2.mlp.up_proj.weight")
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    if quant == "int4" and damage in (_nan, _inf):
        message = message.replace("weight holds", "weight.scales holds")
    if quant == "int4" and damage is _reshape:
        message = (
            r"mlp.up_proj.weight.qweight is torch.uint8 \(64, 32\), quantised from a "
            r"\(64, 64\) weight; expected .* \(128, 32\), the int4 part of a \(128, 64\) weight"
        )
    with pytest.raises(PackageError, match=f"decoder layer 2: .*{message}") as error:
        build_package(str(model), tmp_path / "pkg", quant=quant)
    assert "fix or re-download the checkpoint" in str(error.value)
    assert not (tmp_path / "pkg").exists()
    assert not list(tmp_path.glob(".pkg.*"))


@pytest.mark.parametrize("quant", [None, "int4"])
def test_an_integer_weight_is_refused_at_build(quant, tiny_model_factory, tmp_path):
    model = copy_model(tiny_model_factory("llama"), tmp_path / "damaged")
    tensors = load_file(model / "model.safetensors")
    name = "model.layers.2.mlp.up_proj.weight"
    tensors[name] = tensors[name].to(torch.int32)
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(PackageError, match=f"{name} is torch.int32, not floating point"):
        build_package(str(model), tmp_path / "pkg", quant=quant)


def test_a_non_finite_embedding_is_refused_at_build(tiny_model_factory, tmp_path):
    model = copy_model(tiny_model_factory("llama"), tmp_path / "damaged")
    tensors = load_file(model / "model.safetensors")
    tensors["model.embed_tokens.weight"][7, 1] = float("nan")
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(PackageError, match="embed: tensor .* holds 1 NaN"):
        build_package(str(model), tmp_path / "pkg")


def test_values_beyond_float16_are_refused_with_the_dtype_to_use(tiny_model_factory, tmp_path):
    model = copy_model(tiny_model_factory("llama"), tmp_path / "wide")
    tensors = load_file(model / "model.safetensors")
    tensors["model.layers.0.self_attn.o_proj.weight"][1, 1] = 1e6
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(PackageError, match="build with --dtype bfloat16"):
        build_package(str(model), tmp_path / "pkg", dtype="float16")
    build_package(str(model), tmp_path / "pkg", dtype="bfloat16")


def test_a_tokenizer_larger_than_the_model_is_warned_about(smollm2_tokenizer_dir, tmp_path, caplog):
    from conftest import tiny_config
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_config(tiny_config("llama", layers=2, vocab_size=512))
    model.save_pretrained(tmp_path / "small-vocab")
    AutoTokenizer.from_pretrained(smollm2_tokenizer_dir).save_pretrained(tmp_path / "small-vocab")
    with caplog.at_level("WARNING", logger="mesh.package.builder"):
        build_package(str(tmp_path / "small-vocab"), tmp_path / "pkg")
    assert "the tokenizer has 49152 tokens, the model's embedding 512 rows" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="mesh.package.builder"):
        build_package(str(_full_vocab_model(tmp_path, smollm2_tokenizer_dir)), tmp_path / "b")
    assert "tokenizer" not in caplog.text


def _full_vocab_model(tmp_path: Path, tokenizer_dir: Path) -> Path:
    """A 2-layer tiny model whose embedding covers SmolLM2's tokenizer."""
    from conftest import tiny_config
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "full-vocab"
    AutoModelForCausalLM.from_config(tiny_config("llama", layers=2)).save_pretrained(out)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
    return out


def test_a_tokenizer_that_does_not_load_is_warned_about(tiny_model_factory, tmp_path, caplog):
    model = copy_model(tiny_model_factory("llama"), tmp_path / "broken-tokenizer")
    (model / "tokenizer.json").write_text("{ not json")
    with caplog.at_level("WARNING", logger="mesh.package.builder"):
        build_package(str(model), tmp_path / "pkg")
    assert "the package's tokenizer does not load" in caplog.text


def test_a_package_given_as_the_source_is_refused_saying_to_serve_it(
    tiny_package_factory, tmp_path
):
    with pytest.raises(PackageError, match="is already a model package .* serve it as it is"):
        build_package(str(tiny_package_factory("llama")), tmp_path / "again")


def test_an_empty_model_id_is_refused(tiny_model_factory, tmp_path):
    with pytest.raises(InvalidRequest, match="--model-id is empty"):
        build_package(str(tiny_model_factory("llama")), tmp_path / "pkg", model_id="  ")


def test_an_out_where_nothing_can_be_written_is_a_package_error(tiny_model_factory, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(PackageError, match="cannot write the package at --out .*a-file/pkg"):
        build_package(str(tiny_model_factory("llama")), blocker / "pkg")


def test_out_directory_rules(tiny_model_factory, tmp_path):
    source = str(tiny_model_factory("llama"))
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(PackageError, match="not a model package"):
        build_package(source, other)
    assert (other / "notes.txt").read_text() == "keep me"

    first = build_package(source, tmp_path / "pkg", model_id="first")
    second = build_package(source, tmp_path / "pkg", model_id="second")
    assert first.sha256() != second.sha256()
    assert PackageManifest.load(tmp_path / "pkg").model_id == "second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other", "pkg"]


def test_unknown_source_is_refused(tmp_path):
    with pytest.raises(PackageError, match="not found"):
        build_package(str(tmp_path / "nowhere"), tmp_path / "pkg")
    with pytest.raises(InvalidRequest, match="dtype"):
        build_package(str(tmp_path), tmp_path / "pkg", dtype="int8")


def test_gguf_sources_are_recognised(tmp_path, monkeypatch):
    from mesh.package import sources

    opened = []

    class RecordingGguf:
        description = SimpleNamespace(architecture="LlamaForCausalLM")

        def __init__(self, path, source, default_model_id):
            opened.append((path, source, default_model_id))

    monkeypatch.setattr(sources, "GgufCheckpoint", RecordingGguf)
    gguf = tmp_path / "models" / "Tiny-1B.Q4_K_M.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF")
    sources.open_checkpoint(str(gguf))
    sources.open_checkpoint(str(gguf.parent))
    expected_source = {"kind": "gguf", "file": gguf.name, "path": str(gguf.resolve())}
    assert opened == [(gguf.resolve(), expected_source, "Tiny-1B.Q4_K_M")] * 2

    (tmp_path / "weights.bin").write_bytes(b"\0")
    with pytest.raises(PackageError, match="not a .gguf"):
        sources.open_checkpoint(str(tmp_path / "weights.bin"))


@pytest.mark.parametrize("method", ["fp8", "gptq", "awq", "bitsandbytes"])
def test_a_pre_quantised_checkpoint_is_refused_naming_its_method(
    method: str, tiny_model_factory, tmp_path
):
    """FP8 (with its scales), GPTQ, AWQ and bitsandbytes checkpoints hold tensors no
    stage reads: before, they built (FP8 scales dropped) and only a stage's load
    failed, saying to rebuild."""
    model = copy_model(tiny_model_factory("llama"), tmp_path / method)
    config = json.loads((model / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method, "bits": 4}
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(PackageError, match=rf"pre-quantised checkpoint \({method}\)"):
        build_package(str(model), tmp_path / "pkg")
    assert not (tmp_path / "pkg").exists()


def test_a_wrongly_typed_config_field_is_a_package_error(tiny_model_factory, tmp_path):
    """transformers refuses `"hidden_size": "64"` with a huggingface_hub validation
    error, which went through as a traceback."""
    model = copy_model(tiny_model_factory("llama"), tmp_path / "typed")
    config = json.loads((model / "config.json").read_text())
    config["hidden_size"] = str(config["hidden_size"])
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(PackageError, match="cannot be loaded by transformers.*hidden_size"):
        build_package(str(model), tmp_path / "pkg")
