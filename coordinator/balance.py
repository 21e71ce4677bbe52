"""Compute balance from measurements: what the planner is told about each node's
speed, each stage's planned and measured step time, and when the coordinator plans
again because the stages' step times drifted apart.

Pure functions of the registry state. Two measurements meet here:

- the step probe every stage runs after it loads (``layer_ms``, ``head_ms``: a
  decode step of a few dummy rows on the node's device), kept per node across terms;
- the mean compute time of each stage's recent decode and verify frames while
  serving (``step_ms``, from heartbeats, frames of the current term only; frames
  with prompt rows are left out: ``stage.node.measures_step``).

Serving frames are not the probe's step (more rows, prompt chunks, neighbours on
the same cores), so once every stage has measured its frames, the probe's figures
are scaled to serving milliseconds by one *scale*: the median, over the stages
after stage 0, of measured step time over probe estimate. The relative speed of
the nodes stays the probe's (a controlled measurement; the serving figures of one
stage swing with whatever else runs on its cores). What stage 0 measures beyond its
scaled estimate is its frontend's overhead (the HTTP server, tokenizer, drafter and
engine core share its process), planned as fixed load on stage 0.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace

from coordinator.planner import ModelFootprint, NodeCapacity, step_estimates
from coordinator.registry import State, frontend_idle, planner_nodes

# Plan again once the slowest stage's measured step time is this much above the
# fastest one's (and stage 0 is idle).
REBALANCE_SPREAD = 0.15
# Frames each stage must have measured in the current term before its figure counts.
MIN_STEP_FRAMES = 64
# A new plan is loaded only when its slowest stage is estimated at least this much
# faster than the slowest stage measured now (measurements are noisy; a reload is
# not free).
REBALANCE_GAIN = 0.05


@dataclass(frozen=True)
class StageStep:
    """One stage of the current topology: planned and measured step time (ms)."""

    node_id: str
    stage_index: int
    layers: int
    planned_ms: float
    measured_ms: float


@dataclass(frozen=True)
class Calibration:
    """Serving ms per probe ms (``scale``) and stage 0's frontend overhead in serving
    ms, charged to ``frontend_node``."""

    scale: float = 1.0
    overhead_ms: float = 0.0
    frontend_node: str = ""


def calibrate(
    state: State, footprint: ModelFootprint, min_frames: int = MIN_STEP_FRAMES
) -> Calibration:
    """Scales and stage 0's overhead from the current topology's measurements (the
    neutral calibration, probe milliseconds, when they are missing)."""
    stages = _measured_stages(state, footprint, min_frames)
    if stages is None or len(stages[0]) < 2:
        return Calibration()
    estimates, measured = stages
    topology = state.topology.stages  # type: ignore[union-attr]
    ratios = [m / e for e, m in zip(estimates[1:], measured[1:], strict=True) if e > 0]
    if not ratios:
        return Calibration()
    scale = statistics.median(ratios)
    overhead = max(0.0, measured[0] - scale * estimates[0])
    return Calibration(scale, overhead, topology[0].node_id)


def planning_nodes(state: State, footprint: ModelFootprint) -> list[NodeCapacity]:
    """``planner_nodes`` in serving milliseconds: each node's probe figures times its
    scale, and stage 0's measured frontend overhead."""
    return _scaled(planner_nodes(state), calibrate(state, footprint))


def _scaled(nodes: list[NodeCapacity], calibration: Calibration) -> list[NodeCapacity]:
    result = []
    scale = calibration.scale
    for node in nodes:
        overhead = calibration.overhead_ms if node.node_id == calibration.frontend_node else 0.0
        result.append(
            replace(
                node,
                layer_ms=node.layer_ms * scale,
                head_ms=node.head_ms * scale,
                overhead_ms=overhead,
            )
        )
    return result


def stage_steps(state: State, footprint: ModelFootprint) -> list[StageStep]:
    """Planned (the probe's estimate; in serving ms once calibrated, when it equals
    the measured time for the layout serving now) and measured step time of every
    stage of the current topology; empty without a topology."""
    if state.topology is None:
        return []
    chain = _chain(state)
    if chain is None:
        return []
    chain = _scaled(chain, calibrate(state, footprint))
    counts = [len(s.layer_range) for s in state.topology.stages]
    planned = step_estimates(chain, counts, footprint)
    result = []
    for stage, estimate in zip(state.topology.stages, planned, strict=True):
        node = state.node(stage.node_id)
        result.append(
            StageStep(
                node_id=stage.node_id,
                stage_index=stage.stage_index,
                layers=len(stage.layer_range),
                planned_ms=estimate,
                measured_ms=node.step_ms if node is not None else 0.0,
            )
        )
    return result


def spread(state: State, min_frames: int = MIN_STEP_FRAMES) -> float | None:
    """Slowest over fastest measured stage step time, less 1; None until every stage
    of a 2+ stage topology has measured ``min_frames`` frames of the current term."""
    if state.topology is None or len(state.topology.stages) < 2:
        return None
    times = _step_times(state, min_frames)
    return max(times) / min(times) - 1.0 if times is not None else None


def _step_times(state: State, min_frames: int) -> list[float] | None:
    """Each current stage's measured step time (ms), in stage order; None unless
    every one has measured ``min_frames`` frames."""
    times = []
    for stage in state.topology.stages:  # type: ignore[union-attr]
        node = state.node(stage.node_id)
        if node is None or node.step_frames < min_frames or node.step_ms <= 0:
            return None
        times.append(node.step_ms)
    return times


def should_rebalance(
    state: State, threshold: float = REBALANCE_SPREAD, min_frames: int = MIN_STEP_FRAMES
) -> bool:
    """Serving, stage 0 idle, and the measured step times differ by more than
    ``threshold`` (0.15: the slowest stage is more than 15% above the fastest)."""
    if state.mesh_state != "serving" or not frontend_idle(state):
        return False
    measured = spread(state, min_frames)
    return measured is not None and measured > threshold


def _chain(state: State) -> list[NodeCapacity] | None:
    """The planner's view of the current topology's nodes, in stage order."""
    chain = []
    for stage in state.topology.stages:  # type: ignore[union-attr]
        node = state.node(stage.node_id)
        if node is None:
            return None
        chain.append(node.capacity())
    return chain


def _measured_stages(
    state: State, footprint: ModelFootprint, min_frames: int
) -> tuple[list[float], list[float]] | None:
    """Probe estimates (no overhead) and measured step times of the current stages;
    None unless every stage has both."""
    if state.topology is None:
        return None
    chain = _chain(state)
    if chain is None or any(n.layer_ms <= 0 for n in chain):
        return None
    measured = _step_times(state, min_frames)
    if measured is None:
        return None
    counts = [len(s.layer_range) for s in state.topology.stages]
    return step_estimates(chain, counts, footprint), measured
