"""What the coordinator reads of a model package: its manifest and config."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from mesh.errors import PackageError
from mesh.package import hub
from mesh.package.manifest import MANIFEST_NAME, PackageManifest
from mesh.package.resolver import resolve_ref


@dataclass(frozen=True)
class ModelInfo:
    ref: str
    manifest: PackageManifest
    config: dict[str, Any]

    @property
    def num_kv_heads(self) -> int:
        heads = self.config.get("num_attention_heads", 1)
        return int(self.config.get("num_key_value_heads") or heads)

    @property
    def head_dim(self) -> int:
        explicit = self.config.get("head_dim")
        if explicit:
            return int(explicit)
        return int(self.config["hidden_size"]) // int(self.config.get("num_attention_heads", 1))

    @property
    def context_length(self) -> int:
        return int(self.config.get("max_position_embeddings") or 2048)


def read_model(ref: str) -> ModelInfo:
    """Manifest and config of a local package directory or an HF package repo."""
    origin = resolve_ref(ref)
    if origin.local_dir is not None:
        manifest = PackageManifest.load(origin.local_dir)
        config_path = origin.local_dir / "config.json"
    else:
        manifest_path = hub.download_file(origin.repo, MANIFEST_NAME)
        manifest = PackageManifest.from_json(
            _read_json(manifest_path, f"{origin.repo}/{MANIFEST_NAME}"),
            origin=f"{origin.repo}/{MANIFEST_NAME}",
        )
        config_path = hub.download_file(origin.repo, "config.json")
    if not config_path.is_file():
        raise PackageError(f"{config_path} not found: the package has no config.json")
    return ModelInfo(ref=ref, manifest=manifest, config=_read_json(config_path, str(config_path)))


def _read_json(path, where: str) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise PackageError(f"{where} is not valid JSON: {error}") from error
