"""Tensor naming between a Hugging Face checkpoint and a model package.

Checkpoint names are those of ``*ForCausalLM`` (``model.layers.3.mlp.up_proj.weight``)
or of the bare decoder (``layers.3.mlp.up_proj.weight``). Package names are fixed
by mesh/package/manifest.py: ``embed_tokens.weight`` in the embed file,
``norm.weight`` and ``lm_head.weight`` in the head file, and per-layer names with
the ``model.layers.N.`` prefix removed. Mixture-of-experts layers are stored under
one naming for every family: Mixtral's ``block_sparse_moe.experts.E.w1`` (gate),
``w3`` (up) and ``w2`` (down) become ``mlp.experts.E.gate_proj`` and so on, as
Qwen3-MoE names them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from mesh.errors import PackageError
from mesh.package.manifest import EMBED_PATH, HEAD_PATH, PackageManifest
from mesh.types import LayerRange

EMBED_TENSOR = "embed_tokens.weight"
NORM_TENSOR = "norm.weight"
HEAD_TENSOR = "lm_head.weight"

_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.(.+)$")
_EMBED = re.compile(r"^(?:model\.)?embed_tokens\.weight$")
_NORM = re.compile(r"^(?:model\.)?norm\.weight$")
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_MIXTRAL_EXPERT = re.compile(r"^block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.(.+)$")
_MIXTRAL_PROJECTIONS = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_STACKED_EXPERTS = re.compile(r"^(?:mlp|block_sparse_moe)\.experts\.(gate_up_proj|down_proj)$")


def package_layer_name(name: str) -> str:
    """The package name of a layer tensor given by its checkpoint name (without the
    ``model.layers.N.`` prefix)."""
    match = _MIXTRAL_EXPERT.match(name)
    if match:
        expert, projection, rest = match.groups()
        return f"mlp.experts.{expert}.{_MIXTRAL_PROJECTIONS[projection]}.{rest}"
    if name.startswith("block_sparse_moe."):
        return "mlp." + name[len("block_sparse_moe.") :]
    return name


@dataclass(frozen=True)
class CheckpointLayout:
    """Where each package tensor comes from in the checkpoint (names in the checkpoint)."""

    embed: str
    norm: str
    lm_head: str | None
    layers: tuple[tuple[tuple[str, str], ...], ...]  # per layer: (package name, source name)


def classify(names: Iterable[str], layer_count: int, extra_layers: int = 0) -> CheckpointLayout:
    """Sort checkpoint tensor names into embed, norm, lm_head and per-layer groups.
    The ``extra_layers`` after the last decoder layer (GLM-4.5's multi-token
    prediction layers, ``num_nextn_predict_layers``) are left out.

    Raises PackageError for a tensor that belongs nowhere, a missing embedding or
    norm, or decoder layers that do not match ``layer_count``.
    """
    embed = norm = lm_head = None
    per_layer: dict[int, list[tuple[str, str]]] = {}
    for name in sorted(names):
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        match = _LAYER.match(name)
        if match and layer_count <= int(match.group(1)) < layer_count + extra_layers:
            continue
        if match:
            if _STACKED_EXPERTS.match(match.group(2)):
                raise PackageError(
                    f"checkpoint tensor {name!r} holds every expert of a layer stacked in one "
                    "tensor; mesh-package reads one tensor per expert, as transformers' "
                    "save_pretrained writes them: load the model and save it again"
                )
            package_name = package_layer_name(match.group(2))
            per_layer.setdefault(int(match.group(1)), []).append((package_name, name))
        elif _EMBED.match(name):
            embed = name
        elif _NORM.match(name):
            norm = name
        elif name == HEAD_TENSOR:
            lm_head = name
        else:
            raise PackageError(
                f"checkpoint tensor {name!r} is not an embedding, decoder layer, final norm "
                "or lm_head tensor; this checkpoint layout cannot be packaged"
            )
    if embed is None:
        raise PackageError("checkpoint has no embed_tokens.weight tensor")
    if norm is None:
        raise PackageError("checkpoint has no final norm.weight tensor")
    found = sorted(per_layer)
    if found != list(range(layer_count)):
        missing = sorted(set(range(layer_count)) - set(found))
        extra = sorted(set(found) - set(range(layer_count)))
        raise PackageError(
            f"config says {layer_count} decoder layers but the checkpoint has tensors for "
            f"{len(found)} (missing {missing[:8]}, unexpected {extra[:8]})"
        )
    layers = tuple(tuple(per_layer[index]) for index in range(layer_count))
    return CheckpointLayout(embed=embed, norm=norm, lm_head=lm_head, layers=layers)


def load_hf_state_dict(
    package_dir: Path, layer_range: LayerRange | None = None
) -> dict[str, torch.Tensor]:
    """Re-assemble the package tensors a range needs under their HF ``*ForCausalLM`` names.

    With no range, the whole model. Reads only the files ``files_for`` lists.
    """
    from safetensors.torch import load_file

    package_dir = Path(package_dir)
    manifest = PackageManifest.load(package_dir)
    wanted = layer_range or LayerRange(0, manifest.layer_count)
    state: dict[str, torch.Tensor] = {}
    for entry in manifest.files_for(wanted):
        if entry.kind == "meta":
            continue
        tensors = load_file(str(package_dir / entry.path))
        if entry.path == EMBED_PATH:
            state["model.embed_tokens.weight"] = tensors[EMBED_TENSOR]
        elif entry.path == HEAD_PATH:
            state["model.norm.weight"] = tensors[NORM_TENSOR]
            state["lm_head.weight"] = tensors[HEAD_TENSOR]
        else:
            prefix = f"model.layers.{entry.layer_index}."
            state.update({prefix + name: tensor for name, tensor in tensors.items()})
    return state
