"""A lean forward pass over the tensors of one HF decoder layer.

The supported families (Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma 2, Gemma 3, GLM-4,
and the mixture-of-experts Qwen2-MoE, Qwen3-MoE, GLM-4.5 and Mixtral; Phi-3 is packaged as
Llama, mesh/package/fused.py) share one layer shape: RMSNorm, attention with rotary
embeddings (optional q/k/v biases, optional per-head q/k RMSNorm), RMSNorm, gated
MLP or routed experts of gated MLPs (mesh/runtime/moe.py). Gemma's variations are
options of that shape: norms that scale by ``1 + weight`` in float32 (the weight is
loaded as ``1 + weight``, see ``rms_norm``), a norm after attention and after the MLP
as well as before them (Gemma 2 and 3, GLM-4), attention scores capped by ``tanh``
(Gemma 2), rotary angles of their own for sliding-window layers (Gemma 3), and
rotary embeddings on the first part of each head only (GLM: the angles are that
part's width; its interleaved pairs are turned into halves when the weights load,
mesh/runtime/skeleton.py). ``DecoderBlock`` holds
one layer's weights (dense or quantised) and runs the same arithmetic in the same
order as transformers does, without the module call machinery, writing keys and
values into the session's preallocated cache. The HF layer module is built on the
meta device only to check its structure and read its shape; a layer with any other
structure is refused at load time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mesh.errors import UnsupportedArchitecture
from mesh.runtime import invariant, native_attention, native_norm
from mesh.runtime.linear import Linear, packed, unpacked
from mesh.runtime.moe import SparseExperts, is_sparse, structure_problems
from mesh.runtime.sessions import SessionCache

_LAYER_PARTS = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
# Gemma 2 and 3: a norm of the attention's and of the MLP's output before each
# residual add (``post_attention_layernorm`` is then the attention's, not the MLP's input).
_SANDWICH_PARTS = {"pre_feedforward_layernorm", "post_feedforward_layernorm"}
# GLM-4's names for the norms of the attention's and the MLP's outputs
# (``post_attention_layernorm`` keeps Llama's meaning there).
_GLM4_PARTS = {"post_self_attn_layernorm", "post_mlp_layernorm"}
# RMSNorms that scale by ``1 + weight``, computed in float32 (Gemma's).
OFFSET_NORMS = frozenset({"GemmaRMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm"})
_ATTENTION_PARTS = {"q_proj", "k_proj", "v_proj", "o_proj"}
_QK_NORMS = {"q_norm", "k_norm"}
_MLP_PARTS = {"gate_proj", "up_proj", "down_proj", "act_fn"}
# GLM's MLP: gate and up in one projection (gate rows first).
_FUSED_MLP_PARTS = {"gate_up_proj", "down_proj", "activation_fn"}


def rms_norm(
    hidden: torch.Tensor, weight: torch.Tensor, eps: float, native: bool = False
) -> torch.Tensor:
    """HF's RMSNorm: statistics in float32, scale applied in the input dtype. With
    ``native`` (row-invariant stages) on the stage's kernel where it can run.

    A float32 ``weight`` over other activations is Gemma's norm (its ``1 + weight``
    held in float32, ``OFFSET_NORMS``): the scale is applied in float32 and the
    result rounded once, as Gemma does. Over float32 activations both are one
    product."""
    if native and native_norm.usable(hidden, weight):
        return native_norm.rms_norm(hidden, weight, eps)
    normed = F.rms_norm(hidden.to(torch.float32), hidden.shape[-1:], eps=eps)
    if weight.dtype == torch.float32 and hidden.dtype != torch.float32:
        return (weight * normed).to(hidden.dtype)
    return weight * normed.to(hidden.dtype)


def cap_logits(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Gemma 2's final cap on logits, ``cap * tanh(logits / cap)`` (None: unchanged)."""
    if cap is None:
        return logits
    return torch.tanh(logits / cap) * cap


