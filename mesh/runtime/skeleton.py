"""Build the pieces of an HF decoder a stage owns, and load only their tensors.

The full model is instantiated on the meta device (no memory): its owned layers are
checked for structure and give the expected tensor names and shapes. The tensors
themselves come from a ``WeightSource`` straight into ``DecoderBlock``s, an
``Embedding`` and an LM head, dense or quantised as the package stores them. The
rotary embedding holds no weights and is rebuilt for real on every stage, since
each stage applies it inside its own attention layers.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from mesh.errors import InvalidRequest, PackageError, UnsupportedArchitecture
from mesh.package.manifest import SUPPORTED_ARCHITECTURES
from mesh.quant import EMBED_GROUP, QuantScheme
from mesh.runtime import invariant, moe
from mesh.runtime.block import (
    OFFSET_NORMS,
    BlockShape,
    DecoderBlock,
    block_shape,
    check_structure,
    norm_eps,
)
from mesh.runtime.layer_weights import ModuleTensors, check_finite
from mesh.runtime.linear import (
    DenseLinear,
    Embedding,
    Linear,
    LinearSpec,
    build_linear,
    dense_weight,
    distinct_bytes,
    fuse,
    permute_rows,
)
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
    if resolved.type == "cuda" and (resolved.index or 0) >= torch.cuda.device_count():
        raise InvalidRequest(
            f"device {device!r} requested but this host has {torch.cuda.device_count()} "
            "CUDA device(s) (cuda:0 ...)"
        )
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
    """What one stage computes with. ``embed`` only on the first range; ``norm`` and
    ``lm_head`` only on the last; ``rotary`` (no weights) everywhere, with
    ``rope_kinds`` the layer types it is asked for by name when the model rotates
    layers of different types by different tables (Gemma 3), else None.
    ``logit_cap`` is Gemma 2's ``final_logit_softcapping``."""

    blocks: list[DecoderBlock]
    rotary: nn.Module
    embed: Embedding | None
    norm: torch.Tensor | None
    norm_eps: float
    lm_head: Linear | None
    # Whether every row is computed alike alone or batched (mesh/runtime/invariant.py).
    row_invariant: bool = False
    rope_kinds: tuple[str, ...] | None = None
    logit_cap: float | None = None

    def tensors(self) -> list[torch.Tensor]:
        held: list[torch.Tensor] = []
        for block in self.blocks:
            held += [block.input_norm, block.post_norm]
            for norm in (block.qk_norm, block.attn_out_norm, block.mlp_out_norm):
                held += [] if norm is None else [norm]
            for linear in block.linears():
                held += linear.tensors()
        if self.embed is not None:
            held += self.embed.tensors()
        if self.norm is not None:
            held.append(self.norm)
        if self.lm_head is not None:
            held += self.lm_head.tensors()
        return held

    def param_bytes(self) -> int:
        """Bytes of distinct parameter tensors (a matrix shared by embedding and head
        counts once); quantised weights count in the form the kernels hold them."""
        return distinct_bytes(self.tensors())


