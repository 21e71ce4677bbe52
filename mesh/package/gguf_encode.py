"""Quantise float weights into GGUF block types and write GGUF files of them.

For quality measurements and tests: a GGUF of any block type (or a llama.cpp-style
mix such as Q4_K_M) made from a model's float weights. The ``gguf`` package
quantises Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 itself; it has no quantiser for the
K-quants, so Q4_K, Q5_K and Q6_K are encoded here, by plain rounding:

- Q4_K / Q5_K (256 weights = 8 sub-blocks of 32): each sub-block's range
  ``[min(0, lo), hi]`` gives a step ``(hi - lo) / levels`` and an offset ``-lo``;
  the super-block keeps ``d`` = largest step / 63 and ``dmin`` = largest offset / 63
  as float16, each sub-block 6-bit multiples of them; codes are rounded against the
  stored step and offset.
- Q6_K (256 weights = 16 sub-blocks of 16): each sub-block's step maps its
  largest-magnitude weight to code -32; the super-block keeps ``d`` = largest step /
  127 as float16 and each sub-block a signed 8-bit multiple of it.

llama.cpp searches each sub-block for the step that minimises the error, so its
files are somewhat more accurate than these; the layouts are the same (checked
against the ``gguf`` package's dequantisation).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

QK_K = 256
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")
# What llama.cpp stores instead of a K-quant when a row is not whole 256-blocks.
K_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
FLOAT_TYPES = ("F32", "F16")


def _super_blocks(values: np.ndarray) -> np.ndarray:
    flat = np.ascontiguousarray(values, dtype=np.float32)
    if flat.shape[-1] % QK_K:
        raise ValueError(f"rows of {flat.shape[-1]} weights are not whole {QK_K}-weight blocks")
    return flat.reshape(-1, QK_K)


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _ratio(values: np.ndarray, step: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(step > 0, values / step, 0.0)


def _affine_k(values: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """Q4_K / Q5_K: float16 ``d`` and ``dmin``, 6-bit scales and mins ``[n, 8]``,
    codes ``[n, 8, 32]`` in ``0..levels``."""
    x = _super_blocks(values).reshape(-1, 8, 32)
    low = np.minimum(x.min(-1), 0.0)
    step = (x.max(-1) - low) / levels
    offset = -low
    d = (step.max(-1) / 63).astype(np.float16).astype(np.float32)
    dmin = (offset.max(-1) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(_ratio(step, d[:, None])), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(_ratio(offset, dmin[:, None])), 0, 63).astype(np.uint8)
    stored_step = (d[:, None] * sc)[..., None]
    stored_offset = (dmin[:, None] * mn)[..., None]
    codes = np.clip(np.rint(_ratio(x + stored_offset, stored_step)), 0, levels).astype(np.uint8)
    return d, dmin, sc, mn, codes


def _pack_scales_mins(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """The 12 bytes holding eight 6-bit scales and eight 6-bit mins: bytes 0-3 scales
    0-3, bytes 4-7 mins 0-3 (their top two bits carry the high bits of scales and
    mins 4-7), bytes 8-11 the low four bits of scales (low nibble) and mins 4-7."""
    out = np.empty((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return out


def _nibble_pairs(codes: np.ndarray) -> np.ndarray:
    """Codes ``[n, 8, 32]``: byte ``c * 32 + i`` holds sub-block ``2c`` element ``i``
    (low nibble) and sub-block ``2c + 1`` element ``i`` (high nibble)."""
    pairs = (codes & 0x0F).reshape(-1, 4, 2, 32)
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)


def encode_q4_k(values: np.ndarray) -> np.ndarray:
    """Rows of float weights -> Q4_K blocks (144 bytes per 256 weights), ``[n, 144]``."""
    d, dmin, sc, mn, codes = _affine_k(values, 15)
    return np.concatenate(
        (_f16_bytes(d), _f16_bytes(dmin), _pack_scales_mins(sc, mn), _nibble_pairs(codes)),
        axis=1,
    )


def encode_q5_k(values: np.ndarray) -> np.ndarray:
    """Rows of float weights -> Q5_K blocks (176 bytes per 256 weights), ``[n, 176]``:
    as Q4_K, plus 32 bytes whose bit ``j`` of byte ``i`` is the fifth bit of
    sub-block ``j`` element ``i``."""
    d, dmin, sc, mn, codes = _affine_k(values, 31)
    high = ((codes >> 4) & 1).astype(np.uint8)  # [n, 8, 32]
    qh = np.zeros((codes.shape[0], 32), dtype=np.uint8)
    for sub in range(8):
        qh |= high[:, sub] << sub
    return np.concatenate(
        (_f16_bytes(d), _f16_bytes(dmin), _pack_scales_mins(sc, mn), qh, _nibble_pairs(codes)),
        axis=1,
    )


def encode_q6_k(values: np.ndarray) -> np.ndarray:
    """Rows of float weights -> Q6_K blocks (210 bytes per 256 weights), ``[n, 210]``:
    128 bytes of low nibbles, 64 of high bit pairs, 16 signed scales, float16 ``d``."""
    x = _super_blocks(values).reshape(-1, 16, 16)
    widest = np.take_along_axis(x, np.abs(x).argmax(-1)[..., None], axis=-1)[..., 0]
    step = widest / -32
    d = (np.abs(step).max(-1) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(_ratio(step, d[:, None])), -128, 127).astype(np.int8)
    stored = (d[:, None] * sc)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(stored != 0, x / stored, 0.0)
    codes = (np.clip(np.rint(q), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 128)
    # Each half of 128: bytes b < 64 hold elements b (low nibble) and b + 64 (high);
    # bit pair s of byte i holds the top bits of element 32 s + i.
    low = (codes & 0x0F).reshape(-1, 2, 2, 64)
    ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)
    high = (codes >> 4).reshape(-1, 2, 4, 32)
    qh = np.zeros((codes.shape[0], 2, 32), dtype=np.uint8)
    for pair in range(4):
        qh |= high[:, :, pair] << (2 * pair)
    return np.concatenate((ql, qh.reshape(-1, 64), sc.view(np.uint8), _f16_bytes(d)), axis=1)


_ENCODERS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "Q4_K": encode_q4_k,
    "Q5_K": encode_q5_k,
    "Q6_K": encode_q6_k,
}


def stored_type(type_name: str, cols: int) -> str:
    """The block type a ``cols``-wide tensor asked for as ``type_name`` is stored in:
    a K-quant needs whole 256-weight rows, else llama.cpp's substitute is used."""
    if type_name in K_QUANTS and cols % QK_K:
        return K_FALLBACK[type_name]
    return type_name


