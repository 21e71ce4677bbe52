"""What a model needs in memory, per stage: its layers (weights and KV budget), the
embeddings on stage 0 (with stage 0's extras: the draft model), the LM head on the
last stage. The layer planner (coordinator/planner.py) plans with it."""

from __future__ import annotations

import math
from dataclasses import dataclass

from mesh.errors import InvalidRequest
from mesh.package.manifest import PackageManifest

DTYPE_BYTES = {
    "float32": 4,
    "fp32": 4,
    "f32": 4,
    "bfloat16": 2,
    "bf16": 2,
    "float16": 2,
    "fp16": 2,
    "f16": 2,
    "half": 2,
}


@dataclass(frozen=True)
class ModelFootprint:
    """Memory one stage needs, in bytes at the serving dtype."""

    layer_count: int
    layer_bytes: int
    embed_bytes: int
    head_bytes: int
    kv_bytes_per_layer: int
    stage0_extra_bytes: int = 0

    @property
    def bytes_per_layer(self) -> int:
        return self.layer_bytes + self.kv_bytes_per_layer

    @property
    def total_bytes(self) -> int:
        return (
            self.layer_count * self.bytes_per_layer
            + self.embed_bytes
            + self.head_bytes
            + self.stage0_extra_bytes
        )

    def fixed_bytes(self, *, first: bool, last: bool) -> int:
        """Bytes a stage needs besides its layers, by its position in the chain."""
        extra = 0
        if first:
            extra += self.embed_bytes + self.stage0_extra_bytes
        if last:
            extra += self.head_bytes
        return extra


def footprint_from_manifest(
    manifest: PackageManifest,
    *,
    dtype: str,
    max_sessions: int,
    max_tokens_per_session: int,
    num_kv_heads: int,
    head_dim: int,
    stage0_extra_bytes: int = 0,
) -> ModelFootprint:
    """Footprint from the package's file sizes, rescaled from the package dtype to ``dtype``.

    ``dtype`` ``"auto"`` keeps the package dtype, or for a quantised package computes
    in bfloat16; quantised weights are held at their file size. The layer cost is the largest layer
    (a layer may be stored as several files). KV is budgeted for every session at
    its full length: ``max_sessions * max_tokens_per_session * 2 (K and V) *
    num_kv_heads * head_dim * dtype bytes`` per layer.
    """
    quantised = manifest.quantization is not None
    serving = manifest.compute_dtype(dtype)
    serve_bytes = _dtype_bytes(serving)
    scale = 1.0 if quantised else serve_bytes / _dtype_bytes(manifest.dtype)
    for name, value in (
        ("max_sessions", max_sessions),
        ("max_tokens_per_session", max_tokens_per_session),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
    ):
        if value < 1:
            raise InvalidRequest(f"{name} must be >= 1, got {value}")
    per_layer: dict[int, int] = {}
    embed = head = 0
    for entry in manifest.files:
        if entry.kind == "layer" and entry.layer_index is not None:
            per_layer[entry.layer_index] = per_layer.get(entry.layer_index, 0) + entry.bytes
        elif entry.kind == "embed":
            embed += entry.bytes
        elif entry.kind == "head":
            head += entry.bytes
    kv = max_sessions * max_tokens_per_session * 2 * num_kv_heads * head_dim * serve_bytes
    return ModelFootprint(
        layer_count=manifest.layer_count,
        layer_bytes=math.ceil(max(per_layer.values(), default=0) * scale),
        embed_bytes=math.ceil(embed * scale),
        head_bytes=math.ceil(head * scale),
        kv_bytes_per_layer=kv,
        stage0_extra_bytes=stage0_extra_bytes,
    )


def _dtype_bytes(dtype: str) -> int:
    name = dtype.removeprefix("torch.").lower()
    if name not in DTYPE_BYTES:
        raise InvalidRequest(
            f"unknown dtype {dtype!r}; use one of float32, bfloat16, float16 (or auto)"
        )
    return DTYPE_BYTES[name]
