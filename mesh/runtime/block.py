"""A lean forward pass over the tensors of one HF decoder layer.

The supported families (Llama, Mistral, Qwen2, Qwen3) share one layer shape:
RMSNorm, attention with rotary embeddings (optional q/k/v biases, optional per-head
q/k RMSNorm), RMSNorm, gated MLP. ``DecoderBlock`` holds one layer's weights (dense
or quantised) and runs the same arithmetic in the same order as transformers does,
without the module call machinery, writing keys and values into the session's
preallocated cache. The HF layer module is built on the meta device only to check
its structure and read its shape; a layer with any other structure is refused at
load time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mesh.errors import UnsupportedArchitecture
from mesh.runtime.linear import Linear
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
    if groups > 1 and count == 1:
        # One query per head: the heads sharing a key/value head become that head's
        # query rows, so SDPA runs without repeating keys (several times faster than
        # enable_gqa in bfloat16 on CPU).
        batch, heads, _, dim = query.shape
        packed = query.reshape(batch, heads // groups, groups, dim)
        output = F.scaled_dot_product_attention(packed, keys, values, attn_mask=mask, scale=scaling)
        return output.reshape(batch, heads, count, dim)
    if mask is None:
        return F.scaled_dot_product_attention(
            query, keys, values, scale=scaling, is_causal=count > 1, enable_gqa=groups > 1
        )
    if groups > 1:
        batch, kv_heads, length, dim = keys.shape
        shape = (batch, kv_heads, groups, length, dim)
        keys = keys[:, :, None].expand(shape).reshape(batch, kv_heads * groups, length, dim)
        values = values[:, :, None].expand(shape).reshape(batch, kv_heads * groups, length, dim)
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scaling)


class DecoderBlock:
    """One decoder layer's weights and its forward over a session cache.

    q/k/v run as one fused linear and gate/up as another (see ``fuse``); every
    linear is dense or quantised (mesh/runtime/linear.py).
    """

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
        "qkv",
        "qkv_split",
        "o",
        "gate_up",
        "down",
        "act",
    )

    def __init__(
        self,
        shape: BlockShape,
        layer_index: int,
        sliding: bool,
        norms: dict[str, torch.Tensor],
        qkv: Linear,
        o: Linear,
        gate_up: Linear,
        down: Linear,
    ) -> None:
        self.layer_index = layer_index
        self.sliding = sliding
        self.head_dim = shape.head_dim
        self.groups = shape.heads // shape.kv_heads
        self.scaling = shape.scaling
        self.norm_eps = shape.norm_eps
        self.input_norm = norms["input_layernorm.weight"]
        self.post_norm = norms["post_attention_layernorm.weight"]
        self.q_norm = norms.get("self_attn.q_norm.weight")
        self.k_norm = norms.get("self_attn.k_norm.weight")
        self.qk_norm_eps = shape.norm_eps
        q_out = shape.heads * shape.head_dim
        kv_out = shape.kv_heads * shape.head_dim
        self.qkv_split = (q_out, kv_out, kv_out)
        self.qkv = qkv
        self.o = o
        self.gate_up = gate_up
        self.down = down
        self.act: Callable[[torch.Tensor], torch.Tensor] = shape.act

    def linears(self) -> list[Linear]:
        return [self.qkv, self.o, self.gate_up, self.down]

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: SessionCache,
        mask: torch.Tensor | None,
        step: Callable[..., torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``hidden`` ``[1, T, hidden]``; ``cos``/``sin`` ``[1, 1, T, D]``. ``step``
        replaces ``run_block`` (with a compiled version of it)."""
        keys, values = cache.layer(self.layer_index)
        return (step or run_block)(self, hidden, cos, sin, keys, values, cache.write_at, mask)


def run_block(
    block: DecoderBlock,
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    at: int,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """One layer over a frame of ``T`` tokens at positions ``at ..``: writes the frame's
    keys and values into the layer's cache ``keys``/``values`` ``[1, kv_heads, C, D]``
    and attends over positions ``0 .. at + T``. A plain function of its arguments, so
    one compiled version serves every layer."""
    batch, count, _ = hidden.shape
    heads_shape = (batch, count, -1, block.head_dim)
    states = rms_norm(hidden, block.input_norm, block.norm_eps)
    query, key, value = block.qkv(states).split(block.qkv_split, dim=-1)
    query = query.reshape(heads_shape)
    key = key.reshape(heads_shape)
    value = value.reshape(heads_shape).transpose(1, 2)
    if block.q_norm is not None:
        query = rms_norm(query, block.q_norm, block.qk_norm_eps)
        key = rms_norm(key, block.k_norm, block.qk_norm_eps)  # type: ignore[arg-type]
    query = apply_rotary(query.transpose(1, 2), cos, sin)
    key = apply_rotary(key.transpose(1, 2), cos, sin)
    keys.narrow(2, at, count).copy_(key)
    values.narrow(2, at, count).copy_(value)
    end = at + count
    attended = attention(
        query, keys.narrow(2, 0, end), values.narrow(2, 0, end), mask, block.scaling, block.groups
    )
    attended = attended.transpose(1, 2).reshape(batch, count, -1)
    hidden = hidden + block.o(attended)
    states = rms_norm(hidden, block.post_norm, block.norm_eps)
    gate, up = block.gate_up(states).chunk(2, dim=-1)
    return hidden + block.down(block.act(gate) * up)


@dataclass(frozen=True)
class BlockShape:
    """What a decoder layer's arithmetic needs from the model config."""

    heads: int
    kv_heads: int
    head_dim: int
    scaling: float
    norm_eps: float
    act: Callable[[torch.Tensor], torch.Tensor]


def block_shape(layer: nn.Module) -> BlockShape:
    """Read the shape of a (meta-device) HF decoder layer, after checking its structure."""
    attn = layer.self_attn
    head_dim = int(attn.head_dim)
    heads = int(attn.q_proj.out_features) // head_dim
    kv_heads = int(attn.k_proj.out_features) // head_dim
    norms = [layer.self_attn.q_norm] if hasattr(attn, "q_norm") else []
    eps = float(layer.input_layernorm.variance_epsilon)
    for norm in [layer.post_attention_layernorm, *norms]:
        if float(norm.variance_epsilon) != eps:
            raise UnsupportedArchitecture(
                "decoder layers whose norms use different epsilons are not supported"
            )
    return BlockShape(
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        scaling=float(attn.scaling),
        norm_eps=eps,
        act=layer.mlp.act_fn,
    )


def check_structure(layer: nn.Module, layer_index: int) -> None:
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
