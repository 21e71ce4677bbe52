"""Read a GGUF file's quantised tensors and re-express them, where that is exact, in
the package's quantised forms (mesh/quant.py), so a quantised package built from a
GGUF keeps the file's own codes instead of re-rounding dequantised floats.

Exact conversions (every block type stores ``w = scale * q + min`` per 32 weights):

- Q4_0 (``d * (q - 8)``), Q4_1 (``d * q + m``) and Q4_K (``d * sc * q - dmin * m``
  with 6-bit sub-block scales) -> int4 with group 32;
- Q8_0 (``d * q``) -> group-wise int8 (embeddings).

Any other type, or another target form, is not converted here: the builder then
quantises the dequantised tensor itself. GGUF files of the ``llama`` architecture
store q and k projections with their rows permuted for llama.cpp's rotary layout;
the permutation is undone on the codes and scales alike (it moves whole rows).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mesh.errors import PackageError
from mesh.quant import pack_int4

_LAYER_PARTS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_GLOBAL = {
    "token_embd": "model.embed_tokens",
    "output": "lm_head",
    "output_norm": "model.norm",
}
_BLOCK = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_NAMED = re.compile(r"^([a-z_]+)\.(weight|bias)$")
QK = 32  # weights per block of Q4_0, Q4_1, Q8_0 and per Q4_K sub-block
QK_K = 256


def hf_name(gguf_name: str) -> str | None:
    """The HF ``*ForCausalLM`` name of a GGUF tensor, or None for one we do not map."""
    match = _BLOCK.match(gguf_name)
    if match:
        part = _LAYER_PARTS.get(match.group(2))
        return None if part is None else f"model.layers.{match.group(1)}.{part}.{match.group(3)}"
    match = _NAMED.match(gguf_name)
    if match and match.group(1) in _GLOBAL:
        return f"{_GLOBAL[match.group(1)]}.{match.group(2)}"
    return None


class GgufQuantReader:
    """The raw quantised tensors of a GGUF file, looked up by HF name."""

    def __init__(self, path: Path, heads: int, kv_heads: int) -> None:
        from gguf import GGUFReader

        try:
            self._reader = GGUFReader(str(path))
        except (OSError, ValueError) as error:
            raise PackageError(f"cannot read GGUF {path}: {error}") from error
        self._tensors = {}
        for tensor in self._reader.tensors:
            name = hf_name(tensor.name)
            if name is not None:
                self._tensors[name] = tensor
        self._permute = self._architecture() == "llama"
        self._heads = heads
        self._kv_heads = kv_heads

    def _architecture(self) -> str:
        field = self._reader.fields.get("general.architecture")
        if field is None:
            return ""
        return bytes(field.parts[field.data[0]]).decode(errors="replace")

    def type_name(self, name: str) -> str | None:
        tensor = self._tensors.get(name)
        return None if tensor is None else tensor.tensor_type.name

    def parts(self, name: str, kind: str, group: int) -> dict[str, torch.Tensor] | None:
        """Parts of ``name`` in form ``kind`` (int4 / int8g) with ``group``, when the
        GGUF block type converts exactly; else None."""
        tensor = self._tensors.get(name)
        if tensor is None or group != QK:
            return None
        type_name = tensor.tensor_type.name
        rows = np.asarray(tensor.data)
        converter = _CONVERTERS.get((type_name, kind))
        if converter is None or rows.ndim != 2:
            return None
        parts = converter(rows)
        heads = self._permuted_heads(name)
        if heads:
            order = rotary_row_order(parts["qweight"].shape[0], heads)
            parts = {key: value[order].contiguous() for key, value in parts.items()}
        return parts

    def _permuted_heads(self, name: str) -> int:
        if not self._permute:
            return 0
        if ".self_attn.q_proj." in name:
            return self._heads
        if ".self_attn.k_proj." in name:
            return self._kv_heads
        return 0


def rotary_row_order(rows: int, heads: int) -> torch.Tensor:
    """Row indices that undo llama.cpp's q/k permutation: within each head the GGUF
    rows interleave the two rotary halves; HF keeps each half contiguous."""
    half = rows // heads // 2
    return torch.arange(rows).reshape(heads, half, 2).transpose(1, 2).reshape(-1)


def _blocks(rows: np.ndarray, block_bytes: int) -> np.ndarray:
    count, width = rows.shape
    if width % block_bytes:
        raise PackageError(f"GGUF rows of {width} bytes are not whole {block_bytes}-byte blocks")
    return rows.reshape(count, width // block_bytes, block_bytes)


def _f16(blocks: np.ndarray, start: int) -> torch.Tensor:
    raw = np.ascontiguousarray(blocks[..., start : start + 2]).view(np.float16)[..., 0]
    return torch.from_numpy(raw.copy())


def _nibbles_split_halves(qs: np.ndarray) -> np.ndarray:
    """Q4_0/Q4_1 order: byte j holds element j (low nibble) and j + 16 (high)."""
    return np.concatenate((qs & 0x0F, qs >> 4), axis=-1)


def _pack(codes: np.ndarray, count: int) -> torch.Tensor:
    return pack_int4(torch.from_numpy(codes.reshape(count, -1).astype(np.uint8)))


def _q4_0(rows: np.ndarray) -> dict[str, torch.Tensor]:
    blocks = _blocks(rows, 18)
    scales = _f16(blocks, 0)
    codes = _nibbles_split_halves(blocks[..., 2:18])
    return {"qweight": _pack(codes, rows.shape[0]), "scales": scales, "mins": scales * -8}


def _q4_1(rows: np.ndarray) -> dict[str, torch.Tensor]:
    blocks = _blocks(rows, 20)
    codes = _nibbles_split_halves(blocks[..., 4:20])
    return {
        "qweight": _pack(codes, rows.shape[0]),
        "scales": _f16(blocks, 0),
        "mins": _f16(blocks, 2),
    }


def _q8_0(rows: np.ndarray) -> dict[str, torch.Tensor]:
    blocks = _blocks(rows, 34)
    codes = np.ascontiguousarray(blocks[..., 2:34]).view(np.int8).reshape(rows.shape[0], -1)
    return {"qweight": torch.from_numpy(codes.copy()), "scales": _f16(blocks, 0)}


def _q4_k(rows: np.ndarray) -> dict[str, torch.Tensor]:
    blocks = _blocks(rows, 144)
    d = _f16(blocks, 0).float().unsqueeze(-1)
    dmin = _f16(blocks, 2).float().unsqueeze(-1)
    packed = blocks[..., 4:16].astype(np.int32)
    low = packed[..., 0:4]
    mid = packed[..., 4:8]
    high = packed[..., 8:12]
    sc = np.concatenate((low & 63, (high & 0x0F) | ((low >> 6) << 4)), axis=-1)
    mn = np.concatenate((mid & 63, (high >> 4) | ((mid >> 6) << 4)), axis=-1)
    qs = blocks[..., 16:144].reshape(*blocks.shape[:2], 4, 32)
    # Chunk c of 64 weights: low nibbles are sub-block 2c, high nibbles 2c + 1.
    codes = np.stack((qs & 0x0F, qs >> 4), axis=3).reshape(*blocks.shape[:2], 8, 32)
    scales = (d * torch.from_numpy(sc).float()).to(torch.float16)
    mins = (-dmin * torch.from_numpy(mn).float()).to(torch.float16)
    count = rows.shape[0]
    return {
        "qweight": _pack(codes, count),
        "scales": scales.reshape(count, -1),
        "mins": mins.reshape(count, -1),
    }


_CONVERTERS: dict[tuple[str, str], Any] = {
    ("Q4_0", "int4"): _q4_0,
    ("Q4_1", "int4"): _q4_1,
    ("Q4_K", "int4"): _q4_k,
    ("Q8_0", "int8g"): _q8_0,
}
