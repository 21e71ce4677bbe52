"""Routed experts: the sparse feed-forward of Qwen2-MoE, Qwen3-MoE, GLM-4.5 and Mixtral
decoder layers.

A router (a ``[experts, hidden]`` linear) scores every row; each row goes to its
``top_k`` experts, each a gated MLP like a dense layer's, and their outputs are
summed with the routing weights. The routing rule is the model's own, as
transformers computes it (``Qwen3MoeTopKRouter``, ``MixtralTopKRouter``): softmax
over every expert in float32, the ``top_k`` largest, then

- Qwen3-MoE: renormalised to sum to one when ``norm_topk_prob``, and cast to the
  activations' dtype before they scale the expert outputs;
- Mixtral: always renormalised (the same as a softmax over the chosen logits), and
  kept in float32 while they scale the outputs;
- Qwen2-MoE: Qwen3-MoE's rule, plus a *shared expert*: a gated MLP every row goes
  through, scaled by the sigmoid of its own gate (a ``[1, hidden]`` linear) and added
  to the routed experts' sum (``Qwen2MoeSparseMoeBlock``).

GLM-4.5 (``Glm4MoeTopkRouter``, DeepSeek-V3's rule) routes otherwise: the router
runs in float32, each expert's score is the sigmoid of its logit; the choice adds a
learned bias per expert (``e_score_correction_bias``) and is limited to the
``topk_group`` groups of experts whose two best biased scores sum highest; the
chosen experts weigh in by their unbiased scores, renormalised when
``norm_topk_prob``, times ``routed_scaling_factor``, in float32. Its shared experts
(``mlp.shared_experts``) are an ungated MLP added to every row.

A frame's rows are routed together: the rows sent to one expert are gathered, run
through that expert once, scaled, and added back to their rows (experts in
ascending order, as transformers adds them). That reads the routing on the host
once per layer, so a CUDA graph cannot capture a sparse layer: ``--cuda-graphs``
then logs why and runs decode steps eagerly. Each expert's linears are dense or
quantised like any other (mesh/runtime/linear.py), so a row's result depends only
on the row where those linears are row-invariant.

Packages store each expert as its own linears, under the names HF checkpoints use
(``mlp.experts.3.gate_proj.weight``) next to the router's ``mlp.gate.weight``;
``per_expert`` splits transformers' stacked in-memory form into them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from mesh.runtime.linear import Linear, packed, unpacked

# The router classes whose rule ``SparseExperts`` computes, and that rule.
_ROUTERS = {
    "Qwen2MoeTopKRouter": "qwen_moe",
    "Qwen3MoeTopKRouter": "qwen_moe",
    "MixtralTopKRouter": "mixtral",
    "Glm4MoeTopkRouter": "grouped_sigmoid",
}
_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
ROUTER_WEIGHT = "mlp.gate.weight"
# GLM-4.5's per-expert bias on the scores that choose (not on the weights).
ROUTER_BIAS = "mlp.gate.e_score_correction_bias"
SHARED_PREFIX = "mlp.shared_expert."
SHARED_GATE_WEIGHT = "mlp.shared_expert_gate.weight"
# GLM-4.5's shared experts: one ungated MLP.
UNGATED_SHARED_PREFIX = "mlp.shared_experts."
_SPARSE_PARTS = {"gate", "experts"}
_SHARED_PARTS = {"shared_expert", "shared_expert_gate"}
_UNGATED_SHARED_PARTS = {"shared_experts"}


@dataclass(frozen=True)
class Routing:
    """How a layer picks and weighs its experts."""

    experts: int
    top_k: int
    renormalise: bool
    # Routing weights scale expert outputs in float32 (Mixtral) or in the
    # activations' dtype (Qwen3-MoE).
    float_weights: bool
    # "softmax" (Qwen, Mixtral) or "grouped_sigmoid" (GLM-4.5, module doc), with its
    # groups of experts, how many of them may be chosen from, and the weights' scale.
    rule: str = "softmax"
    groups: int = 1
    top_groups: int = 1
    scale: float = 1.0


def is_sparse(layer: nn.Module) -> bool:
    """Whether a (meta-device) HF decoder layer's feed-forward is routed experts."""
    return hasattr(layer.mlp, "experts")


def routing_of(layer: nn.Module) -> Routing | None:
    """The routing of a sparse layer, or None if its router is not one computed here."""
    router = getattr(layer.mlp, "gate", None)
    family = _ROUTERS.get(type(router).__name__)
    if family is None:
        return None
    if family == "grouped_sigmoid":
        return Routing(
            experts=int(router.num_experts),
            top_k=int(router.top_k),
            renormalise=bool(router.norm_topk_prob),
            float_weights=True,
            rule=family,
            groups=int(router.num_group),
            top_groups=int(router.topk_group),
            scale=float(router.routed_scaling_factor),
        )
    return Routing(
        experts=int(router.num_experts),
        top_k=int(router.top_k),
        renormalise=family == "mixtral" or bool(router.norm_topk_prob),
        float_weights=family == "mixtral",
    )


