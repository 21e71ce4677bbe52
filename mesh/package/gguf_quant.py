"""Read a GGUF file's quantised tensors and re-express them, where that is exact, in
the package's quantised forms (mesh/quant.py), so a quantised package built from a
GGUF keeps the file's own codes instead of re-rounding dequantised floats.

Exact conversions (every block type stores ``w = scale * q + min`` per 32 weights):

- Q4_0 (``d * (q - 8)``), Q4_1 (``d * q + m``) and Q4_K (``d * sc * q - dmin * m``
  with 6-bit sub-block scales) -> int4 with group 32;
- Q8_0 (``d * q``), Q4_0 (``d * (q - 8)``) and Q5_0 (``d * (q - 16)``) -> group-wise
  int8 with group 32 (embeddings): symmetric codes with one float16 scale per block.

Nothing else converts exactly into a form the runtime has: Q5_1, Q5_K and Q6_K hold
more than 16 levels (no int4), Q4_1/Q4_K/Q5_1/Q5_K add a per-block offset and Q6_K
has a scale per 16 weights (no symmetric int8 group of 32), and the runtime's int8
linears scale whole rows. For those, and for another target form or group size, the
builder quantises the dequantised tensor itself and the manifest records how far
the result is from the file's own dequantisation. GGUF files of the ``llama`` architecture
store q and k projections with their rows permuted for llama.cpp's rotary layout;
the permutation is undone on the codes and scales alike (it moves whole rows).
Stacked expert tensors are read one expert at a time (mesh/package/gguf_experts.py).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import torch

from mesh.errors import PackageError
from mesh.package import gguf_gemma as gemma
from mesh.package.gguf_experts import expert_names
from mesh.package.gguf_file import GgufModel, GgufTensor
from mesh.package.gguf_gemma import GEMMA_ARCHITECTURES
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
# Architectures whose GGUF layer tensors mean other HF names: fused projections,
# which mesh/package/fused.py splits (Phi-3's ``ffn_up`` holds the gate rows, then
# the up rows), and Gemma's norms around attention and MLP (mesh/package/gguf_gemma.py).
_ARCHITECTURE_PARTS = {
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    # Qwen2-MoE's shared expert and its sigmoid gate (one row, which llama.cpp may
    # store as a vector).
    "qwen2moe": {
        "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
        "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
        "ffn_up_shexp": "mlp.shared_expert.up_proj",
        "ffn_down_shexp": "mlp.shared_expert.down_proj",
    },
    **dict.fromkeys(GEMMA_ARCHITECTURES, gemma.LAYER_PARTS),
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


def hf_name(gguf_name: str, architecture: str = "") -> str | None:
    """The HF ``*ForCausalLM`` name of a GGUF tensor of a model of ``architecture``
    (GGUF's ``general.architecture``), or None for one we do not map."""
    match = _BLOCK.match(gguf_name)
    if match:
        fused = _ARCHITECTURE_PARTS.get(architecture, {})
        part = fused.get(match.group(2)) or _LAYER_PARTS.get(match.group(2))
        return None if part is None else f"model.layers.{match.group(1)}.{part}.{match.group(3)}"
    match = _NAMED.match(gguf_name)
    if match and match.group(1) in _GLOBAL:
        return f"{_GLOBAL[match.group(1)]}.{match.group(2)}"
    return None


class GgufQuantReader:
    """The tensors of a GGUF model looked up by HF name: raw codes where they convert
    exactly, float rows otherwise, with llama.cpp's q/k row order undone. One expert
    of a stacked expert tensor is a tensor of its own here."""

    def __init__(self, model: GgufModel, heads: int, kv_heads: int) -> None:
        self.model = model
        self._names: dict[str, str] = {}
        # HF name -> the expert it is in a stacked tensor.
        self._experts: dict[str, int] = {}
        for gguf_name, tensor in model.tensors.items():
            name = hf_name(gguf_name, model.architecture)
            if name is not None:
                self._names[name] = gguf_name
                continue
            for name, expert in expert_names(gguf_name, tensor.shape):
                self._names[name] = gguf_name
                if expert is not None:
                    self._experts[name] = expert
        self._permute = model.architecture == "llama"
        # llama.cpp stores Gemma's norms plus one; the runtime adds it itself.
        self._norm_shift = gemma.NORM_SHIFT if model.architecture in GEMMA_ARCHITECTURES else 0.0
        self._heads = heads
        self._kv_heads = kv_heads

    def names(self) -> list[str]:
        return list(self._names)

    def unmapped(self) -> list[str]:
        mapped = set(self._names.values())
        return [name for name in self.model.tensors if name not in mapped]

    def _tensor(self, name: str) -> GgufTensor:
        return self.model.tensors[self._names[name]]

    def _first_row(self, name: str) -> int:
        """Where ``name``'s rows start in its GGUF tensor (an expert's in the stack)."""
        expert = self._experts.get(name)
        return 0 if expert is None else expert * self._tensor(name).shape[1]

    def type_name(self, name: str) -> str | None:
        gguf_name = self._names.get(name)
        return None if gguf_name is None else self.model.tensors[gguf_name].type_name

    def shape(self, name: str) -> tuple[int, ...]:
        shape = self._tensor(name).shape
        if name.endswith(".shared_expert_gate.weight") and len(shape) == 1:
            return (1, *shape)  # a linear of one output, as transformers holds it
        return shape[1:] if name in self._experts else shape

    def nbytes(self, name: str) -> int:
        tensor = self._tensor(name)
        return tensor.nbytes // tensor.shape[0] if name in self._experts else tensor.nbytes

    def row_unit(self, name: str) -> int:
        """Rows are read in multiples of this: a permuted tensor's rows move within a
        head, so a read must cover whole heads."""
        heads = self._permuted_heads(name)
        return self._tensor(name).shape[0] // heads if heads else 1

    def tensor(self, name: str) -> torch.Tensor:
        """The whole tensor as float32 (for small ones: norms, biases)."""
        shape = self.shape(name)
        if len(shape) == 1:
            values = self.model.float_rows(self._names[name], 0, 1).reshape(-1, 1)
            values = self._unpermute(name, values).reshape(-1)
            if self._norm_shift and name.endswith("norm.weight"):
                values = values - self._norm_shift
            return values
        return self.float_rows(name, 0, int(np.prod(shape[:-1]))).reshape(shape)

    def float_rows(self, name: str, first: int, count: int) -> torch.Tensor:
        """Rows ``first .. first + count`` (HF order) as float32."""
        start = self._first_row(name) + first
        values = self.model.float_rows(self._names[name], start, count)
        return self._unpermute(name, values)

    def converts(self, name: str, kind: str, group: int) -> bool:
        """Whether ``name``'s block type converts exactly into ``kind`` (int4 / int8g)
        with ``group``."""
        gguf_name = self._names.get(name)
        if gguf_name is None or group != QK:
            return False
        tensor = self.model.tensors[gguf_name]
        return (tensor.type_name, kind) in _CONVERTERS and len(self.shape(name)) == 2

    def parts(self, name: str, kind: str, first: int, count: int) -> dict[str, torch.Tensor]:
        """Rows ``first .. first + count`` of ``name`` in form ``kind`` (``converts``)."""
        tensor = self._tensor(name)
        converter = _CONVERTERS[(tensor.type_name, kind)]
        parts = converter(self.model.raw_rows(tensor.name, self._first_row(name) + first, count))
        return {key: self._unpermute(name, value) for key, value in parts.items()}

    def _unpermute(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        heads = self._permuted_heads(name)
        if not heads:
            return rows
        per_head = self._tensor(name).shape[0] // heads
        # ``rows`` covers whole heads (row_unit); each is permuted on its own.
        order = rotary_row_order(rows.shape[0], rows.shape[0] // per_head)
        return rows[order].contiguous()

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


def _q4_0_int8g(rows: np.ndarray) -> dict[str, torch.Tensor]:
    blocks = _blocks(rows, 18)
    codes = _nibbles_split_halves(blocks[..., 2:18]).astype(np.int8) - 8
    return {
        "qweight": torch.from_numpy(codes.reshape(rows.shape[0], -1)),
        "scales": _f16(blocks, 0),
    }


def _q5_0_int8g(rows: np.ndarray) -> dict[str, torch.Tensor]:
    blocks = _blocks(rows, 22)
    # Bit i of the little-endian uint32 after the scale is element i's fifth bit.
    high = np.unpackbits(blocks[..., 2:6], axis=-1, bitorder="little")
    codes = (_nibbles_split_halves(blocks[..., 6:22]) | (high << 4)).astype(np.int8) - 16
    return {
        "qweight": torch.from_numpy(codes.reshape(rows.shape[0], -1)),
        "scales": _f16(blocks, 0),
    }


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
    ("Q4_0", "int8g"): _q4_0_int8g,
    ("Q5_0", "int8g"): _q5_0_int8g,
}
