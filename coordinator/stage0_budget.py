"""Stage 0's memory beyond its layers: the draft model, when speculation drafts with
one. The planner charges it to stage 0 (``ModelFootprint.stage0_extra_bytes``), so
that a stage 0 with a stated or measured memory gets fewer layers by it.

The draft's weights are its safetensors files as stored; its KV budget is one cache
per concurrent request at full length: ``max_sessions * max_tokens_per_session * 2
(K and V) * layers * kv_heads * head_dim * dtype bytes``. The draft must be on this
host (a local path, or in the Hugging Face cache) to be measured; otherwise (or for a
GGUF draft, whose loaded size its file does not tell) nothing is budgeted and the
log says so.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from mesh.config import DRAFT_TYPES, DraftRef, SpeculationConfig

logger = logging.getLogger(__name__)

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class DraftBudget:
    weight_bytes: int
    kv_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes


def draft_budget(
    speculation: SpeculationConfig, *, max_sessions: int, max_tokens_per_session: int
) -> DraftBudget | None:
    """The draft model's budget on stage 0, or None without a measurable draft."""
    ref = speculation.draft_model
    if speculation.type not in DRAFT_TYPES or ref is None:
        return None
    folder = _draft_folder(ref)
    if folder is None or not (folder / "config.json").is_file():
        logger.warning(
            "draft model %s: not budgeted in the layer plan (no config.json and safetensors "
            "files on this host); stage 0 needs room for it beyond its layers: name a local "
            "directory with both, or state less memory for a joined stage 0 (mesh-stage "
            "join --memory)",
            ref,
        )
        return None
    config = json.loads((folder / "config.json").read_text())
    weights = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    return DraftBudget(
        weight_bytes=weights,
        kv_bytes=draft_kv_bytes(config, max_sessions, max_tokens_per_session),
    )


def draft_kv_bytes(config: dict, max_sessions: int, max_tokens_per_session: int) -> int:
    """KV bytes for ``max_sessions`` full-length draft caches of a model ``config``."""
    heads = int(config.get("num_attention_heads", 1))
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    layers = int(config["num_hidden_layers"])
    dtype = _DTYPE_BYTES.get(str(config.get("torch_dtype", "float32")), 4)
    return max_sessions * max_tokens_per_session * 2 * layers * kv_heads * head_dim * dtype


def _draft_folder(ref: DraftRef) -> Path | None:
    if ref.is_local:
        path = Path(ref.repo_or_path).expanduser()
        return path if path.is_dir() else None
    if ref.quant is not None:
        return None
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    from mesh.package.hub import hub_cache_dir

    try:
        return Path(
            snapshot_download(ref.repo_or_path, cache_dir=hub_cache_dir(), local_files_only=True)
        )
    except LocalEntryNotFoundError:
        return None


def stage0_extra_bytes(
    speculation: SpeculationConfig, max_sessions: int, max_tokens_per_session: int
) -> int:
    """Bytes the plan charges to stage 0 besides the model (0 without a draft model)."""
    budget = draft_budget(
        speculation, max_sessions=max_sessions, max_tokens_per_session=max_tokens_per_session
    )
    if budget is None:
        return 0
    logger.info(
        "stage 0 budget for the draft model %s: %.2f GiB of weights, %.2f GiB of KV",
        speculation.draft_model,
        budget.weight_bytes / 2**30,
        budget.kv_bytes / 2**30,
    )
    return budget.total_bytes
