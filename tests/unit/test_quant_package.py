"""Quantised packages: build, manifest, load, split, memory and refusal of bad files."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mesh.errors import InvalidRequest, PackageError
from mesh.package.builder import build_package
from mesh.package.cli import main as package_main
from mesh.package.manifest import PackageManifest, layer_path, sha256_file
from mesh.runtime import load_stage_runtime
from mesh.types import LayerRange

PROMPT = torch.tensor([5, 17, 300, 4000, 12, 99, 7, 1024])


def greedy(runtime_chain: list, prompt: torch.Tensor, steps: int) -> tuple[list[int], list]:
    """Greedy tokens and per-step logits through a chain of runtimes."""
    tokens: list[int] = []
    logits_seen = []
    inputs, pos = prompt, 0
    for _ in range(steps):
        hidden = inputs
        for runtime in runtime_chain:
            hidden = runtime.forward("s", pos, hidden)
        logits_seen.append(hidden[-1])
        pos += inputs.shape[0]
        tokens.append(int(hidden[-1].argmax()))
        inputs = torch.tensor([tokens[-1]])
    return tokens, logits_seen


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma2", "gemma3", "glm4"])
@pytest.mark.parametrize("quant", ["int4", "int8"])
def test_quantised_package_splits_like_it_runs_whole(
    tiny_package_factory: Callable[..., Path], family: str, quant: str
) -> None:
    package = tiny_package_factory(family, layers=4, quant=quant)
    manifest = PackageManifest.load(package)
    assert manifest.quantization is not None
    assert manifest.quantization["linear"] == quant
    whole = load_stage_runtime(package, LayerRange(0, 4))
    assert whole.dtype == "bfloat16"  # auto: quantised packages compute in bfloat16
    parts = [
        load_stage_runtime(package, LayerRange(0, 1)),
        load_stage_runtime(package, LayerRange(1, 4)),
    ]
    tokens_whole, logits_whole = greedy([whole], PROMPT, 12)
    tokens_split, logits_split = greedy(parts, PROMPT, 12)
    assert tokens_split == tokens_whole
    for a, b in zip(logits_whole, logits_split, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("quant", ["int4", "int8"])
def test_quantised_model_follows_the_dense_one(
    tiny_package_factory: Callable[..., Path], quant: str
) -> None:
    dense = load_stage_runtime(
        tiny_package_factory("qwen2", layers=4), LayerRange(0, 4), dtype="bfloat16"
    )
    packed = load_stage_runtime(
        tiny_package_factory("qwen2", layers=4, quant=quant), LayerRange(0, 4)
    )
    a = dense.forward("s", 0, PROMPT)
    b = packed.forward("s", 0, PROMPT)
    cosine = torch.nn.functional.cosine_similarity(a, b, dim=-1)
    assert float(cosine.min()) > (0.95 if quant == "int4" else 0.995)
    assert packed.param_bytes < dense.param_bytes * 0.6


def test_quantised_memory_is_what_the_stage_holds(
    tiny_package_factory: Callable[..., Path],
) -> None:
    package = tiny_package_factory("qwen2", layers=4, quant="int4")
    first = load_stage_runtime(package, LayerRange(0, 2))
    last = load_stage_runtime(package, LayerRange(2, 4))
    whole = load_stage_runtime(package, LayerRange(0, 4))
    assert first.param_bytes + last.param_bytes == whole.param_bytes
    # Nearly all of it is the vocabulary: an int8 embedding on the first stage, an
    # int8 head on the last, or a half-size int4 head when the package asks for one.
    vocab, hidden = 49152, 64
    assert first.param_bytes > vocab * hidden * 1.0
    assert last.param_bytes > vocab * hidden * 1.0
    small_head = tiny_package_factory("qwen2", layers=4, quant="int4", head_quant="int4")
    smaller = load_stage_runtime(small_head, LayerRange(2, 4))
    assert smaller.param_bytes < last.param_bytes - vocab * hidden * 0.3
    assert PackageManifest.load(small_head).quantization["head"] == "int4"


def test_group_size_is_checked_against_the_model(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    source = tiny_model_factory("llama", layers=2)
    with pytest.raises(InvalidRequest, match="not a multiple of the group size 128"):
        build_package(str(source), tmp_path / "pkg", quant="int4", group_size=128)
    with pytest.raises(InvalidRequest, match="apply only with --quant"):
        build_package(str(source), tmp_path / "pkg", group_size=64)
    assert not (tmp_path / "pkg").exists()


def test_misshapen_quantised_part_is_refused_with_a_rebuild_hint(
    tiny_package_factory: Callable[..., Path], tmp_path: Path
) -> None:
    import shutil

    package = tmp_path / "pkg"
    shutil.copytree(tiny_package_factory("llama", layers=2, quant="int4"), package)
    path = package / layer_path(1)
    tensors = load_file(str(path))
    tensors["mlp.up_proj.weight.scales"] = tensors["mlp.up_proj.weight.scales"][:, :1].clone()
    save_file(tensors, str(path), metadata={"format": "pt"})
    body = json.loads((package / "model-package.json").read_text())
    for entry in body["files"]:
        if entry["path"] == layer_path(1):
            entry["bytes"] = path.stat().st_size
            entry["sha256"] = sha256_file(path)
    (package / "model-package.json").write_text(json.dumps(body))
    load_stage_runtime(package, LayerRange(0, 1))  # layer 0 is intact
    with pytest.raises(PackageError) as error:
        load_stage_runtime(package, LayerRange(1, 2))
    assert "mlp.up_proj.weight.scales" in str(error.value)
    assert "rebuild the package" in str(error.value)


def test_cli_builds_and_inspects_a_quantised_package(
    tiny_model_factory: Callable[..., Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tiny_model_factory("llama", layers=2)
    out = tmp_path / "pkg"
    assert (
        package_main(
            ["build", str(source), "--out", str(out), "--quant", "int4", "--group-size", "64"]
        )
        == 0
    )
    assert "with int4 group 64 weights" in capsys.readouterr().out
    assert package_main(["inspect", str(out)]) == 0
    assert "int4 group 64" in capsys.readouterr().out
    assert package_main(["verify", str(out)]) == 0
    with pytest.raises(SystemExit) as exit_info:
        package_main(["build", str(source), "--out", str(out), "--quant", "int2"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'int2'" in capsys.readouterr().err


def test_smollm2_int4_keeps_the_gguf_codes_and_size(smollm2_gguf: Path, tmp_path: Path) -> None:
    """The int4 build of the default model keeps the GGUF's Q4_1 codes exactly and
    holds its parameters in about the GGUF's size."""
    from mesh.package import default

    out = default.build_default_package(tmp_path / "int4", quant="int4")
    manifest = PackageManifest.load(out)
    assert default._staleness(out, "int4") is None
    assert default._staleness(out, None) == "holds int4 weights, plain wanted"
    assert manifest.quantization["from_source_codes"] == {"Q4_1": 210, "Q8_0": 1}
    assert manifest.quantization["rounded"] == {"Q8_0": 1}  # the tied head, from the embedding
    runtime = load_stage_runtime(out, LayerRange(0, manifest.layer_count))
    assert runtime.param_bytes <= 1.3 * smollm2_gguf.stat().st_size
    # The stored codes give back exactly the weights transformers dequantises from
    # the GGUF (q and k included, whose rows the GGUF stores permuted).
    from mesh import quant
    from mesh.package.sources import open_checkpoint

    with open_checkpoint(str(smollm2_gguf)) as checkpoint:
        for index in (0, 29):
            stored = load_file(str(out / layer_path(index)))
            for name in (
                "self_attn.q_proj.weight",
                "self_attn.k_proj.weight",
                "mlp.down_proj.weight",
            ):
                parts = {key: stored[f"{name}.{key}"] for key in ("qweight", "scales", "mins")}
                expected = checkpoint.tensor(f"model.layers.{index}.{name}")
                assert torch.equal(quant.dequantize_int4(parts, torch.float32), expected)


def test_coordinator_quant_applies_to_the_default_model_only() -> None:
    from coordinator.cli import _resolve_model_ref

    with pytest.raises(InvalidRequest, match="--quant applies to --model default"):
        _resolve_model_ref("./packages/my-model", "int4")
    assert _resolve_model_ref("./packages/my-model", None) == "./packages/my-model"