def build_stage_modules(
    config: PretrainedConfig,
    weights: WeightSource,
    layer_range: LayerRange,
    device: torch.device,
    dtype: torch.dtype,
    sliding_layers: frozenset[int] = frozenset(),
    scheme: QuantScheme | None = None,
) -> StageModules:
    """Check the layers' structure on a meta-device model, then load ``layer_range``
    (plus embedding or head at the ends) from ``weights`` into blocks on ``device``.
    ``scheme`` is the package's quantisation (None: plain tensors)."""
    check_config_architecture(config, "the model config")
    layer_range.check_within(config.num_hidden_layers)
    is_first = layer_range.is_first()
    is_last = layer_range.is_last(config.num_hidden_layers)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    decoder = skeleton.model
    kind = None if scheme is None else scheme.kind
    group = 0 if scheme is None else scheme.group_size
    row_invariant = invariant.chosen(device, kind in ("int4", "int8"))
    rope_kinds = _rope_kinds(decoder.rotary_emb)
    # GLM rotates interleaved pairs of each head's first dimensions: their q/k rows
    # are reordered into halves as they load (``_halves``).
    interleaved = (
        _rotary_width(decoder.rotary_emb) if config.architectures[0] in _INTERLEAVED else 0
    )
    layer_types = getattr(config, "layer_types", None)

    blocks = []
    for index in layer_range:
        layer = decoder.layers[index]
        check_structure(layer, index)
        tensors = ModuleTensors(
            layer, weights.layer(index), f"decoder layer {index}", kind, group, _shapes(layer)
        )
        sliding = index in sliding_layers
        block = _build_block(
            layer, tensors, index, sliding, device, dtype, row_invariant, interleaved
        )
        if rope_kinds is not None:
            block.rope_index = rope_kinds.index(layer_types[index])
        blocks.append(block)

    embed = None
    embed_weight = None
    # Gemma scales the embedding rows (by the square root of the hidden size).
    scale = getattr(decoder.embed_tokens, "scalar_embed_scale", None)
    embed_scale = None if scale is None or float(scale) == 1.0 else float(scale)
    if is_first:
        found = ModuleTensors(
            decoder.embed_tokens,
            _renamed(weights.embed(), EMBED_WEIGHT),
            "embed",
            "int8g",
            EMBED_GROUP,
        )
        vocab, hidden = decoder.embed_tokens.weight.shape
        if found.has_plain("weight"):
            plain = found.plain("weight")
            if is_last and getattr(config, "tie_word_embeddings", False):
                # The same matrix is the LM head here: store it the way the head reads it.
                embed_weight = dense_weight(plain, device, dtype)
            else:
                embed_weight = plain.to(device=device, dtype=dtype)
            embed = Embedding(device, dtype, weight=embed_weight, scale=embed_scale)
        else:
            parts = found.quant_parts("weight", "int8g", vocab, hidden)
            embed = Embedding(device, dtype, parts=parts, scale=embed_scale)

    norm = lm_head = None
    final_eps = norm_eps(decoder.norm)
    if is_last:
        head = weights.head()
        norms = ModuleTensors(decoder.norm, _renamed(head, NORM_WEIGHT, strict=False), "norm", None)
        norm = _norm_weight(decoder.norm, norms.plain("weight"), device, dtype)
        tied = getattr(config, "tie_word_embeddings", False)
        if embed_weight is not None and tied:
            lm_head = DenseLinear(embed_weight, None, row_invariant)
        else:
            found = ModuleTensors(
                skeleton.lm_head,
                _renamed(head, LM_HEAD_WEIGHT, strict=False),
                "LM head",
                None if scheme is None else scheme.head,
                group,
            )
            lm_head = build_linear(found.linear(""), device, dtype, row_invariant)

    rotary = _rotary_module(decoder.rotary_emb, skeleton.config).to(device)
    rotary.eval()
    return StageModules(
        blocks=blocks,
        rotary=rotary,
        embed=embed,
        norm=norm,
        norm_eps=final_eps,
        lm_head=lm_head,
        row_invariant=row_invariant,
        rope_kinds=rope_kinds,
        logit_cap=_logit_cap(config),
    )


CHECKPOINT_REMEDY = (
    "the checkpoint's weights and its model config do not belong together, or a file is "
    "damaged: fix or re-download the checkpoint"
)


