"""Build the pieces of an HF decoder a stage owns, and load only their tensors.

The full model is instantiated on the meta device (no memory), the owned modules
are picked out of it, and their parameters are replaced by real tensors from a
``WeightSource``. The rotary embedding holds no weights and is rebuilt for real on
every stage, since each stage applies it inside its own attention layers.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from mesh.errors import InvalidRequest, PackageError, UnsupportedArchitecture
from mesh.package.manifest import SUPPORTED_ARCHITECTURES
from mesh.runtime.weights import EMBED_WEIGHT, LM_HEAD_WEIGHT, NORM_WEIGHT, WeightSource
from mesh.types import LayerRange

logger = logging.getLogger(__name__)

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def resolve_dtype(dtype: str) -> torch.dtype:
    try:
        return TORCH_DTYPES[dtype]
    except KeyError:
        raise InvalidRequest(
            f"dtype {dtype!r} is not supported; use one of {', '.join(TORCH_DTYPES)}"
        ) from None


def resolve_device(device: str) -> torch.device:
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise InvalidRequest(f"device {device!r} is not a torch device: {error}") from error
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise InvalidRequest(f"device {device!r} requested but CUDA is not available here")
    if resolved.type == "meta":
        raise InvalidRequest("device 'meta' holds no data; choose cpu or cuda")
    return resolved


def check_config_architecture(config: PretrainedConfig, origin: str) -> str:
    """The config's architecture, or UnsupportedArchitecture naming the supported ones."""
    names = getattr(config, "architectures", None) or []
    architecture = names[0] if names else None
    if architecture not in SUPPORTED_ARCHITECTURES:
        described = repr(architecture) if architecture else "no architecture"
        raise UnsupportedArchitecture(
            f"{origin} declares {described}; the runtime can split only: "
            + ", ".join(SUPPORTED_ARCHITECTURES)
        )
    return architecture


def load_config(package_dir: Path) -> PretrainedConfig:
    """Read ``config.json`` from a package directory and check its architecture."""
    path = Path(package_dir) / "config.json"
    if not path.is_file():
        raise PackageError(f"{path} not found: a package needs the model's config.json")
    try:
        config = AutoConfig.from_pretrained(str(package_dir))
    except (OSError, ValueError, KeyError) as error:
        raise PackageError(f"cannot read {path}: {error}") from error
    check_config_architecture(config, str(path))
    return config


@dataclass(frozen=True)
class StageModules:
    """The real modules of one stage. ``embed`` only on the first range; ``norm`` and
    ``lm_head`` only on the last; ``rotary`` everywhere."""

    layers: nn.ModuleList
    rotary: nn.Module
    embed: nn.Embedding | None
    norm: nn.Module | None
    lm_head: nn.Linear | None

    def parameters(self) -> Iterable[nn.Parameter]:
        for module in (self.embed, self.layers, self.norm, self.lm_head):
            if module is not None:
                yield from module.parameters()

    def param_bytes(self) -> int:
        """Bytes of distinct parameters (a matrix shared by embedding and head counts once)."""
        seen: set[int] = set()
        total = 0
        for param in self.parameters():
            if param.data_ptr() not in seen:
                seen.add(param.data_ptr())
                total += param.numel() * param.element_size()
        return total


def build_stage_modules(
    config: PretrainedConfig,
    weights: WeightSource,
    layer_range: LayerRange,
    device: torch.device,
    dtype: torch.dtype,
) -> StageModules:
    """Instantiate the model on meta, keep ``layer_range`` (plus ends), load tensors."""
    check_config_architecture(config, "the model config")
    layer_range.check_within(config.num_hidden_layers)
    is_first = layer_range.is_first()
    is_last = layer_range.is_last(config.num_hidden_layers)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    decoder = skeleton.model

    layers = nn.ModuleList([decoder.layers[i] for i in layer_range])
    for index, layer in zip(layer_range, layers, strict=True):
        _assign(layer, weights.layer(index), device, dtype, f"decoder layer {index}")

    embed = None
    if is_first:
        embed = decoder.embed_tokens
        _assign(embed, _renamed(weights.embed(), {EMBED_WEIGHT: "weight"}), device, dtype, "embed")

    norm = lm_head = None
    if is_last:
        norm, lm_head = decoder.norm, skeleton.lm_head
        head = weights.head()
        _assign(norm, _renamed(head, {NORM_WEIGHT: "weight"}), device, dtype, "final norm")
        if embed is not None and getattr(config, "tie_word_embeddings", False):
            lm_head.weight = embed.weight
        else:
            _assign(lm_head, _renamed(head, {LM_HEAD_WEIGHT: "weight"}), device, dtype, "LM head")

    rotary = type(decoder.rotary_emb)(config=skeleton.config).to(device)
    modules = StageModules(layers=layers, rotary=rotary, embed=embed, norm=norm, lm_head=lm_head)
    for module in (layers, embed, norm, lm_head, rotary):
        if module is not None:
            module.eval()
            module.requires_grad_(False)
    _check_materialised(modules)
    return modules


def _renamed(tensors: Mapping[str, torch.Tensor], names: dict[str, str]) -> dict[str, torch.Tensor]:
    missing = sorted(set(names) - set(tensors))
    if missing:
        raise PackageError(f"weights are missing tensor(s) {', '.join(missing)}")
    return {new: tensors[old] for old, new in names.items()}


def _assign(
    module: nn.Module,
    tensors: Mapping[str, torch.Tensor],
    device: torch.device,
    dtype: torch.dtype,
    what: str,
) -> None:
    """Replace the module's meta parameters with the given tensors on device/dtype."""
    expected = module.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise PackageError(
            f"{what}: tensor names do not match the model config "
            f"(missing: {missing[:6] or 'none'}; unexpected: {unexpected[:6] or 'none'}); "
            "the package was built for a different model: rebuild it"
        )
    converted: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise PackageError(
                f"{what}: tensor {name} has shape {tuple(tensor.shape)}, "
                f"the config expects {tuple(expected[name].shape)}; rebuild the package"
            )
        target_dtype = dtype if tensor.is_floating_point() else tensor.dtype
        converted[name] = tensor.detach().to(device=device, dtype=target_dtype).contiguous()
    module.load_state_dict(converted, strict=True, assign=True)


def _check_materialised(modules: StageModules) -> None:
    for module in (modules.embed, modules.layers, modules.norm, modules.lm_head, modules.rotary):
        if module is None:
            continue
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            if tensor.is_meta:
                raise PackageError(f"tensor {name} was not loaded from the package")
