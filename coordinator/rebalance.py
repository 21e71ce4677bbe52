"""When the coordinator plans again because the stages' measured step times drifted
apart (``--rebalance-spread``), and which plan it then loads.

The rule is ``balance.should_rebalance`` (serving, stage 0 idle, every stage measured,
the slowest more than the spread above the fastest), checked at most every
``check_s``. A plan is loaded only when it moves layers and its slowest stage is
estimated ``balance.REBALANCE_GAIN`` faster than the slowest stage measured now; after
a rebalance that did not make the slowest stage that much faster, rebalancing stops
until the mesh is planned again for another reason (``reset``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from coordinator import balance, registry
from coordinator.planner import ModelFootprint, Plan
from mesh.errors import MeshError

logger = logging.getLogger(__name__)


class Rebalancer:
    """The rebalance rule and its memory of the last rebalance (one per coordinator)."""

    def __init__(self, spread: float, min_frames: int, check_s: float) -> None:
        self.spread = spread
        self.min_frames = min_frames
        self.check_s = check_s
        self._last_check = float("-inf")
        # The slowest measured stage before the last rebalance.
        self._rebalanced_from: float | None = None
        self._stopped = False
        self._declined_term = 0

    @property
    def stopped(self) -> bool:
        return self._stopped

    def reset(self) -> None:
        """The mesh is planned for another reason (a membership change, a failure)."""
        self._rebalanced_from = None
        self._stopped = False

    def due(self, state: registry.State, now: float) -> bool:
        if self.spread <= 0 or self._stopped or now - self._last_check < self.check_s:
            return False
        return balance.should_rebalance(state, self.spread, self.min_frames)

    def decide(
        self,
        state: registry.State,
        footprint: ModelFootprint,
        plan_for: Callable[[registry.State, ModelFootprint], Plan],
        now: float,
    ) -> Plan | None:
        """The plan to load, or None (the log says why)."""
        self._last_check = now
        steps = balance.stage_steps(state, footprint)
        try:
            plan = plan_for(state, footprint)
        except MeshError as error:
            logger.info("cannot plan a better balance: %s", error.message)
            return None
        if state.topology is None or _ranges(plan) == _ranges(state.topology):
            logger.debug("measured step times differ, but the plan is already the balanced one")
            return None
        before = max(s.measured_ms for s in steps)
        gain = 1.0 - balance.REBALANCE_GAIN
        times = ", ".join(f"{s.measured_ms:.2f} ms" for s in steps)
        if self._rebalanced_from is not None and before > self._rebalanced_from * gain:
            logger.info(
                "the last rebalance did not make the slowest stage faster (%.2f ms before, "
                "%.2f ms now): no more rebalancing until the mesh is planned again",
                self._rebalanced_from,
                before,
            )
            self._stopped = True
            return None
        after = max(s.planned_step_ms for s in plan.stages)
        if after > before * gain:
            # Said once per term; the check repeats every check_s.
            declined, self._declined_term = self._declined_term, state.term
            logger.log(
                logging.DEBUG if declined == state.term else logging.INFO,
                "measured step times %s differ by more than %.0f%%, but no plan is "
                "estimated %.0f%% faster (%.2f ms)",
                times,
                self.spread * 100,
                balance.REBALANCE_GAIN * 100,
                after,
            )
            return None
        logger.info(
            "measured step times %s differ by more than %.0f%%: planning again "
            "(slowest stage %.2f ms measured, %.2f ms estimated)",
            times,
            self.spread * 100,
            before,
            after,
        )
        self._rebalanced_from = before
        return plan


def _ranges(plan: Plan) -> list[tuple[str, int, int]]:
    return [(s.node_id, s.layer_range.start, s.layer_range.end) for s in plan.stages]
