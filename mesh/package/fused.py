"""Checkpoints whose layers fuse projections that the runtime keeps apart.

Phi-3 (``Phi3ForCausalLM``, also the architecture of Phi-3.5 and Phi-4) stores each
layer's query, key and value projections in one ``self_attn.qkv_proj`` (the query
rows, then the key rows, then the value rows) and its MLP's gate and up projections
in one ``mlp.gate_up_proj`` (gate rows, then up rows). Everything else in its layer
is Llama's arithmetic: RMSNorm, rotary attention without biases, a SiLU-gated MLP,
the same residual order; its rotary types (default, LongRoPE) are the generic ones
of transformers, and its sliding window (Phi-3-mini-4k's) applies to every layer.

``LlamaLayout`` presents such a checkpoint under Llama's tensor names and a Llama
config, splitting each fused tensor by rows: a split by rows is exact whatever the
storage (float tensors, or a GGUF's quantised rows, each of which is its own run of
blocks). The package and everything after it then serve the model as the Llama
family; the manifest's ``source`` keeps the original architecture. A Phi-3 config
that rotates only part of each head (``partial_rotary_factor`` below 1, as in
Phi-4-mini) keeps the factor: the stage builds its rotary angles for that part
(``mesh/runtime/skeleton.py``) and its blocks rotate only it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from mesh.errors import UnsupportedArchitecture
from mesh.package.sources import Checkpoint

LLAMA = "LlamaForCausalLM"
# Config keys of Phi-3 that mean nothing to Llama (dropout rates, unused at inference).
_PHI3_ONLY_KEYS = ("embd_pdrop", "resid_pdrop", "auto_map")
_FUSED = re.compile(r"^((?:model\.)?layers\.\d+\.)(self_attn\.qkv_proj|mlp\.gate_up_proj)\.weight$")


@dataclass(frozen=True)
class RowPart:
    """One Llama tensor: rows ``first .. first + count`` of a fused source tensor."""

    source: str
    first: int
    count: int


def llama_config(raw: dict[str, Any]) -> dict[str, Any]:
    """The Llama config of a Phi-3 config (as ``config.json`` or a transformers dict)."""
    config = {key: value for key, value in raw.items() if key not in _PHI3_ONLY_KEYS}
    config["architectures"] = [LLAMA]
    config["model_type"] = "llama"
    config.setdefault("attention_bias", False)
    config.setdefault("mlp_bias", False)
    return config


class RowParts(Checkpoint):
    """A checkpoint seen under other names: a name in ``_parts`` is rows of one of
    the inner checkpoint's tensors (all of them, for a plain rename); a name only in
    ``_names`` is the inner one's own."""

    def __init__(self, inner: Checkpoint) -> None:
        self.inner = inner
        self._parts: dict[str, RowPart] = {}
        self._names: list[str] = []

    def tensor_names(self) -> list[str]:
        return list(self._names)

    def tensor(self, name: str) -> torch.Tensor:
        part = self._parts.get(name)
        if part is None:
            return self.inner.tensor(name)
        if part.first == 0 and part.count == self.inner.shape(part.source)[0]:
            return self.inner.tensor(part.source)
        return self.inner.rows(part.source, part.first, part.count)

    def shape(self, name: str) -> tuple[int, ...]:
        part = self._parts.get(name)
        if part is None:
            return self.inner.shape(name)
        return (part.count, *self.inner.shape(part.source)[1:])

    def rows(self, name: str, first: int, count: int) -> torch.Tensor:
        part = self._parts.get(name)
        if part is None:
            return self.inner.rows(name, first, count)
        return self.inner.rows(part.source, part.first + first, count)

    def row_unit(self, name: str) -> int:
        part = self._parts.get(name)
        return self.inner.row_unit(name if part is None else part.source)

    def nbytes(self, name: str) -> int:
        part = self._parts.get(name)
        if part is None:
            return self.inner.nbytes(name)
        return self.inner.nbytes(part.source) * part.count // self.inner.shape(part.source)[0]

    def write_meta(self, out_dir: Path) -> None:
        self.inner.write_meta(out_dir)

    def has_codes(self, name: str, kind: str, group: int) -> bool:
        part = self._parts.get(name)
        return self.inner.has_codes(name if part is None else part.source, kind, group)

    def quantized_parts(
        self, name: str, kind: str, group: int, first: int, count: int
    ) -> dict[str, torch.Tensor]:
        part = self._parts.get(name)
        if part is None:
            return self.inner.quantized_parts(name, kind, group, first, count)
        return self.inner.quantized_parts(part.source, kind, group, part.first + first, count)

    def source_type(self, name: str) -> str:
        part = self._parts.get(name)
        return self.inner.source_type(name if part is None else part.source)

    def close(self) -> None:
        self.inner.close()


class LlamaLayout(RowParts):
    """A Phi-3 checkpoint under Llama's names: fused projections split by rows."""

    def __init__(self, inner: Checkpoint) -> None:
        super().__init__(inner)
        original = inner.description.architecture
        self.description = replace(inner.description, architecture=LLAMA, model_type="llama")
        self.config_json = llama_config(inner.config_json)
        self.source = {**inner.source, "architecture": original}
        self.default_model_id = inner.default_model_id
        heads = int(self.config_json["num_attention_heads"])
        kv_heads = int(self.config_json.get("num_key_value_heads") or heads)
        hidden = int(self.config_json["hidden_size"])
        head_dim = int(self.config_json.get("head_dim") or hidden // heads)
        intermediate = int(self.config_json["intermediate_size"])
        for name in inner.tensor_names():
            match = _FUSED.match(name)
            if match is None:
                self._names.append(name)
                continue
            prefix, fused = match.groups()
            if fused == "self_attn.qkv_proj":
                sizes = [("q", heads * head_dim), ("k", kv_heads * head_dim)]
                sizes.append(("v", kv_heads * head_dim))
                pieces = [(f"self_attn.{p}_proj", size) for p, size in sizes]
            else:
                pieces = [("mlp.gate_proj", intermediate), ("mlp.up_proj", intermediate)]
            rows = inner.shape(name)[0]
            if rows != sum(size for _, size in pieces):
                raise UnsupportedArchitecture(
                    f"{name} has {rows} rows; the config's heads and sizes give "
                    f"{sum(size for _, size in pieces)}: the checkpoint and its config disagree"
                )
            first = 0
            for piece, size in pieces:
                split = f"{prefix}{piece}.weight"
                self._parts[split] = RowPart(name, first, size)
                self._names.append(split)
                first += size
