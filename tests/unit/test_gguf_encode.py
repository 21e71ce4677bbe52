"""GGUF files of every block type made from float weights, and what a package keeps
of each: the file's own values where a runtime form holds them exactly, otherwise a
rounding whose error the manifest states."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from mesh import quant
from mesh.package.builder import build_package
from mesh.package.gguf_encode import (
    more_bits,
    q4_k_m,
    quantize,
    requantise_gguf,
    stored_type,
    type_counts,
)
from mesh.package.synthetic_gguf import LlamaShape, write_llama_gguf

# Every weight 256 or 512 inputs wide: whole K-quant blocks.
SHAPE = LlamaShape(layers=2, hidden=256, intermediate=512, heads=4, kv_heads=2, vocab=320)
ALL_TYPES = ("Q8_0", "Q6_K", "Q5_K", "Q5_1", "Q5_0", "Q4_K", "Q4_1", "Q4_0")
# Layer weights kept as the file's codes in an int4 group-32 package, and the
# embedding types kept as codes in the int8 group-32 embedding.
INT4_CODES = ("Q4_0", "Q4_1", "Q4_K")
INT8G_CODES = ("Q8_0", "Q4_0", "Q5_0")


def float_gguf(path: Path, shape: LlamaShape = SHAPE, seed: int = 0) -> Path:
    def float32(name: str, layer: int | None, shape: LlamaShape) -> str:
        return "F32"

    return write_llama_gguf(path, shape, types=float32, seed=seed)[0]


@pytest.mark.parametrize(("type_name", "bound"), [("Q4_K", 0.1), ("Q5_K", 0.05), ("Q6_K", 0.025)])
def test_k_quant_blocks_decode_with_the_gguf_package(type_name: str, bound: float) -> None:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    rng = np.random.default_rng(4)
    values = (rng.standard_normal((6, 768)) * 0.05).astype(np.float32)
    values[1, :256] = 0.0  # an all-zero block
    values[2, 256:512] = 0.03  # a constant one
    values[3] *= np.linspace(0.1, 10, 768, dtype=np.float32)  # very different sub-blocks
    data = quantize(values, type_name)
    decoded = dequantize(data, GGMLQuantizationType[type_name]).reshape(values.shape)
    assert np.isfinite(decoded).all()
    assert np.array_equal(decoded[1, :256], values[1, :256])
    assert np.allclose(decoded[2, 256:512], 0.03, rtol=0.02)
    for row in (0, 3, 4, 5):
        error = decoded[row] - values[row]
        assert np.sqrt((error**2).mean() / (values[row] ** 2).mean()) < bound


def test_more_bits_layers_and_the_q4_k_m_mix() -> None:
    chosen = [layer for layer in range(30) if more_bits(layer, 30)]
    assert chosen == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29]
    assert q4_k_m("blk.5.attn_v.weight", 5, 30, False) == "Q6_K"
    assert q4_k_m("blk.4.ffn_down.weight", 4, 30, False) == "Q4_K"
    assert q4_k_m("blk.5.attn_q.weight", 5, 30, False) == "Q4_K"
    assert q4_k_m("token_embd.weight", None, 30, False) == "Q6_K"
    assert q4_k_m("token_embd.weight", None, 30, True) == "Q4_K"
    assert stored_type("Q4_K", 576) == "Q5_0" and stored_type("Q6_K", 576) == "Q8_0"
    assert stored_type("Q4_K", 1536) == "Q4_K" and stored_type("Q5_0", 576) == "Q5_0"


def test_a_q4_k_m_file_mixes_types_as_llama_cpp_does(tmp_path: Path) -> None:
    from gguf import GGUFReader

    # 320-wide rows are not whole 256-blocks: those weights take the substitutes.
    shape = LlamaShape(layers=8, hidden=320, intermediate=512, heads=4, kv_heads=2, vocab=64)
    source = float_gguf(tmp_path / "f32.gguf", shape)
    counts = requantise_gguf(source, tmp_path / "mix.gguf", q4_k_m)
    types = {t.name: t.tensor_type.name for t in GGUFReader(str(tmp_path / "mix.gguf")).tensors}
    assert type_counts(tmp_path / "mix.gguf")["types"] == dict(sorted(counts.items()))
    more = {0, 3, 6, 7}
    for layer in range(8):
        assert types[f"blk.{layer}.ffn_down.weight"] == ("Q6_K" if layer in more else "Q4_K")
        assert types[f"blk.{layer}.attn_v.weight"] == ("Q8_0" if layer in more else "Q5_0")
        assert types[f"blk.{layer}.attn_q.weight"] == "Q5_0"
        assert types[f"blk.{layer}.ffn_norm.weight"] == "F32"
    assert types["output.weight"] == "Q8_0" and types["token_embd.weight"] == "Q5_0"
    # The rewritten file is a model the builder reads, metadata and all.
    manifest = build_package(str(tmp_path / "mix.gguf"), tmp_path / "pkg", quant="int4")
    assert manifest.quantization["from_source_codes"]["Q4_K"] == 4


def dequantised(parts: dict[str, torch.Tensor], kind: str) -> torch.Tensor:
    if kind == "int4":
        return quant.dequantize_int4(parts, torch.float32)
    if kind == "int8g":
        return quant.dequantize_int8_groups(parts, torch.float32)
    return quant.dequantize_int8(parts, torch.float32)


def worst_error(package: Path, floats: Path, kind: str) -> dict[str, float]:
    """Largest |stored - GGUF dequantisation| over the layer linears (``layers``) and
    the embedding (``embed``), recomputed from the package files."""
    worst = {"layers": 0.0, "embed": 0.0}
    for relative in ["shared/embed.safetensors"] + [
        f"layers/{i:05d}.safetensors" for i in range(SHAPE.layers)
    ]:
        stored, reference = load_file(str(package / relative)), load_file(str(floats / relative))
        for name, value in reference.items():
            if f"{name}.qweight" not in stored:
                continue
            parts = {
                k: stored[f"{name}.{k}"]
                for k in ("qweight", "scales", "mins")
                if f"{name}.{k}" in stored
            }
            which = "embed" if relative.startswith("shared") else "layers"
            error = (dequantised(parts, "int8g" if which == "embed" else kind) - value).abs()
            worst[which] = max(worst[which], float(error.max()))
    return worst


@pytest.mark.parametrize("type_name", ALL_TYPES)
def test_each_block_type_is_kept_exactly_or_its_error_stated(
    tmp_path: Path, type_name: str
) -> None:
    def everything(name: str, layer: int | None, layers: int, has_output: bool) -> str:
        return type_name

    gguf = tmp_path / f"{type_name}.gguf"
    requantise_gguf(float_gguf(tmp_path / "f32.gguf", seed=7), gguf, everything)
    assert set(type_counts(gguf)["types"]) == {type_name, "F32"}
    # A float32 package holds exactly the gguf package's dequantisation of the file.
    build_package(str(gguf), tmp_path / "float", dtype="float32")
    for kind, label in (("int4", "int4 g32"), ("int8", "int8 per row")):
        manifest = build_package(str(gguf), tmp_path / kind, quant=kind)
        entries = {(d["source"], d["stored"]): d for d in manifest.quantization["deviation"]}
        measured = worst_error(tmp_path / kind, tmp_path / "float", kind)

        layers = entries[(type_name, label)]
        kept = kind == "int4" and type_name in INT4_CODES
        layer_weights = 7 * SHAPE.layers + (1 if kind == "int8" else 0)  # + the head
        assert layers["tensors"] == layer_weights
        assert layers["from_source_codes"] == (7 * SHAPE.layers if kept else 0)
        assert layers["max_abs_error"] == pytest.approx(measured["layers"], rel=1e-3, abs=1e-9)
        if type_name in ("Q4_0", "Q4_1") and kind == "int4":
            assert measured["layers"] == 0.0
        elif type_name == "Q4_K" and kind == "int4":
            # Only the float16 rounding of the d * sc and dmin * m products.
            assert 0.0 < layers["relative_rms_error"] < 1e-3
        else:
            assert layers["relative_rms_error"] > 1e-3

        embed = entries[(type_name, "int8 g32")]
        assert embed["from_source_codes"] == (1 if type_name in INT8G_CODES else 0)
        assert embed["max_abs_error"] == pytest.approx(measured["embed"], rel=1e-3, abs=1e-9)
        assert (measured["embed"] == 0.0) == (type_name in INT8G_CODES)
