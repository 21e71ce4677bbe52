"""Where a stage's tensors come from: a package directory or an in-memory state dict.

Every source answers with the package's tensor names (see mesh/package/manifest.py):
``embed()`` gives ``embed_tokens.weight``; ``head()`` gives ``norm.weight`` and
``lm_head.weight``; ``layer(i)`` gives decoder layer ``i``'s tensors with the
``model.layers.i.`` prefix removed.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from mesh.errors import PackageError
from mesh.package.manifest import PackageFile, PackageManifest
from mesh.runtime.moe import per_expert

EMBED_WEIGHT = "embed_tokens.weight"
NORM_WEIGHT = "norm.weight"
LM_HEAD_WEIGHT = "lm_head.weight"


@runtime_checkable
class WeightSource(Protocol):
    """Tensors of one model, grouped the way stages load them."""

    def embed(self) -> dict[str, torch.Tensor]: ...

    def head(self) -> dict[str, torch.Tensor]: ...

    def layer(self, layer_index: int) -> dict[str, torch.Tensor]: ...


class PackageWeights:
    """Reads a model package's safetensors files (only the ones asked for)."""

    def __init__(self, package_dir: Path, manifest: PackageManifest) -> None:
        self.package_dir = Path(package_dir)
        self.manifest = manifest

    def embed(self) -> dict[str, torch.Tensor]:
        return self._read(self._entry("embed"))

    def head(self) -> dict[str, torch.Tensor]:
        return self._read(self._entry("head"))

    def layer(self, layer_index: int) -> dict[str, torch.Tensor]:
        return self._read(self._entry("layer", layer_index))

    def _entry(self, kind: str, layer_index: int | None = None) -> PackageFile:
        for entry in self.manifest.files:
            if entry.kind == kind and (layer_index is None or entry.layer_index == layer_index):
                return entry
        what = f"layer {layer_index}" if layer_index is not None else kind
        raise PackageError(
            f"package {self.package_dir} lists no file for {what}; "
            "rebuild it with `mesh-package build`"
        )

    def _read(self, entry: PackageFile) -> dict[str, torch.Tensor]:
        path = self.package_dir / entry.path
        if not path.is_file():
            raise PackageError(
                f"{path} is missing: the package slice is not materialised; "
                "prepare the stage's layer range before loading it"
            )
        size = path.stat().st_size
        if size != entry.bytes:
            raise PackageError(
                f"{path} holds {size} bytes but the manifest says {entry.bytes}; "
                "the file is truncated or stale: prepare the slice again"
            )
        try:
            return load_file(str(path), device="cpu")
        except (SafetensorError, OSError) as error:
            raise PackageError(f"cannot read {path} as safetensors: {error}") from error


class StateDictWeights:
    """Serves an HF ``*ForCausalLM`` state dict under the package's tensor names
    (stacked experts split into one weight per expert, as packages store them).

    With ``tied=True`` the head's ``lm_head.weight`` is the embedding matrix, as in a
    package built from a model with tied embeddings.
    """

    def __init__(self, hf_state_dict: Mapping[str, torch.Tensor], tied: bool) -> None:
        self._state = dict(hf_state_dict)
        self._tied = tied

    def embed(self) -> dict[str, torch.Tensor]:
        return {EMBED_WEIGHT: self._get("model.embed_tokens.weight")}

    def head(self) -> dict[str, torch.Tensor]:
        head_name = "model.embed_tokens.weight" if self._tied else "lm_head.weight"
        return {NORM_WEIGHT: self._get("model.norm.weight"), LM_HEAD_WEIGHT: self._get(head_name)}

    def layer(self, layer_index: int) -> dict[str, torch.Tensor]:
        prefix = f"model.layers.{layer_index}."
        found = {
            name[len(prefix) :]: tensor
            for name, tensor in self._state.items()
            if name.startswith(prefix)
        }
        if not found:
            raise PackageError(f"the state dict holds no tensors for decoder layer {layer_index}")
        return per_expert(found)

    def _get(self, name: str) -> torch.Tensor:
        try:
            return self._state[name]
        except KeyError:
            raise PackageError(f"the state dict holds no tensor {name!r}") from None