def structure_problems(layer: nn.Module) -> list[str]:
    """What keeps ``SparseExperts`` from computing this layer's feed-forward."""
    mlp = layer.mlp
    problems = []
    parts = {name for name, _ in mlp.named_children()}
    if parts not in (
        _SPARSE_PARTS,
        _SPARSE_PARTS | _SHARED_PARTS,
        _SPARSE_PARTS | _UNGATED_SHARED_PARTS,
    ):
        problems.append(f"sparse MLP parts {sorted(parts)}")
        return problems
    if has_ungated_shared_experts(layer):
        shared = {name for name, _ in mlp.shared_experts.named_children()}
        if shared - {"act_fn"} != set(_PROJECTIONS):
            problems.append(f"shared experts parts {sorted(shared)}")
    routing = routing_of(layer)
    if routing is not None and routing.rule == "grouped_sigmoid":
        if routing.experts % routing.groups or not 0 < routing.top_groups <= routing.groups:
            problems.append(f"{routing.experts} experts in {routing.groups} groups")
    if has_shared_expert(layer):
        shared = {name for name, _ in mlp.shared_expert.named_children()}
        if shared - {"act_fn"} != set(_PROJECTIONS) or not callable(
            getattr(mlp.shared_expert, "act_fn", None)
        ):
            problems.append(f"shared expert parts {sorted(shared)}")
        if tuple(mlp.shared_expert_gate.weight.shape)[0] != 1:
            problems.append("a shared expert gate of more than one output")
    if routing_of(layer) is None:
        problems.append(f"router {type(mlp.gate).__name__}")
    experts = mlp.experts
    params = {name for name, _ in experts.named_parameters()}
    if params != {"gate_up_proj", "down_proj"}:
        problems.append(f"expert parameters {sorted(params)}")
    elif experts.gate_up_proj.dim() != 3 or experts.down_proj.dim() != 3:
        problems.append("expert weights that are not stacked [experts, out, in]")
    if not callable(getattr(experts, "act_fn", None)):
        problems.append("experts without act_fn")
    return problems


def has_shared_expert(layer: nn.Module) -> bool:
    """Whether a sparse layer also has a gated shared expert (Qwen2-MoE)."""
    return hasattr(layer.mlp, "shared_expert")


def has_ungated_shared_experts(layer: nn.Module) -> bool:
    """Whether a sparse layer also has ungated shared experts (GLM-4.5)."""
    return hasattr(layer.mlp, "shared_experts")


def expert_shapes(layer: nn.Module) -> dict[str, tuple[int, ...]]:
    """Package tensor names and shapes of a sparse layer's router and experts (and
    shared expert)."""
    experts = layer.mlp.experts
    count, double_inner, hidden = experts.gate_up_proj.shape
    inner = double_inner // 2
    shapes: dict[str, tuple[int, ...]] = {ROUTER_WEIGHT: tuple(layer.mlp.gate.weight.shape)}
    for expert in range(count):
        prefix = f"mlp.experts.{expert}."
        shapes[prefix + "gate_proj.weight"] = (inner, hidden)
        shapes[prefix + "up_proj.weight"] = (inner, hidden)
        shapes[prefix + "down_proj.weight"] = (hidden, inner)
    if has_shared_expert(layer):
        for name, tensor in layer.mlp.shared_expert.state_dict().items():
            shapes[SHARED_PREFIX + name] = tuple(tensor.shape)
        shapes[SHARED_GATE_WEIGHT] = tuple(layer.mlp.shared_expert_gate.weight.shape)
    if has_ungated_shared_experts(layer):
        for name, tensor in layer.mlp.shared_experts.state_dict().items():
            shapes[UNGATED_SHARED_PREFIX + name] = tuple(tensor.shape)
    if hasattr(layer.mlp.gate, "e_score_correction_bias"):
        shapes[ROUTER_BIAS] = (count,)
    return shapes


