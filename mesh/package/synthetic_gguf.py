"""Write Llama-shaped GGUF files of random weights, of any size, one tensor at a time.

A shape with ``experts`` writes a mixture-of-experts model as llama.cpp lays one
out: the router ``blk.N.ffn_gate_inp`` and the experts stacked in
``blk.N.ffn_{gate,up,down}_exps`` (``arch="llama"`` for Mixtral, ``"qwen3moe"`` for
Qwen3-MoE, whose attention also has per-head q/k norms).

For tests and benchmarks of package builds (``benchmarks/build_bench.py``): the
file is written as llama.cpp lays it out (its metadata keys, tensor names, q/k rows
in llama.cpp's rotary order, each block type's bytes), with random codes and sane
float16 scales, so every value decodes to a finite weight. Tensors are generated and
written one after another: writing a 4 GB file needs a few MB of memory per tensor
row chunk, not 4 GB.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# Offsets of the float16 scale fields in each block type's bytes (the rest of a
# block is codes, any byte value valid).
_SCALE_OFFSETS = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "Q8_1": (0, 2),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}
_ROW_CHUNK_BYTES = 32 << 20


@dataclass(frozen=True)
class LlamaShape:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool = False
    context: int = 4096
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Mixture of experts (0: a dense model): experts per layer, used per token, and
    # each expert's inner size; ``dense_layers`` keep a dense FFN.
    experts: int = 0
    experts_used: int = 0
    expert_intermediate: int = 0
    dense_layers: tuple[int, ...] = ()
    # Per-head q/k RMSNorms (Qwen3) and their head size (0: hidden / heads).
    qk_norm: bool = False
    head_dim: int = 0
    # Biases on q/k/v (Qwen2), and a shared expert of this inner size beside the
    # routed ones, gated by a sigmoid (Qwen2-MoE; 0: none).
    attn_bias: bool = False
    shared_expert_intermediate: int = 0

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden // self.heads


# llama.cpp's Q4_K_M recipe, roughly: Q6_K for the output, and for attn_v and
# ffn_down in half the layers; Q4_K elsewhere; norms in float32.
def q4_k_m(name: str, layer: int | None, shape: LlamaShape) -> str:
    if name.endswith("norm.weight") or ".ffn_gate_inp." in name:
        return "F32"
    if name == "output.weight":
        return "Q6_K"
    if layer is not None and name.split(".")[2] in ("attn_v", "ffn_down"):
        return "Q6_K" if layer % 2 == 0 else "Q4_K"
    return "Q4_K"


@dataclass
class TensorSpec:
    name: str
    shape: tuple[int, ...]  # torch order, rows first
    type_name: str


def llama_tensors(shape: LlamaShape, types: Callable[..., str] = q4_k_m) -> list[TensorSpec]:
    """Every tensor of a llama.cpp GGUF of ``shape``, in file order."""
    head_dim = shape.head_size
    q, kv = shape.heads * head_dim, shape.kv_heads * head_dim
    specs = [("token_embd.weight", (shape.vocab, shape.hidden), None)]
    for layer in range(shape.layers):
        prefix = f"blk.{layer}."
        specs += [
            (prefix + "attn_norm.weight", (shape.hidden,), layer),
            (prefix + "attn_q.weight", (q, shape.hidden), layer),
            (prefix + "attn_k.weight", (kv, shape.hidden), layer),
            (prefix + "attn_v.weight", (kv, shape.hidden), layer),
            (prefix + "attn_output.weight", (shape.hidden, q), layer),
        ]
        if shape.attn_bias:
            specs += [
                (prefix + "attn_q.bias", (q,), layer),
                (prefix + "attn_k.bias", (kv,), layer),
                (prefix + "attn_v.bias", (kv,), layer),
            ]
        if shape.qk_norm:
            specs += [
                (prefix + "attn_q_norm.weight", (head_dim,), layer),
                (prefix + "attn_k_norm.weight", (head_dim,), layer),
            ]
        specs.append((prefix + "ffn_norm.weight", (shape.hidden,), layer))
        if shape.experts and layer not in shape.dense_layers:
            count, inner = shape.experts, shape.expert_intermediate
            specs += [
                (prefix + "ffn_gate_inp.weight", (count, shape.hidden), layer),
                (prefix + "ffn_gate_exps.weight", (count, inner, shape.hidden), layer),
                (prefix + "ffn_up_exps.weight", (count, inner, shape.hidden), layer),
                (prefix + "ffn_down_exps.weight", (count, shape.hidden, inner), layer),
            ]
            shared = shape.shared_expert_intermediate
            if shared:
                # llama.cpp's names and shapes: the shared expert's gate is one row.
                specs += [
                    (prefix + "ffn_gate_inp_shexp.weight", (shape.hidden,), layer),
                    (prefix + "ffn_gate_shexp.weight", (shared, shape.hidden), layer),
                    (prefix + "ffn_up_shexp.weight", (shared, shape.hidden), layer),
                    (prefix + "ffn_down_shexp.weight", (shape.hidden, shared), layer),
                ]
            continue
        specs += [
            (prefix + "ffn_gate.weight", (shape.intermediate, shape.hidden), layer),
            (prefix + "ffn_up.weight", (shape.intermediate, shape.hidden), layer),
            (prefix + "ffn_down.weight", (shape.hidden, shape.intermediate), layer),
        ]
    specs.append(("output_norm.weight", (shape.hidden,), None))
    if not shape.tied:
        specs.append(("output.weight", (shape.vocab, shape.hidden), None))
    # One-dimensional tensors (norms, biases, a shared expert's gate) are float32, as
    # llama.cpp writes them.
    return [
        TensorSpec(name, dims, "F32" if len(dims) == 1 else types(name, layer, shape))
        for name, dims, layer in specs
    ]


def gguf_bytes(spec: TensorSpec) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[spec.type_name]]
    return int(np.prod(spec.shape[:-1])) * (spec.shape[-1] // block) * size


def random_rows(type_name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """``rows`` random rows of ``cols`` weights in block type ``type_name``, as bytes
    ``[rows, row_bytes]`` (float types: values ~ N(0, 0.02), as float bytes)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    if type_name in ("F32", "F16"):
        dtype = np.float32 if type_name == "F32" else np.float16
        values = (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(dtype)
        return values.view(np.uint8)
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    count = cols // block
    data = np.frombuffer(rng.bytes(rows * count * size), dtype=np.uint8).reshape(rows, count, size)
    data = data.copy()
    for offset in _SCALE_OFFSETS[type_name]:
        scales = rng.uniform(2e-4, 1e-3, size=(rows, count)).astype(np.float16)
        data[..., offset : offset + 2] = scales.view(np.uint8).reshape(rows, count, 2)
    return data.reshape(rows, count * size)


def write_llama_gguf(
    path: Path,
    shape: LlamaShape,
    *,
    types: Callable[..., str] = q4_k_m,
    seed: int = 0,
    split_max_size: int = 0,
    split_max_tensors: int = 0,
    tokenizer_from: Path | None = None,
    arch: str = "llama",
    on_bytes: Callable[[int], None] | None = None,
) -> list[Path]:
    """Write the GGUF (split into parts by ``split_max_size`` bytes or
    ``split_max_tensors`` tensors when set) and return the files written.
    ``tokenizer_from`` copies the ``tokenizer.*`` metadata of another GGUF (its
    vocabulary must be ``shape.vocab`` long); ``arch`` is the architecture the
    metadata names."""
    from gguf import GGMLQuantizationType, GGUFWriter

    specs = llama_tensors(shape, types)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(
        path, arch, split_max_size=split_max_size, split_max_tensors=split_max_tensors
    )
    writer.add_name(path.stem)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_dimension_count(shape.head_size)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_vocab_size(shape.vocab)
    if shape.head_dim:
        writer.add_key_length(shape.head_dim)
        writer.add_value_length(shape.head_dim)
    if shape.experts:
        writer.add_expert_count(shape.experts)
        writer.add_expert_used_count(shape.experts_used)
        writer.add_expert_feed_forward_length(shape.expert_intermediate)
    if shape.shared_expert_intermediate:
        writer.add_expert_shared_feed_forward_length(shape.shared_expert_intermediate)
    if tokenizer_from is not None:
        for key, value, kind, sub in _tokenizer_fields(tokenizer_from):
            writer.add_key_value(key, value, kind, sub_type=sub)
    for spec in specs:
        writer.add_tensor_info(
            spec.name,
            _byte_shape(spec),
            np.dtype(np.uint8),
            gguf_bytes(spec),
            raw_dtype=GGMLQuantizationType[spec.type_name],
        )
    writer.write_header_to_file(path)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for spec in specs:
        data = np.concatenate(list(_rows_of(spec, rng)))
        writer.write_tensor_data(data)
        if on_bytes is not None:
            on_bytes(data.nbytes)
        del data
    writer.close()
    return writer.format_shard_names(path)


def _byte_shape(spec: TensorSpec) -> tuple[int, ...]:
    rows = int(np.prod(spec.shape[:-1])) if len(spec.shape) > 1 else 1
    width = gguf_bytes(spec) // rows
    return (*spec.shape[:-1], width) if len(spec.shape) > 1 else (width,)


def _rows_of(spec: TensorSpec, rng: np.random.Generator) -> Iterator[np.ndarray]:
    """The tensor's bytes in row chunks (flattened)."""
    rows = int(np.prod(spec.shape[:-1])) if len(spec.shape) > 1 else 1
    cols = spec.shape[-1]
    step = max(1, _ROW_CHUNK_BYTES // max(1, cols * 4))
    for first in range(0, rows, step):
        count = min(step, rows - first)
        yield random_rows(spec.type_name, count, cols, rng).reshape(-1)


def _tokenizer_fields(path: Path) -> Iterator[tuple[str, Any, Any, Any]]:
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(str(path))
    for key, item in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        kind = item.types[0]
        sub = item.types[-1] if kind == GGUFValueType.ARRAY else None
        yield key, item.contents(), kind, sub