def rotate_into(
    out: torch.Tensor, states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> None:
    """Write ``states`` ``[..., head_dim]`` rotated by ``cos`` and the sign-folded
    ``sin`` (mesh/runtime/rotary.py) into ``out``, which may be ``states`` itself."""
    shape = states.shape
    swapped = states.unflatten(-1, (2, shape[-1] // 2)).flip(-2).reshape(shape)
    torch.mul(states, cos, out=out)
    out.addcmul_(swapped, sin)


def attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    groups: int,
    softcap: float | None = None,
) -> torch.Tensor:
    """SDPA dispatched the way transformers' sdpa integration does on this input.

    ``query`` is ``[T, heads, D]``; ``keys``/``values`` ``[1, kv_heads, L, D]``;
    ``mask`` is None (a fresh causal prefill, or one query seeing every key) or a
    boolean ``[1, 1, T, L]``. Returns ``[T, heads * D]``. With ``softcap`` (Gemma 2)
    the scores are capped first, which SDPA cannot do: ``capped_attention``.
    """
    count, heads, dim = query.shape
    if softcap is not None:
        return capped_attention(query, keys, values, mask, scaling, groups, softcap)
    if count == 1:
        # One query per head: the heads sharing a key/value head become that head's
        # query rows, so SDPA runs without repeating keys (several times faster than
        # enable_gqa in bfloat16 on CPU).
        packed = query.reshape(1, heads // groups, groups, dim)
        output = F.scaled_dot_product_attention(packed, keys, values, attn_mask=mask, scale=scaling)
        return output.reshape(1, heads * dim)
    query = query.transpose(0, 1).unsqueeze(0)
    if mask is None:
        output = F.scaled_dot_product_attention(
            query, keys, values, scale=scaling, is_causal=True, enable_gqa=groups > 1
        )
    else:
        if groups > 1:
            _, kv_heads, length, dim = keys.shape
            shape = (1, kv_heads, groups, length, dim)
            keys = keys[:, :, None].expand(shape).reshape(1, heads, length, dim)
            values = values[:, :, None].expand(shape).reshape(1, heads, length, dim)
        output = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scaling)
    return output[0].transpose(0, 1).reshape(count, heads * dim)


def capped_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    groups: int,
    softcap: float,
) -> torch.Tensor:
    """``attention`` with Gemma 2's score cap, in transformers' eager order: scores
    scaled, ``softcap * tanh(scores / softcap)``, masked, softmax in float32 (back to
    the input dtype), times the values. Same arguments and result as ``attention``."""
    count, heads, dim = query.shape
    length = keys.shape[2]
    kv_heads = heads // groups
    # [kv_heads, groups * T, D]: the query heads sharing a key/value head as its rows.
    grouped = query.view(count, kv_heads, groups, dim).permute(1, 2, 0, 3)
    scores = torch.matmul(grouped.reshape(kv_heads, groups * count, dim), keys[0].transpose(1, 2))
    scores = scores.view(kv_heads, groups, count, length) * scaling
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None and count > 1:
        # A fresh causal prefill (keys are the frame's own).
        mask = torch.ones(count, length, dtype=torch.bool, device=query.device).tril(length - count)
    if mask is not None:
        scores = scores.masked_fill(~mask.view(1, 1, count, length), float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(probs.view(kv_heads, groups * count, length), values[0])
    return out.view(kv_heads, groups, count, dim).permute(2, 0, 1, 3).reshape(count, heads * dim)


def attention_masks(
    pos_start: int, count: int, window: int | None, device: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Boolean masks (True = attend) ``[1, 1, T, pos_start + T]`` for full and
    sliding-window layers; None where SDPA's own causal handling is exact (a single
    query attends to every key; a fresh prefill is plain causal)."""
    end = pos_start + count
    needs_window = window is not None and end > window
    if (count == 1 or pos_start == 0) and not needs_window:
        return None, None
    queries = torch.arange(pos_start, end, device=device).unsqueeze(1)
    keys = torch.arange(end, device=device).unsqueeze(0)
    causal = keys <= queries
    full = None if count == 1 or pos_start == 0 else causal.view(1, 1, count, end)
    if not needs_window:
        return full, full
    sliding = (causal & (keys > queries - window)).view(1, 1, count, end)
    return full, sliding


class DecoderBlock:
    """One decoder layer's weights and its forward over a session cache.

    q/k/v run as one fused linear and gate/up as another (see ``fuse``); every
    linear is dense or quantised (mesh/runtime/linear.py). Queries and keys are
    normed (Qwen3, Gemma 3) and rotated together, as one ``[T, heads + kv_heads, D]``
    tensor. A sparse layer has ``experts`` instead of ``gate_up`` and ``down``.
    ``attn_out_norm`` and ``mlp_out_norm`` (Gemma 2 and 3) norm each output before
    its residual add.
    """

    __slots__ = (
        "layer_index",
        "sliding",
        "head_dim",
        "heads",
        "groups",
        "scaling",
        "norm_eps",
        "input_norm",
        "post_norm",
        "attn_out_norm",
        "mlp_out_norm",
        "softcap",
        "rope_index",
        "qk_norm",
        "qk_width",
        "q_width",
        "qkv",
        "o",
        "gate_up",
        "down",
        "experts",
        "act",
        "row_invariant",
    )

    def __init__(
        self,
        shape: BlockShape,
        layer_index: int,
        sliding: bool,
        norms: dict[str, torch.Tensor],
        qkv: Linear,
        o: Linear,
        gate_up: Linear | None,
        down: Linear | None,
        row_invariant: bool = False,
        experts: SparseExperts | None = None,
        rope_index: int | None = None,
    ) -> None:
        self.layer_index = layer_index
        self.sliding = sliding
        self.head_dim = shape.head_dim
        self.heads = shape.heads
        self.groups = shape.heads // shape.kv_heads
        self.scaling = shape.scaling
        self.norm_eps = shape.norm_eps
        self.input_norm = norms["input_layernorm.weight"]
        self.post_norm = norms["post_attention_layernorm.weight"]
        self.attn_out_norm: torch.Tensor | None = None
        self.mlp_out_norm: torch.Tensor | None = None
        if "pre_feedforward_layernorm.weight" in norms:
            # Gemma 2 and 3: "post attention" normalises the attention's output; the
            # MLP's input has a norm of its own, and its output one more.
            self.attn_out_norm = self.post_norm
            self.post_norm = norms["pre_feedforward_layernorm.weight"]
            self.mlp_out_norm = norms["post_feedforward_layernorm.weight"]
        elif "post_self_attn_layernorm.weight" in norms:
            self.attn_out_norm = norms["post_self_attn_layernorm.weight"]
            self.mlp_out_norm = norms["post_mlp_layernorm.weight"]
        # Gemma 2's cap on attention scores.
        self.softcap = shape.softcap
        # Which of the stage's rotary tables this layer rotates with (Gemma 3's
        # sliding-window layers have their own); None where the model has one.
        self.rope_index = rope_index
        self.qk_norm = None
        q_norm = norms.get("self_attn.q_norm.weight")
        k_norm = norms.get("self_attn.k_norm.weight")
        if q_norm is not None and k_norm is not None:
            # One weight row per query and key head, so both norms run as one.
            rows = (q_norm.expand(shape.heads, -1), k_norm.expand(shape.kv_heads, -1))
            self.qk_norm = torch.cat(rows)
        self.qk_width = (shape.heads + shape.kv_heads) * shape.head_dim
        self.q_width = shape.heads * shape.head_dim
        self.qkv = qkv
        self.o = o
        self.gate_up = gate_up
        self.down = down
        self.experts = experts
        self.act: Callable[[torch.Tensor], torch.Tensor] = shape.act
        # Attention as one entry per query row (mesh/runtime/invariant.py).
        self.row_invariant = row_invariant

    def linears(self) -> list[Linear]:
        if self.experts is not None:
            return [self.qkv, self.o, *self.experts.linears()]
        return [self.qkv, self.o, self.gate_up, self.down]  # type: ignore[list-item]

    def unpack(self) -> None:
        """Plain weights instead of oneDNN-packed ones (the compiler cannot lower those)."""
        self.qkv, self.o = unpacked(self.qkv), unpacked(self.o)
        if self.experts is not None:
            self.experts.unpack()
            return
        self.gate_up, self.down = unpacked(self.gate_up), unpacked(self.down)  # type: ignore[arg-type]

    def pack(self) -> None:
        """Back to oneDNN-packed weights where the device has oneDNN (``unpack`` undone)."""
        self.qkv, self.o = packed(self.qkv), packed(self.o)
        if self.experts is not None:
            self.experts.pack()
            return
        self.gate_up, self.down = packed(self.gate_up), packed(self.down)  # type: ignore[arg-type]

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: SessionCache,
        mask: torch.Tensor | None,
        step: Callable[..., torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``hidden`` ``[T, hidden]``; ``cos``/``sin`` ``[T, 1, D]`` from
        ``RotaryAngles``. ``step`` replaces ``run_block`` (with a compiled version of it)."""
        kv = cache.layer(self.layer_index)
        return (step or run_block)(self, hidden, cos, sin, kv, cache.write_at, mask)


def run_block(
    block: DecoderBlock,
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv: torch.Tensor,
    at: int | torch.Tensor,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """One layer over a frame of ``T`` tokens (``hidden`` ``[T, hidden]``) at positions
    ``at ..`` (an int, or a one-element tensor for a single token): writes the frame's
    keys and values into the layer's cache ``kv`` ``[2, 1, kv_heads, C, D]`` and
    attends over positions ``0 .. at + T``. A plain function of its arguments, so one
    compiled version serves every layer."""
    count = hidden.shape[0]
    qkv, query_key = project(block, hidden, cos, sin)
    new_kv = qkv[:, block.q_width :].view(count, 2, 1, -1, block.head_dim).permute(1, 2, 3, 0, 4)
    if isinstance(at, int):
        kv.narrow(3, at, count).copy_(new_kv)
        held = kv.narrow(3, 0, at + count)
    else:
        # A position held in a tensor (mesh/runtime/graphs.py): attend over the whole
        # buffer, under the caller's mask.
        kv.index_copy_(3, at, new_kv)
        held = kv
    attended = attention(
        query_key[:, : block.heads],
        held[0],
        held[1],
        mask,
        block.scaling,
        block.groups,
        block.softcap,
    )
    return finish(block, hidden, attended)


@dataclass(frozen=True)
class SegmentRows:
    """One session's rows in a batched frame: ``count`` rows from ``row`` at positions
    ``at ..``, attending over its own cache with its own masks (full, sliding; SDPA)
    or, under row-invariant arithmetic, over its positions with the model's sliding
    ``window`` on sliding layers (mesh/runtime/invariant.py)."""

    cache: SessionCache
    row: int
    at: int
    count: int
    masks: tuple[torch.Tensor | None, torch.Tensor | None]
    window: int | None = None


def run_block_segments(
    block: DecoderBlock,
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    segments: list[SegmentRows],
) -> torch.Tensor:
    """One layer over the rows of several sessions at once: every linear sees all
    rows; each session's keys and values go to its own cache, and its queries attend
    to its own positions only. ``cos``/``sin`` hold one row per token."""
    qkv, query_key = project(block, hidden, cos, sin)
    return finish(block, hidden, attend_segments(block, qkv, query_key, segments))


def attend_segments(
    block: DecoderBlock, qkv: torch.Tensor, query_key: torch.Tensor, segments: list[SegmentRows]
) -> torch.Tensor:
    """Attention of a frame's rows (``project``'s output): each segment's keys and
    values written into its session's cache, its queries attending to its own
    positions. Returns ``[rows, heads * D]``."""
    dim = block.head_dim
    fixed_order = block.row_invariant
    if fixed_order and block.softcap is None and native_attention.usable(qkv, dim, block.groups):
        attended_rows = native_attention.attend(
            qkv, segments, block.layer_index, block.heads, block.heads // block.groups,
            dim, block.scaling, block.sliding,
        )  # fmt: skip
        if attended_rows is not None:
            return attended_rows
    attended = []
    for part in segments:
        rows = slice(part.row, part.row + part.count)
        kv = part.cache.layer(block.layer_index)
        new_kv = qkv[rows, block.q_width :].view(part.count, 2, 1, -1, dim).permute(1, 2, 3, 0, 4)
        kv.narrow(3, part.at, part.count).copy_(new_kv)
        query = query_key[rows, : block.heads]
        if fixed_order:
            window = part.window if block.sliding else None
            attended.append(
                invariant.attention(
                    query,
                    kv[0, 0],
                    kv[1, 0],
                    part.at,
                    block.scaling,
                    block.groups,
                    window,
                    block.softcap,
                )
            )
            continue
        held = kv.narrow(3, 0, part.at + part.count)
        mask = part.masks[1] if block.sliding else part.masks[0]
        attended.append(
            attention(query, held[0], held[1], mask, block.scaling, block.groups, block.softcap)
        )
    return attended[0] if len(attended) == 1 else torch.cat(attended)


def project(
    block: DecoderBlock, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Norm, the fused q/k/v linear, and rotary (plus Qwen3's q/k norms) on queries
    and keys in place. Returns the q/k/v rows and the rotated ``[T, heads +
    kv_heads, D]`` query/key view of them. Where the model rotates its layers by
    several tables (``rope_index``), ``cos``/``sin`` hold them all, ``[tables, T, 1,
    D]``."""
    if block.rope_index is not None:
        cos, sin = cos[block.rope_index], sin[block.rope_index]
    states = rms_norm(hidden, block.input_norm, block.norm_eps, block.row_invariant)
    # [T, (heads + 2 * kv_heads) * D]: queries, keys, values; rotated in place.
    qkv = block.qkv(states)
    query_key = qkv[:, : block.qk_width].unflatten(-1, (-1, block.head_dim))
    normed = query_key
    if block.qk_norm is not None:
        normed = rms_norm(query_key, block.qk_norm, block.norm_eps)
    part = cos.shape[-1]
    if part == block.head_dim:
        rotate_into(query_key, normed, cos, sin)
        return qkv, query_key
    # Rotary on each head's first ``part`` dimensions only (GLM); the rest as it is.
    if normed is not query_key:
        query_key[..., part:] = normed[..., part:]
    rotate_into(query_key[..., :part], normed[..., :part], cos, sin)
    return qkv, query_key


def finish(block: DecoderBlock, hidden: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
    """Output projection, residual, and the gated MLP (or routed experts) with its
    residual; Gemma 2 and 3 norm each output before its residual add."""
    native = block.row_invariant
    out = block.o(attended)
    if block.attn_out_norm is not None:
        out = rms_norm(out, block.attn_out_norm, block.norm_eps, native)
    hidden = hidden + out
    states = rms_norm(hidden, block.post_norm, block.norm_eps, native)
    if block.experts is not None:
        return hidden + block.experts(states)
    gate, up = block.gate_up(states).chunk(2, dim=-1)  # type: ignore[misc]
    out = block.down(block.act(gate) * up)  # type: ignore[misc]
    if block.mlp_out_norm is not None:
        out = rms_norm(out, block.mlp_out_norm, block.norm_eps, native)
    return hidden + out


@dataclass(frozen=True)
class BlockShape:
    """What a decoder layer's arithmetic needs from the model config."""

    heads: int
    kv_heads: int
    head_dim: int
    scaling: float
    norm_eps: float
    act: Callable[[torch.Tensor], torch.Tensor]
    # Gemma 2's cap on attention scores (None: no cap).
    softcap: float | None = None


def norm_eps(norm: nn.Module) -> float:
    """An HF RMSNorm's epsilon (``variance_epsilon``; Gemma's norms call it ``eps``)."""
    eps = getattr(norm, "variance_epsilon", None)
    return float(norm.eps if eps is None else eps)


def block_shape(layer: nn.Module) -> BlockShape:
    """Read the shape of a (meta-device) HF decoder layer, after checking its structure."""
    attn = layer.self_attn
    head_dim = int(attn.head_dim)
    heads = int(attn.q_proj.out_features) // head_dim
    kv_heads = int(attn.k_proj.out_features) // head_dim
    softcap = getattr(attn, "attn_logit_softcapping", None)
    norms = [layer.self_attn.q_norm] if hasattr(attn, "q_norm") else []
    norms += [getattr(layer, name) for name in sorted(_SANDWICH_PARTS) if hasattr(layer, name)]
    eps = norm_eps(layer.input_layernorm)
    for norm in [layer.post_attention_layernorm, *norms]:
        if norm_eps(norm) != eps:
            raise UnsupportedArchitecture(
                "decoder layers whose norms use different epsilons are not supported"
            )
    return BlockShape(
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        scaling=float(attn.scaling),
        norm_eps=eps,
        act=layer.mlp.experts.act_fn if is_sparse(layer) else _mlp_act(layer.mlp),
        softcap=None if softcap is None else float(softcap),
    )


def _mlp_act(mlp: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """A dense MLP's activation (``act_fn``; GLM's ``activation_fn``)."""
    act = getattr(mlp, "act_fn", None)
    return mlp.activation_fn if act is None else act


def check_structure(layer: nn.Module, layer_index: int) -> None:
    """Refuse a layer whose parts differ from the shape ``DecoderBlock`` computes."""
    problems: list[str] = []
    parts = {name for name, _ in layer.named_children()}
    if parts not in (_LAYER_PARTS, _LAYER_PARTS | _SANDWICH_PARTS, _LAYER_PARTS | _GLM4_PARTS):
        problems.append(f"layer parts {sorted(parts)}")
    else:
        attn_parts = {name for name, _ in layer.self_attn.named_children()}
        if attn_parts not in (_ATTENTION_PARTS, _ATTENTION_PARTS | _QK_NORMS):
            problems.append(f"attention parts {sorted(attn_parts)}")
        mlp_parts = {name for name, _ in layer.mlp.named_children()}
        if is_sparse(layer):
            problems += structure_problems(layer)
        elif mlp_parts - {"act_fn"} != _MLP_PARTS - {"act_fn"} and mlp_parts != _FUSED_MLP_PARTS:
            problems.append(f"MLP parts {sorted(mlp_parts)}")
        norms = [getattr(layer, name) for name in sorted(parts) if name.endswith("layernorm")]
        norms += [getattr(layer.self_attn, name) for name in _QK_NORMS & attn_parts]
        offset = type(layer.input_layernorm).__name__ in OFFSET_NORMS
        for norm in norms:
            name = type(norm).__name__
            if not name.endswith("RMSNorm") or not (
                hasattr(norm, "variance_epsilon") or hasattr(norm, "eps")
            ):
                problems.append(f"norm {name}")
            elif (name in OFFSET_NORMS) != offset:
                problems.append(f"norms of two kinds ({name})")
        act = getattr(layer.mlp, "act_fn", None) or getattr(layer.mlp, "activation_fn", None)
        if not is_sparse(layer) and not callable(act):
            problems.append("MLP without act_fn")
    if problems:
        raise UnsupportedArchitecture(
            f"decoder layer {layer_index} ({type(layer).__name__}) has an unexpected structure "
            f"({'; '.join(problems)}); the runtime runs Llama, Mistral, Qwen2, Qwen3, "
            "Gemma, Gemma 2, Gemma 3, GLM-4, Qwen2-MoE, Qwen3-MoE, GLM-4.5 and Mixtral layers"
        )
