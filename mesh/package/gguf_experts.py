"""Mixture-of-experts tensors and settings of GGUF models (Qwen3-MoE, Qwen2-MoE,
Mixtral).

llama.cpp stores a layer's router as ``blk.N.ffn_gate_inp`` ``[experts, hidden]``
and its experts stacked, one tensor per projection: ``blk.N.ffn_gate_exps`` and
``ffn_up_exps`` ``[experts, inner, hidden]``, ``ffn_down_exps`` ``[experts, hidden,
inner]`` (torch order). Packages store one weight per expert, so each stacked tensor
is read as ``experts`` tensors, expert ``E`` being rows ``E * inner ..`` of it: a
build reads one expert's rows at a time, never the whole stack. Older Mixtral files
hold one tensor per expert (``blk.N.ffn_gate.E.weight``); those map one to one.

transformers reads a GGUF's config only partly for these models: for ``qwen3moe``
it leaves the experts' inner size at its default, and a Mixtral file (architecture
``llama`` with ``llama.expert_count``) comes out as a dense Llama config.
``moe_config`` fixes both from the file's own metadata and tensors.
"""

from __future__ import annotations

import re
from typing import Any

from mesh.errors import PackageError

_STACKED = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")
_SINGLE = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight$")
_ROUTER = re.compile(r"^blk\.(\d+)\.ffn_gate_inp\.weight$")
_ROUTER_NAME = "model.layers.{layer}.mlp.gate.weight"
_EXPERT_NAME = "model.layers.{layer}.mlp.experts.{expert}.{projection}_proj.weight"
# Config keys of a dense Llama / Mistral config that carry over to Mixtral's.
_MIXTRAL_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_parameters",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
)


def expert_names(gguf_name: str, shape: tuple[int, ...]) -> list[tuple[str, int | None]]:
    """The HF names a GGUF expert or router tensor of ``shape`` (torch order) holds,
    each with the expert it is in the stacked tensor (None: the whole tensor); an
    empty list for any other tensor."""
    match = _STACKED.match(gguf_name)
    if match:
        layer, projection = match.groups()
        if len(shape) != 3:
            raise PackageError(
                f"GGUF tensor {gguf_name} has shape {shape}; stacked experts are "
                "[experts, rows, columns]"
            )
        return [
            (_EXPERT_NAME.format(layer=layer, expert=expert, projection=projection), expert)
            for expert in range(shape[0])
        ]
    match = _SINGLE.match(gguf_name)
    if match:
        layer, projection, expert = match.groups()
        name = _EXPERT_NAME.format(layer=layer, expert=expert, projection=projection)
        return [(name, None)]
    match = _ROUTER.match(gguf_name)
    if match:
        return [(_ROUTER_NAME.format(layer=match.group(1)), None)]
    return []


def moe_config(
    architecture: str, metadata: dict[str, int], tensors: dict[str, Any], config: Any
) -> Any:
    """``config`` (a transformers config, as transformers read it from a GGUF of
    ``architecture``) with the mixture-of-experts settings the file holds;
    unchanged for a dense model. ``tensors`` are the file's, by GGUF name."""
    experts = metadata.get("expert_count", 0)
    if not experts:
        return config
    used = metadata.get("expert_used_count", 0)
    if not 0 < used <= experts:
        raise PackageError(
            f"GGUF metadata says {experts} experts with {used} used per token; "
            "the file is not a usable mixture-of-experts model"
        )
    layers = int(config.num_hidden_layers)
    sparse = [i for i in range(layers) if _is_sparse(tensors, i)]
    inner = _inner_size(tensors, sparse)
    if architecture == "qwen2moe":
        shared = metadata.get("expert_shared_feed_forward_length", 0) or _shared_size(
            tensors, sparse
        )
        if not shared:
            raise PackageError(
                "GGUF qwen2moe model without shared experts (no ffn_*_shexp tensors); "
                "Qwen2-MoE layers have one"
            )
        config.shared_expert_intermediate_size = shared
        # llama.cpp's qwen2moe graph leaves the chosen experts' weights as the router
        # gives them, as Qwen2-MoE's own config does.
        config.norm_topk_prob = False
        return _qwen_moe(config, inner, experts, used, sparse)
    if architecture == "qwen3moe":
        return _qwen_moe(config, inner, experts, used, sparse)
    if architecture == "llama" and config.model_type in ("llama", "mistral"):
        from transformers import MixtralConfig

        if len(sparse) != layers:
            raise PackageError(
                f"GGUF llama model with {experts} experts has dense feed-forward layers "
                f"{[i for i in range(layers) if i not in sparse][:8]}; Mixtral layers are "
                "all sparse"
            )
        values = {key: getattr(config, key) for key in _MIXTRAL_KEYS if hasattr(config, key)}
        values["intermediate_size"] = inner
        return MixtralConfig(
            **values,
            num_local_experts=experts,
            num_experts_per_tok=used,
            sliding_window=None,
            router_aux_loss_coef=0.0,
        )
    return config


def _qwen_moe(config: Any, inner: int, experts: int, used: int, sparse: list[int]) -> Any:
    """The expert settings Qwen2-MoE and Qwen3-MoE configs share: every layer of
    ``sparse`` routes to experts, the others are dense."""
    config.moe_intermediate_size = inner
    config.num_experts = experts
    config.num_experts_per_tok = used
    config.decoder_sparse_step = 1
    config.mlp_only_layers = [i for i in range(int(config.num_hidden_layers)) if i not in sparse]
    return config


def _is_sparse(tensors: dict[str, Any], layer: int) -> bool:
    return f"blk.{layer}.ffn_gate_inp.weight" in tensors


def _inner_size(tensors: dict[str, Any], sparse: list[int]) -> int:
    """The experts' inner size, from the first sparse layer's gate projection."""
    for layer in sparse:
        stacked = tensors.get(f"blk.{layer}.ffn_gate_exps.weight")
        if stacked is not None:
            return int(stacked.shape[1])
        single = tensors.get(f"blk.{layer}.ffn_gate.0.weight")
        if single is not None:
            return int(single.shape[0])
    raise PackageError(
        "GGUF metadata declares experts but no layer holds expert weights "
        "(blk.N.ffn_gate_exps.weight)"
    )


def _shared_size(tensors: dict[str, Any], sparse: list[int]) -> int:
    """The shared expert's inner size, from the first sparse layer's gate projection
    (0 where there is none)."""
    for layer in sparse:
        gate = tensors.get(f"blk.{layer}.ffn_gate_shexp.weight")
        if gate is not None:
            return int(gate.shape[0])
    return 0
