"""A lean forward pass over the tensors of one HF decoder layer.

The supported families (Llama, Mistral, Qwen2, Qwen3) share one layer shape:
RMSNorm, attention with rotary embeddings (optional q/k/v biases, optional per-head
q/k RMSNorm), RMSNorm, gated MLP. ``DecoderBlock`` reads the tensors out of the HF
layer module and runs the same arithmetic in the same order as transformers does,
without the module call machinery, writing keys and values into the session's
preallocated cache. A layer with any other structure is refused at load time.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mesh.errors import UnsupportedArchitecture
from mesh.runtime.sessions import SessionCache

_LAYER_PARTS = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
_ATTENTION_PARTS = {"q_proj", "k_proj", "v_proj", "o_proj"}
_QK_NORMS = {"q_norm", "k_norm"}
_MLP_PARTS = {"gate_proj", "up_proj", "down_proj", "act_fn"}


def rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm: statistics in float32, scale applied in the input dtype."""
    dtype = hidden.dtype
    states = hidden.to(torch.float32)
    variance = states.pow(2).mean(-1, keepdim=True)
    return weight * (states * torch.rsqrt(variance + eps)).to(dtype)


def apply_rotary(states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = states.shape[-1] // 2
    rotated = torch.cat((-states[..., half:], states[..., :half]), dim=-1)
    return states * cos + rotated * sin


def attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    groups: int,
) -> torch.Tensor:
    """SDPA dispatched the way transformers' sdpa integration does on this input.

    ``query`` is ``[1, heads, T, D]``; ``keys``/``values`` ``[1, kv_heads, L, D]``;
    ``mask`` is None (a fresh causal prefill, or one query seeing every key) or a
    boolean ``[1, 1, T, L]``. Returns ``[1, heads, T, D]``.
    """
    count = query.shape[2]
    if mask is None:
        return F.scaled_dot_product_attention(
            query, keys, values, scale=scaling, is_causal=count > 1, enable_gqa=groups > 1
        )
    if groups > 1 and count == 1:
        batch, heads, _, dim = query.shape
        packed = query.reshape(batch, heads // groups, groups, dim)
        output = F.scaled_dot_product_attention(packed, keys, values, attn_mask=mask, scale=scaling)
        return output.reshape(batch, heads, count, dim)
    if groups > 1:
        batch, kv_heads, length, dim = keys.shape
        shape = (batch, kv_heads, groups, length, dim)
        keys = keys[:, :, None].expand(shape).reshape(batch, kv_heads * groups, length, dim)
        values = values[:, :, None].expand(shape).reshape(batch, kv_heads * groups, length, dim)
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scaling)


class DecoderBlock:
    """One decoder layer's tensors and its forward over a session cache."""

    __slots__ = (
        "layer_index",
        "sliding",
        "head_dim",
        "groups",
        "scaling",
        "norm_eps",
        "input_norm",
        "post_norm",
        "q_norm",
        "k_norm",
        "qk_norm_eps",
        "q",
        "k",
        "v",
        "o",
        "gate",
        "up",
        "down",
        "act",
    )

    def __init__(self, layer: nn.Module, layer_index: int, sliding: bool) -> None:
        _check_structure(layer, layer_index)
        attn, mlp = layer.self_attn, layer.mlp
        self.layer_index = layer_index
        self.sliding = sliding
        self.head_dim = int(attn.head_dim)
        self.groups = int(attn.num_key_value_groups)
        self.scaling = float(attn.scaling)
        self.norm_eps = float(layer.input_layernorm.variance_epsilon)
        self.input_norm = layer.input_layernorm.weight
        self.post_norm = layer.post_attention_layernorm.weight
        qk = hasattr(attn, "q_norm")
        self.q_norm = attn.q_norm.weight if qk else None
        self.k_norm = attn.k_norm.weight if qk else None
        self.qk_norm_eps = float(attn.q_norm.variance_epsilon) if qk else 0.0
        self.q = (attn.q_proj.weight, attn.q_proj.bias)
        self.k = (attn.k_proj.weight, attn.k_proj.bias)
        self.v = (attn.v_proj.weight, attn.v_proj.bias)
        self.o = (attn.o_proj.weight, attn.o_proj.bias)
        self.gate = (mlp.gate_proj.weight, mlp.gate_proj.bias)
        self.up = (mlp.up_proj.weight, mlp.up_proj.bias)
        self.down = (mlp.down_proj.weight, mlp.down_proj.bias)
        self.act: Callable[[torch.Tensor], torch.Tensor] = mlp.act_fn

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: SessionCache,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """``hidden`` ``[1, T, hidden]``; ``cos``/``sin`` ``[1, 1, T, D]``."""
        batch, count, _ = hidden.shape
        heads_shape = (batch, count, -1, self.head_dim)
        states = rms_norm(hidden, self.input_norm, self.norm_eps)
        query = F.linear(states, *self.q).view(heads_shape)
        key = F.linear(states, *self.k).view(heads_shape)
        value = F.linear(states, *self.v).view(heads_shape).transpose(1, 2)
        if self.q_norm is not None:
            query = rms_norm(query, self.q_norm, self.qk_norm_eps)
            key = rms_norm(key, self.k_norm, self.qk_norm_eps)
        query = apply_rotary(query.transpose(1, 2), cos, sin)
        key = apply_rotary(key.transpose(1, 2), cos, sin)
        keys, values = cache.update(key, value, self.layer_index)
        attended = attention(query, keys, values, mask, self.scaling, self.groups)
        attended = attended.transpose(1, 2).reshape(batch, count, -1)
        hidden = hidden + F.linear(attended, *self.o)
        states = rms_norm(hidden, self.post_norm, self.norm_eps)
        gated = self.act(F.linear(states, *self.gate)) * F.linear(states, *self.up)
        return hidden + F.linear(gated, *self.down)


def _check_structure(layer: nn.Module, layer_index: int) -> None:
    """Refuse a layer whose parts differ from the shape ``DecoderBlock`` computes."""
    problems: list[str] = []
    parts = {name for name, _ in layer.named_children()}
    if parts != _LAYER_PARTS:
        problems.append(f"layer parts {sorted(parts)}")
    else:
        attn_parts = {name for name, _ in layer.self_attn.named_children()}
        if attn_parts not in (_ATTENTION_PARTS, _ATTENTION_PARTS | _QK_NORMS):
            problems.append(f"attention parts {sorted(attn_parts)}")
        mlp_parts = {name for name, _ in layer.mlp.named_children()}
        if mlp_parts - {"act_fn"} != _MLP_PARTS - {"act_fn"}:
            problems.append(f"MLP parts {sorted(mlp_parts)}")
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        norms += [getattr(layer.self_attn, name) for name in _QK_NORMS & attn_parts]
        for norm in norms:
            if not type(norm).__name__.endswith("RMSNorm") or not hasattr(norm, "variance_epsilon"):
                problems.append(f"norm {type(norm).__name__}")
        if not callable(getattr(layer.mlp, "act_fn", None)):
            problems.append("MLP without act_fn")
    if problems:
        raise UnsupportedArchitecture(
            f"decoder layer {layer_index} ({type(layer).__name__}) has an unexpected structure "
            f"({'; '.join(problems)}); the runtime runs Llama, Mistral, Qwen2 and Qwen3 layers"
        )
