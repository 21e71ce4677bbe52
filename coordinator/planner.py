"""The layer planner: split a model's decoder layers across stage nodes.

A pure function of the joined nodes and the model's memory footprint. Each stage
gets one contiguous half-open range ``[start, end)``; together the ranges cover
``[0, layer_count)`` exactly. Stage 0 is the frontend node (or the first node) and
carries the embeddings and stage-0 extras (the draft model); the last stage carries
the final norm and LM head.

How layers are shared out:

- A node's *capacity* is the memory it offers minus the fixed extras of its
  position, divided by the cost of one layer (weights plus its KV budget).
  ``memory_bytes == 0`` means the node did not say: it is treated as unlimited.
  Stage 0's extras are the embeddings and ``stage0_extra_bytes``: the draft model's
  weights and its KV budget when speculation drafts with one.
- Memory is *stated* (the operator's ``--memory``: a share as well as a limit) or
  *measured* (the node's free device memory or available RAM: a limit only).
- When the nodes' compute is measured (``layer_ms``: one decoder layer on the node's
  device, timed by the stage after it loads), layers go out so that the estimated
  step times balance: a stage's estimate is its layers times its ``layer_ms``, plus
  on the last stage the LM head (``head_ms``, scaled to the node's speed when another
  node measured it) and on stage 0 its frontend's overhead (``overhead_ms``, measured
  while serving). A node not measured yet counts as the mean of those that were.
- Before any measurement (the first plan), a prior decides: layers go out in
  proportion to each node's weight: its stated memory left after fixed extras,
  scaled by its speed hint relative to the other nodes that offer the same memory
  (so speed decides only between equal-memory nodes). A node whose memory is not
  stated weighs as much as the largest stated one; when no node states its memory,
  speed alone decides. Where the last node does not state its memory, its LM head
  counts as ``HEAD_LOAD_FACTOR * head_bytes / layer_bytes`` layers of load
  (SmolLM2: 4 layers in float32, 6.5 in the int4 package, whose head is int8), and
  the last stage gets that many fewer layers. The factor is a guess from one
  machine (stage 0 also runs the frontend, which the factor leaves room for); the
  measured figures replace it from the second plan on.
- Every stage gets at least one layer and never more than its capacity. Nodes that
  cannot hold a single layer are left out; when there are more nodes than layers
  (or than ``max_stages``), the smallest ones are left out.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

# ModelFootprint and footprint_from_manifest live in coordinator/footprint.py; the
# planner is where callers take them from.
from coordinator.footprint import ModelFootprint, footprint_from_manifest
from mesh.errors import InvalidRequest
from mesh.types import LayerRange

__all__ = [
    "HEAD_LOAD_FACTOR",
    "ModelFootprint",
    "NodeCapacity",
    "Plan",
    "StageAssignment",
    "footprint_from_manifest",
    "plan_layers",
    "step_estimates",
]

logger = logging.getLogger(__name__)

GIB = float(1 << 30)
# The share of the LM head's bytes that counts as compute load on the last stage
# before the nodes' compute is measured (see the module docstring).
HEAD_LOAD_FACTOR = 0.5


@dataclass(frozen=True)
class NodeCapacity:
    """What one joined node offers to the plan."""

    node_id: str
    address: str
    memory_bytes: int
    speed_hint: float = 1.0
    frontend: bool = False
    # memory_bytes was measured on the node (a limit, not a share; see above).
    memory_measured: bool = False
    # Measured compute in ms per decode step of a few rows (0: not measured): one
    # decoder layer, the LM head (when the node held it), and the frontend's
    # overhead (stage 0, from its serving step times).
    layer_ms: float = 0.0
    head_ms: float = 0.0
    overhead_ms: float = 0.0

    @property
    def memory_stated(self) -> bool:
        return self.memory_bytes > 0 and not self.memory_measured


@dataclass(frozen=True)
class StageAssignment:
    node_id: str
    address: str
    stage_index: int
    layer_range: LayerRange
    planned_bytes: int
    # The estimated step time (ms of the nodes' measured compute; 0 before any
    # measurement).
    planned_step_ms: float = 0.0


@dataclass(frozen=True)
class Plan:
    stages: tuple[StageAssignment, ...]

    @property
    def layer_count(self) -> int:
        return self.stages[-1].layer_range.end if self.stages else 0

    def node_ids(self) -> tuple[str, ...]:
        return tuple(stage.node_id for stage in self.stages)

    def stage_of(self, node_id: str) -> StageAssignment | None:
        for stage in self.stages:
            if stage.node_id == node_id:
                return stage
        return None

    def describe(self) -> str:
        """One line per stage, e.g. ``stage 0: a (10.0.0.1:7071) layers [0, 15) 1.20 GiB``
        (and ``, step 12.5 ms`` when the compute was measured)."""
        return "\n".join(
            f"stage {s.stage_index}: {s.node_id} ({s.address}) layers {s.layer_range} "
            f"{s.planned_bytes / GIB:.2f} GiB"
            + (f", step {s.planned_step_ms:.2f} ms" if s.planned_step_ms else "")
            for s in self.stages
        )


def plan_layers(
    nodes: Sequence[NodeCapacity],
    footprint: ModelFootprint,
    *,
    max_stages: int | None = None,
) -> Plan:
    """Assign contiguous layer ranges to nodes; raise InvalidRequest when it cannot fit."""
    _check_inputs(nodes, footprint, max_stages)
    order = _stage_order(nodes)
    limit = min(footprint.layer_count, max_stages if max_stages is not None else len(order))
    chosen = _choose_nodes(order, footprint, limit)
    capacities = _capacities(chosen, footprint)
    room = sum(min(c, footprint.layer_count) for c in capacities)
    if capacities[0] < 1 or room < footprint.layer_count:
        raise InvalidRequest(_cannot_fit_message(chosen, footprint, len(order)))
    compute = _measured_compute(chosen, footprint)
    if compute is not None:
        layer_ms, fixed_ms = compute
        weights = [1.0 / ms for ms in layer_ms]
        load = [f / ms for f, ms in zip(fixed_ms, layer_ms, strict=True)]
    else:
        weights = _weights(chosen, footprint)
        load = [0.0] * len(chosen)
        if footprint.layer_bytes > 0 and not chosen[-1].memory_stated:
            load[-1] = HEAD_LOAD_FACTOR * footprint.head_bytes / footprint.layer_bytes
    counts = _apportion(weights, capacities, footprint.layer_count, load)
    stages: list[StageAssignment] = []
    start = 0
    steps = step_estimates(chosen, counts, footprint)
    for index, (node, count, step_ms) in enumerate(zip(chosen, counts, steps, strict=True)):
        fixed = footprint.fixed_bytes(first=index == 0, last=index == len(chosen) - 1)
        stages.append(
            StageAssignment(
                node_id=node.node_id,
                address=node.address,
                stage_index=index,
                layer_range=LayerRange(start, start + count),
                planned_bytes=fixed + count * footprint.bytes_per_layer,
                planned_step_ms=step_ms,
            )
        )
        start += count
    plan = Plan(stages=tuple(stages))
    left_out = [n.node_id for n in order if n not in chosen]
    if left_out:
        logger.info("plan leaves out node(s) %s", ", ".join(left_out))
    logger.debug("layer plan:\n%s", plan.describe())
    return plan


def _check_inputs(
    nodes: Sequence[NodeCapacity], footprint: ModelFootprint, max_stages: int | None
) -> None:
    if not nodes:
        raise InvalidRequest(
            "no stage nodes to plan on; start a stage with `mesh-stage join` and retry"
        )
    if footprint.layer_count < 1:
        raise InvalidRequest(f"the model has {footprint.layer_count} layers; need at least 1")
    for name in ("layer_bytes", "embed_bytes", "head_bytes", "kv_bytes_per_layer"):
        if getattr(footprint, name) < 0:
            raise InvalidRequest(f"model footprint {name} must be >= 0")
    if footprint.stage0_extra_bytes < 0:
        raise InvalidRequest("model footprint stage0_extra_bytes must be >= 0")
    if max_stages is not None and max_stages < 1:
        raise InvalidRequest(f"max_stages must be >= 1, got {max_stages}")
    seen: set[str] = set()
    for node in nodes:
        if node.node_id in seen:
            raise InvalidRequest(f"node id {node.node_id!r} appears twice; node ids must be unique")
        seen.add(node.node_id)
        if node.memory_bytes < 0:
            raise InvalidRequest(
                f"node {node.node_id} offers {node.memory_bytes} bytes; memory must be >= 0 "
                "(0 means unknown)"
            )
        if not (node.speed_hint > 0 and math.isfinite(node.speed_hint)):
            raise InvalidRequest(
                f"node {node.node_id} has speed hint {node.speed_hint}; it must be positive"
            )
        for name in ("layer_ms", "head_ms", "overhead_ms"):
            value = getattr(node, name)
            if not (value >= 0 and math.isfinite(value)):
                raise InvalidRequest(
                    f"node {node.node_id} reports {name} {value}; it must be >= 0 (0: unmeasured)"
                )
    frontends = [n.node_id for n in nodes if n.frontend]
    if len(frontends) > 1:
        raise InvalidRequest(
            f"nodes {', '.join(frontends)} all claim the HTTP frontend; only one may be stage 0"
        )


def _stage_order(nodes: Sequence[NodeCapacity]) -> list[NodeCapacity]:
    """The frontend node first (else the first node), then the rest as given."""
    head = next((n for n in nodes if n.frontend), nodes[0])
    return [head] + [n for n in nodes if n is not head]


def _capacities(chain: Sequence[NodeCapacity], footprint: ModelFootprint) -> list[float]:
    """Whole layers each node can hold at its position (``math.inf`` when unlimited)."""
    result: list[float] = []
    for index, node in enumerate(chain):
        if node.memory_bytes == 0:
            result.append(math.inf)
            continue
        fixed = footprint.fixed_bytes(first=index == 0, last=index == len(chain) - 1)
        room = node.memory_bytes - fixed
        if footprint.bytes_per_layer == 0:
            result.append(math.inf if room >= 0 else 0)
        else:
            result.append(max(0, room // footprint.bytes_per_layer))
    return result


def _choose_nodes(
    order: list[NodeCapacity], footprint: ModelFootprint, limit: int
) -> list[NodeCapacity]:
    """Keep stage 0 and the largest other nodes, up to ``limit``, that hold >= 1 layer."""
    rank = {
        node.node_id: (
            -(math.inf if node.memory_bytes == 0 else node.memory_bytes),
            -node.speed_hint,
            i,
        )
        for i, node in enumerate(order)
    }
    chain = list(order)
    while True:
        if len(chain) > limit:
            keep = sorted(chain[1:], key=lambda n: rank[n.node_id])[: limit - 1]
            chain = [chain[0]] + [n for n in chain[1:] if n in keep]
        capacities = _capacities(chain, footprint)
        too_small = [n for n, c in zip(chain[1:], capacities[1:], strict=True) if c < 1]
        if not too_small:
            return chain
        # Drop the smallest misfit first: removing one can change which node is last.
        drop = max(too_small, key=lambda n: rank[n.node_id])
        index = chain.index(drop)
        need = footprint.fixed_bytes(first=False, last=index == len(chain) - 1)
        logger.warning(
            "node %s offers %.2f GiB (%s), less than one layer at stage %d needs "
            "(%.3f GiB); leaving it out: to use it, state more (mesh-stage join --memory) "
            "or free memory on its device",
            drop.node_id,
            drop.memory_bytes / GIB,
            "measured" if drop.memory_measured else "stated",
            index,
            (need + footprint.bytes_per_layer) / GIB,
        )
        chain.remove(drop)


def step_estimates(
    chain: Sequence[NodeCapacity], counts: Sequence[int], footprint: ModelFootprint
) -> list[float]:
    """The estimated step time (ms) of each stage of ``chain`` holding ``counts``
    layers, by the rule the planner balances with; zeros when nothing is measured."""
    compute = _measured_compute(chain, footprint)
    if compute is None:
        return [0.0] * len(chain)
    layer_ms, fixed_ms = compute
    return [n * ms + f for n, ms, f in zip(counts, layer_ms, fixed_ms, strict=True)]


def _measured_compute(
    chain: Sequence[NodeCapacity], footprint: ModelFootprint
) -> tuple[list[float], list[float]] | None:
    """Per stage of ``chain``: ms per layer and fixed ms (the head on the last stage,
    the frontend's overhead on stage 0); None when no node's compute is measured.
    With no head measured anywhere, the prior's head load stands in."""
    known = [n.layer_ms for n in chain if n.layer_ms > 0]
    if not known:
        return None
    mean = sum(known) / len(known)
    layer_ms = [n.layer_ms if n.layer_ms > 0 else mean for n in chain]
    fixed_ms = [0.0] * len(chain)
    fixed_ms[0] += chain[0].overhead_ms
    # The head's cost relative to a layer is the model's; the device scales both.
    heads = [n.head_ms / n.layer_ms for n in chain if n.head_ms > 0 and n.layer_ms > 0]
    last = chain[-1]
    if last.head_ms > 0 and last.layer_ms > 0:
        fixed_ms[-1] += last.head_ms
    elif heads:
        fixed_ms[-1] += heads[0] * layer_ms[-1]
    elif footprint.layer_bytes > 0:
        prior = HEAD_LOAD_FACTOR * footprint.head_bytes / footprint.layer_bytes
        fixed_ms[-1] += prior * layer_ms[-1]
    return layer_ms, fixed_ms


def _weights(chain: Sequence[NodeCapacity], footprint: ModelFootprint) -> list[float]:
    rooms: list[float | None] = []
    for index, node in enumerate(chain):
        if not node.memory_stated:
            rooms.append(None)
        else:
            fixed = footprint.fixed_bytes(first=index == 0, last=index == len(chain) - 1)
            rooms.append(float(max(1, node.memory_bytes - fixed)))
    known = [r for r in rooms if r is not None]
    unlimited_room = max(known) if known else 1.0
    weights: list[float] = []
    for node, room in zip(chain, rooms, strict=True):
        peers = [n.speed_hint for n in chain if _stated(n) == _stated(node)]
        relative_speed = node.speed_hint / (sum(peers) / len(peers))
        weights.append((unlimited_room if room is None else room) * relative_speed)
    return weights


def _stated(node: NodeCapacity) -> int:
    return node.memory_bytes if node.memory_stated else 0


def _apportion(
    weights: Sequence[float],
    capacities: Sequence[float],
    total: int,
    fixed_load: Sequence[float] | None = None,
) -> list[int]:
    """Integer counts >= 1 and <= capacity summing to ``total``, close to proportional.

    Each further layer goes to the node whose load (its layers plus ``fixed_load``,
    in layers) per unit of weight would stay lowest, so the most loaded stage
    (relative to its weight) is as light as it can be; ties go to the earlier stage.
    """
    counts = [1] * len(weights)
    fixed = list(fixed_load) if fixed_load is not None else [0.0] * len(weights)
    for _ in range(total - len(weights)):
        best = min(
            (i for i in range(len(weights)) if counts[i] < capacities[i]),
            key=lambda i: ((counts[i] + 1 + fixed[i]) / weights[i], i),
        )
        counts[best] += 1
    return counts


def _cannot_fit_message(
    chain: Sequence[NodeCapacity], footprint: ModelFootprint, node_count: int
) -> str:
    f = footprint
    parts = [f"{f.layer_count * f.bytes_per_layer / GIB:.2f} GiB for {f.layer_count} layers"]
    parts.append(f"{f.embed_bytes / GIB:.2f} GiB embeddings")
    parts.append(f"{f.head_bytes / GIB:.2f} GiB head")
    if f.stage0_extra_bytes:
        parts.append(f"{f.stage0_extra_bytes / GIB:.2f} GiB stage-0 extras")
    offered = sum(n.memory_bytes for n in chain)
    detail = ", ".join(f"{n.node_id} {n.memory_bytes / GIB:.2f} GiB" for n in chain)
    message = (
        f"the model needs {f.total_bytes / GIB:.2f} GiB ({' plus '.join(parts)}; "
        f"each layer is {f.layer_bytes / GIB:.3f} GiB of weights and "
        f"{f.kv_bytes_per_layer / GIB:.3f} GiB of KV); the {len(chain)} stage(s) offer "
        f"{offered / GIB:.2f} GiB ({detail}); add a stage, or hold KV for fewer sessions "
        "or positions (--kv-max-sessions, --max-tokens-per-session)"
    )
    head_node = chain[0]
    first_fixed = f.fixed_bytes(first=True, last=len(chain) == 1)
    if head_node.memory_bytes and head_node.memory_bytes < first_fixed + f.bytes_per_layer:
        message += (
            f"; stage 0 ({head_node.node_id}) alone needs "
            f"{(first_fixed + f.bytes_per_layer) / GIB:.2f} GiB for the embeddings, "
            "stage-0 extras and one layer"
        )
    if len(chain) < node_count:
        message += (
            f" ({node_count - len(chain)} joined node(s) were left out: too small for "
            "a layer, or past --max-stages)"
        )
    return message