class LayerChecker:
    """Checks decoder layers' tensors as a stage will load them, without loading:
    names, shapes and dtypes against the config's meta-device model. A package build
    runs it on every layer it writes, so that a checkpoint missing a tensor or
    holding one of the wrong shape is refused where it is built, not on the stages."""

    def __init__(
        self,
        config: PretrainedConfig,
        scheme: QuantScheme | None,
        remedy: str = CHECKPOINT_REMEDY,
    ) -> None:
        check_config_architecture(config, "the model config")
        self.remedy = remedy
        with torch.device("meta"):
            self._decoder = AutoModelForCausalLM.from_config(
                config, attn_implementation="eager"
            ).model
        self._kind = None if scheme is None else scheme.kind
        self._group = 0 if scheme is None else scheme.group_size

    def check(self, index: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Raise PackageError (or UnsupportedArchitecture) for layer ``index``."""
        layer = self._decoder.layers[index]
        check_structure(layer, index)
        found = ModuleTensors(
            layer,
            tensors,
            f"decoder layer {index}",
            self._kind,
            self._group,
            _shapes(layer),
            remedy=self.remedy,
        )
        found.check_all()

    def check_finite(self, what: str, tensors: Mapping[str, torch.Tensor]) -> None:
        """PackageError unless every floating-point value of ``tensors`` is finite."""
        for name, tensor in tensors.items():
            if tensor.dtype.is_floating_point:
                check_finite(f"{what}: tensor {name}", tensor, self.remedy)


# Architectures whose rotary embedding turns interleaved pairs (x[2i], x[2i + 1]).
_INTERLEAVED = frozenset({"GlmForCausalLM", "Glm4ForCausalLM"})


def _partial_rotary_factor(config: PretrainedConfig) -> float:
    """The share of each head the model rotates (``partial_rotary_factor``, at the
    top of the config or in its rope parameters; 1 when absent)."""
    rope = getattr(config, "rope_parameters", None)
    factor = rope.get("partial_rotary_factor") if isinstance(rope, dict) else None
    if factor is None:
        factor = getattr(config, "partial_rotary_factor", None)
    return 1.0 if factor is None else float(factor)


def _rotary_module(model_rotary: nn.Module, config: PretrainedConfig) -> nn.Module:
    """The stage's rotary module: a fresh one of the model's own class, except where
    that class turns whole heads while the config rotates only part of each
    (Phi-4-mini, packaged as Llama, whose default-type Llama rotary ignores the
    factor): then Phi-3's module, whose angles are the ones of that part and whose
    other rope types are the generic ones Llama's module uses too."""
    rotary = type(model_rotary)(config=config)
    head_dim = getattr(config, "head_dim", None) or (
        config.hidden_size // config.num_attention_heads
    )
    wanted = int(head_dim * _partial_rotary_factor(config))
    if wanted < head_dim and _rotary_width(rotary) == head_dim:
        from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

        rotary = Phi3RotaryEmbedding(config=config)
        if _rotary_width(rotary) != wanted:
            raise UnsupportedArchitecture(
                f"rotary embedding on {wanted} of each head's {head_dim} dimensions "
                f"(partial_rotary_factor) with rope type {rotary.rope_type!r} is not supported"
            )
    return rotary


def _rotary_width(rotary: nn.Module) -> int:
    """How many dimensions of each head the rotary module turns (its frequencies
    are half of them)."""
    return 2 * int(rotary.inv_freq.shape[0])


def _halves(spec: LinearSpec, heads: int, head_dim: int, width: int) -> LinearSpec:
    """q or k rows with each head's first ``width`` dimensions reordered from
    interleaved pairs into halves (the even ones, then the odd ones): rotated as
    halves they give what the pairs give, and queries meet keys reordered alike."""
    within = torch.arange(head_dim)
    within[:width] = torch.cat((torch.arange(0, width, 2), torch.arange(1, width, 2)))
    order = (torch.arange(heads).unsqueeze(1) * head_dim + within).reshape(-1)
    return permute_rows(spec, order)


def _rope_kinds(rotary: nn.Module) -> tuple[str, ...] | None:
    """The layer types a rotary module computes separate angles for (Gemma 3's
    ``layer_types``), or None when it has one table for every layer."""
    kinds = getattr(rotary, "layer_types", None)
    if not kinds:
        return None
    return tuple(str(kind) for kind in kinds)


def _logit_cap(config: PretrainedConfig) -> float | None:
    cap = getattr(config, "final_logit_softcapping", None)
    return None if cap is None else float(cap)


def _norm_weight(
    norm: nn.Module, weight: torch.Tensor, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """A norm's weight as ``rms_norm`` applies it: Gemma's ``1 + weight`` in float32
    (``OFFSET_NORMS``), others in the compute dtype."""
    if type(norm).__name__ in OFFSET_NORMS:
        return (1.0 + weight.to(device=device, dtype=torch.float32)).contiguous()
    return weight.to(device=device, dtype=dtype)


def _build_block(
    layer: nn.Module,
    tensors: ModuleTensors,
    index: int,
    sliding: bool,
    device: torch.device,
    dtype: torch.dtype,
    row_invariant: bool,
    interleaved: int = 0,
) -> DecoderBlock:
    """One layer's block; ``interleaved`` is the rotary width of a model that turns
    interleaved pairs (0: halves, as HF's ``rotate_half``)."""
    norm_names = [f"{name}.weight" for name, _ in layer.named_children() if name.endswith("norm")]
    if hasattr(layer.self_attn, "q_norm"):
        norm_names += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    norms = {
        name: _norm_weight(
            layer.get_submodule(name.removesuffix(".weight")), tensors.plain(name), device, dtype
        )
        for name in norm_names
    }
    attn = [tensors.linear(f"self_attn.{name}_proj") for name in ("q", "k", "v")]
    shape = block_shape(layer)
    if interleaved:
        attn[0] = _halves(attn[0], shape.heads, shape.head_dim, interleaved)
        attn[1] = _halves(attn[1], shape.kv_heads, shape.head_dim, interleaved)
    gate_up = down = experts = None
    if moe.is_sparse(layer):
        experts = _build_experts(layer, tensors, shape, device, dtype, row_invariant)
    elif hasattr(layer.mlp, "gate_up_proj"):
        gate_up = build_linear(tensors.linear("mlp.gate_up_proj"), device, dtype, row_invariant)
        down = build_linear(tensors.linear("mlp.down_proj"), device, dtype, row_invariant)
    else:
        mlp = [tensors.linear(f"mlp.{name}_proj") for name in ("gate", "up")]
        gate_up = build_linear(fuse(mlp), device, dtype, row_invariant)
        down = build_linear(tensors.linear("mlp.down_proj"), device, dtype, row_invariant)
    return DecoderBlock(
        shape,
        index,
        sliding,
        norms,
        qkv=build_linear(fuse(attn), device, dtype, row_invariant),
        o=build_linear(tensors.linear("self_attn.o_proj"), device, dtype, row_invariant),
        gate_up=gate_up,
        down=down,
        row_invariant=row_invariant,
        experts=experts,
    )


def _shapes(layer: nn.Module) -> dict[str, tuple[int, ...]] | None:
    """A sparse layer's package tensor names and shapes (its experts one by one);
    None for a dense layer, whose names are its state dict's."""
    if not moe.is_sparse(layer):
        return None
    shapes = {
        name: tuple(tensor.shape)
        for name, tensor in layer.state_dict().items()
        if not name.startswith("mlp.")
    }
    shapes.update(moe.expert_shapes(layer))
    return shapes


def _build_experts(
    layer: nn.Module,
    tensors: ModuleTensors,
    shape: BlockShape,
    device: torch.device,
    dtype: torch.dtype,
    row_invariant: bool,
) -> moe.SparseExperts:
    """The router (kept in floats, as the package stores it), every expert, and the
    shared expert where the layer has one."""
    routing = moe.routing_of(layer)
    assert routing is not None  # check_structure refused any other router
    router_name = moe.ROUTER_WEIGHT.removesuffix(".weight")
    grouped = routing.rule == "grouped_sigmoid"
    # GLM-4.5's router runs in float32, as transformers keeps it.
    router_dtype = torch.float32 if grouped else dtype
    router = build_linear(tensors.linear(router_name), device, router_dtype, row_invariant)
    bias = None
    if grouped and tensors.has_plain(moe.ROUTER_BIAS):
        bias = tensors.plain(moe.ROUTER_BIAS).to(device=device, dtype=torch.float32)

    def gated_mlp(gate: str, up: str, out: str) -> tuple[Linear, Linear]:
        fused = fuse([tensors.linear(gate), tensors.linear(up)])
        return (
            build_linear(fused, device, dtype, row_invariant),
            build_linear(tensors.linear(out), device, dtype, row_invariant),
        )

    gate_up: list[Linear] = []
    down: list[Linear] = []
    for expert in range(routing.experts):
        fused, out = gated_mlp(*moe.expert_names(expert))
        gate_up.append(fused)
        down.append(out)
    shared = None
    gated = moe.has_shared_expert(layer)
    if gated or moe.has_ungated_shared_experts(layer):
        prefix = moe.SHARED_PREFIX if gated else moe.UNGATED_SHARED_PREFIX
        fused, out = gated_mlp(prefix + "gate_proj", prefix + "up_proj", prefix + "down_proj")
        shared = moe.SharedExpert(gate_up=fused, down=out)
        if gated:
            # Qwen2-MoE's shared expert is scaled by the sigmoid of its own gate.
            gate_name = moe.SHARED_GATE_WEIGHT.removesuffix(".weight")
            shared.gate = build_linear(tensors.linear(gate_name), device, dtype, row_invariant)
    return moe.SparseExperts(routing, router, gate_up, down, shape.act, shared, bias)


def _renamed(
    tensors: Mapping[str, torch.Tensor], name: str, strict: bool = True
) -> dict[str, torch.Tensor]:
    """The tensors stored under package name ``name`` (and its quantised parts) renamed
    to the module's own ``weight``; with ``strict``, nothing else may be there."""
    renamed = {
        "weight" + key[len(name) :]: tensor
        for key, tensor in tensors.items()
        if key == name or key.startswith(name + ".")
    }
    if not renamed:
        raise PackageError(f"weights are missing tensor {name}")
    if strict and len(renamed) != len(tensors):
        extra = sorted(k for k in tensors if k != name and not k.startswith(name + "."))
        raise PackageError(f"unexpected tensor(s) next to {name}: {', '.join(extra[:6])}")
    return renamed