def per_expert(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A layer's tensors with transformers' stacked experts (``mlp.experts.gate_up_proj``
    ``[E, 2I, H]``, gate rows first, and ``mlp.experts.down_proj`` ``[E, H, I]``)
    split into one ``gate_proj``/``up_proj``/``down_proj`` weight per expert."""
    out = dict(tensors)
    gate_up = out.pop("mlp.experts.gate_up_proj", None)
    down = out.pop("mlp.experts.down_proj", None)
    if gate_up is None or down is None:
        return dict(tensors)
    for expert in range(gate_up.shape[0]):
        gate, up = gate_up[expert].chunk(2, dim=0)
        prefix = f"mlp.experts.{expert}."
        out[prefix + "gate_proj.weight"] = gate
        out[prefix + "up_proj.weight"] = up
        out[prefix + "down_proj.weight"] = down[expert]
    return out


@dataclass
class SharedExpert:
    """A shared expert: a gated MLP (fused gate/up, down) every row goes through,
    scaled by the sigmoid of its ``gate`` (Qwen2-MoE) or not (``gate`` None: GLM-4.5's)."""

    gate_up: Linear
    down: Linear
    gate: Linear | None = None

    def linears(self) -> list[Linear]:
        return [self.gate_up, self.down] + ([] if self.gate is None else [self.gate])

    def map(self, change: Callable[[Linear], Linear]) -> None:
        self.gate_up, self.down = change(self.gate_up), change(self.down)
        if self.gate is not None:
            self.gate = change(self.gate)


class SparseExperts:
    """A router and its experts (a fused gate/up linear and a down linear each), and
    the shared expert where the layer has one."""

    __slots__ = ("routing", "router", "gate_up", "down", "act", "shared", "bias")

    def __init__(
        self,
        routing: Routing,
        router: Linear,
        gate_up: list[Linear],
        down: list[Linear],
        act: Callable[[torch.Tensor], torch.Tensor],
        shared: SharedExpert | None = None,
        bias: torch.Tensor | None = None,
    ) -> None:
        self.routing = routing
        self.router = router
        self.gate_up = gate_up
        self.down = down
        self.act = act
        self.shared = shared
        # grouped_sigmoid: the float32 bias on the scores that choose.
        self.bias = bias

    def linears(self) -> list[Linear]:
        shared = [] if self.shared is None else self.shared.linears()
        return [self.router, *self.gate_up, *self.down, *shared]

    def unpack(self) -> None:
        self.router = unpacked(self.router)
        self.gate_up = [unpacked(linear) for linear in self.gate_up]
        self.down = [unpacked(linear) for linear in self.down]
        if self.shared is not None:
            self.shared.map(unpacked)

    def pack(self) -> None:
        self.router = packed(self.router)
        self.gate_up = [packed(linear) for linear in self.gate_up]
        self.down = [packed(linear) for linear in self.down]
        if self.shared is not None:
            self.shared.map(packed)

    def route(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Routing weights and chosen experts, both ``[T, top_k]``."""
        if self.routing.rule == "grouped_sigmoid":
            return self._route_groups(states)
        logits = self.router(states)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.routing.top_k, dim=-1)
        if self.routing.renormalise:
            weights /= weights.sum(dim=-1, keepdim=True)
        if not self.routing.float_weights:
            weights = weights.to(logits.dtype)
        return weights, chosen

    def _route_groups(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """GLM-4.5's rule (module doc): float32 throughout."""
        routing = self.routing
        scores = sigmoid(self.router(states.float()))
        choice = scores if self.bias is None else scores + self.bias
        rows = choice.shape[0]
        grouped = choice.view(rows, routing.groups, -1)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
        kept = torch.topk(group_scores, routing.top_groups, dim=-1, sorted=False).indices
        allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        choice = choice.masked_fill(
            ~allowed.repeat_interleave(grouped.shape[-1], dim=1), -torch.inf
        )
        chosen = torch.topk(choice, routing.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, chosen)
        if routing.renormalise:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * routing.scale, chosen

    def __call__(self, states: torch.Tensor) -> torch.Tensor:
        """``states`` ``[T, hidden]`` (normed) -> the experts' weighted sum ``[T, hidden]``."""
        if states.is_cuda and torch.cuda.is_current_stream_capturing():
            # Refused before the host reads the routing, which a capture cannot survive.
            raise RuntimeError(
                "routed experts pick their rows from the data; a CUDA graph cannot capture them"
            )
        weights, chosen = self.route(states)
        top_k = self.routing.top_k
        slots = chosen.reshape(-1)  # row-major: row r's choices at r * top_k ..
        # Slots grouped by expert, each group in row order.
        order = torch.argsort(slots, stable=True)
        counts = torch.bincount(slots, minlength=self.routing.experts).tolist()
        rows_of = order // top_k
        slot_weights = weights.reshape(-1)[order].unsqueeze(-1)
        out = torch.zeros_like(states)
        start = 0
        for expert, count in enumerate(counts):
            if not count:
                continue
            rows = rows_of[start : start + count]
            gate, up = self.gate_up[expert](states[rows]).chunk(2, dim=-1)
            result = self.down[expert](self.act(gate) * up)
            result = result * slot_weights[start : start + count]
            out.index_add_(0, rows, result.to(out.dtype))
            start += count
        shared = self.shared
        if shared is not None:
            gate, up = shared.gate_up(states).chunk(2, dim=-1)
            common = shared.down(self.act(gate) * up)
            if shared.gate is None:
                out = out + common
            else:
                out = out + sigmoid(shared.gate(states)) * common
        return out


def sigmoid(values: torch.Tensor) -> torch.Tensor:
    """``1 / (1 + exp(-x))`` in float32, in ``values``' dtype. torch's own sigmoid
    rounds a value differently with the size of the tensor around it (measured: 6e-8
    between a row alone and among 17 rows, float32, CPU), which row invariance cannot
    have; exp does not."""
    wide = values.float()
    return torch.reciprocal(torch.exp(-wide).add_(1.0)).to(values.dtype)


def expert_names(expert: int) -> tuple[str, str, str]:
    """The package names of one expert's gate, up and down projections (no ``.weight``)."""
    return tuple(f"mlp.experts.{expert}.{name}" for name in _PROJECTIONS)  # type: ignore[return-value]