def quantize(values: np.ndarray, type_name: str) -> np.ndarray:
    """``[rows, cols]`` float32 -> the bytes of ``type_name`` blocks, ``[rows, bytes]``
    (float types: the values in that float type)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    values = np.ascontiguousarray(values, dtype=np.float32)
    if type_name in _ENCODERS:
        rows = values.shape[0]
        return _ENCODERS[type_name](values).reshape(rows, -1)
    return gguf_quantize(values, GGMLQuantizationType[type_name])


# ---- recipes ------------------------------------------------------------------------


def more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of layers that get more bits in its ``_M`` mixes: the first
    and last eighth, and every third layer in between."""
    eighth = layers // 8
    return layer < eighth or layer >= 7 * layers // 8 or (layer - eighth) % 3 == 2


def q4_k_m(name: str, layer: int | None, layers: int, has_output: bool) -> str:
    """The block type llama.cpp's Q4_K_M asks for (before ``stored_type``): Q6_K for
    ``attn_v`` and ``ffn_down`` of the ``more_bits`` layers and for the output
    projection (the embedding when it is tied), Q4_K for every other weight."""
    if name == "output.weight" or (name == "token_embd.weight" and not has_output):
        return "Q6_K"
    part = name.split(".")[2] if layer is not None else ""
    if part in ("attn_v", "ffn_down") and layer is not None and more_bits(layer, layers):
        return "Q6_K"
    return "Q4_K"


def whole_file(type_name: str) -> Callable[[str, int | None, int, bool], str]:
    """Every weight in ``type_name``, the output projection (or tied embedding) as
    llama.cpp keeps it: Q8_0 for a Q8_0 file, else Q6_K."""

    def choose(name: str, layer: int | None, layers: int, has_output: bool) -> str:
        if name == "output.weight" or (name == "token_embd.weight" and not has_output):
            return "Q8_0" if type_name == "Q8_0" else "Q6_K"
        return type_name

    return choose


def requantise_gguf(
    source: Path, out: Path, recipe: Callable[[str, int | None, int, bool], str]
) -> dict[str, int]:
    """Write ``out``: the model of GGUF ``source`` (metadata, tokenizer and tensor
    order kept) with every 2-D weight dequantised and quantised again as
    ``recipe(name, layer, layer_count, has_output)`` asks (through ``stored_type``);
    1-D tensors (norms) stay float32. Returns how many tensors went to each type."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import dequantize

    reader = GGUFReader(str(source))
    arch = str(reader.fields["general.architecture"].contents())
    layers = int(reader.fields[f"{arch}.block_count"].contents())
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    writer = GGUFWriter(out, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), kind, sub_type=sub)
    counts: dict[str, int] = {}
    for tensor in reader.tensors:
        values = dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        if values.ndim < 2:
            chosen = "F32"
        else:
            parts = tensor.name.split(".")
            layer = int(parts[1]) if parts[0] == "blk" else None
            asked = recipe(tensor.name, layer, layers, has_output)
            chosen = stored_type(asked, values.shape[-1])
        counts[chosen] = counts.get(chosen, 0) + 1
        data = quantize(values.reshape(-1, values.shape[-1]), chosen)
        if values.ndim < 2:
            data = data.reshape(-1)
        writer.add_tensor(tensor.name, data, raw_dtype=GGMLQuantizationType[chosen])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return counts


def type_counts(path: Path) -> dict[str, Any]:
    """How many tensors of each block type a GGUF holds, and its size in bytes."""
    from gguf import GGUFReader

    counts: dict[str, int] = {}
    for tensor in GGUFReader(str(path)).tensors:
        counts[tensor.tensor_type.name] = counts.get(tensor.tensor_type.name, 0) + 1
    return {"types": dict(sorted(counts.items())), "bytes": path.stat().st_size}
