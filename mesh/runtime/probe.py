"""What one decoder layer and the LM head cost on this stage's device, measured.

After a stage loads its layers it runs a few decode steps of a handful of dummy
rows (throw-away sessions, dropped afterwards) and times them: the first step is
the warm-up (it opens the sessions and touches every weight; with ``--compile`` the
load has already compiled the decode path), then steps without logits and, on the
last stage, the final norm and LM head over the same rows alternate until
``repeats`` of each or ``budget_s`` are spent. The layer figure is the median step
divided by the stage's layers (stage 0's embedding lookup rides along: it is a
gather of a few rows); the head figure is the median head call. The coordinator's
planner splits layers with them.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass

import torch

from mesh.runtime.spans import Span
from mesh.runtime.stage import StageRuntime

logger = logging.getLogger(__name__)

PROBE_ROWS = 4
PROBE_REPEATS = 8
PROBE_BUDGET_S = 0.25
_SESSION = "__step-probe-{}__"


@dataclass(frozen=True)
class StepProbe:
    """Milliseconds per decode step of ``rows`` rows: one decoder layer, the head."""

    layer_ms: float
    head_ms: float
    rows: int
    steps: int


def probe_step(
    runtime: StageRuntime,
    rows: int = PROBE_ROWS,
    repeats: int = PROBE_REPEATS,
    budget_s: float = PROBE_BUDGET_S,
) -> StepProbe:
    """Time decode steps of ``rows`` dummy rows on ``runtime`` (see the module
    docstring). Needs no sessions of its own beyond the ones it opens and drops."""
    rows = max(1, min(rows, runtime.max_sessions))
    positions = runtime.max_tokens_per_session
    sessions = [_SESSION.format(i) for i in range(rows)]
    steps: list[float] = []
    heads: list[float] = []
    started = time.perf_counter()
    try:
        _step(runtime, sessions, 0)  # warm-up; opens the sessions
        if runtime.is_last:
            _time_head(runtime, rows)  # warm-up
        for pos in range(1, min(positions, repeats + 1)):
            steps.append(_step(runtime, sessions, pos))
            if runtime.is_last:
                heads.append(_time_head(runtime, rows))
            if time.perf_counter() - started > budget_s:
                break
    finally:
        for session in sessions:
            runtime.drop_session(session)
    layers = max(1, len(runtime.layer_range))
    plain = statistics.median(steps) if steps else 0.0
    head = statistics.median(heads) if heads else 0.0
    probe = StepProbe(plain / layers, head, rows, len(steps))
    logger.info(
        "step probe on %s (%s rows, %s steps in %.0f ms): %.3f ms per layer, head %.3f ms",
        runtime.device,
        rows,
        probe.steps,
        (time.perf_counter() - started) * 1000.0,
        probe.layer_ms,
        probe.head_ms,
    )
    return probe


def _step(runtime: StageRuntime, sessions: list[str], pos: int) -> float:
    """One timed decode step (no logits) of every probe session at ``pos``, in ms."""
    count = len(sessions)
    if runtime.is_first:
        inputs = torch.zeros(count, dtype=torch.long)
    else:
        inputs = torch.zeros(count, runtime.hidden_size, dtype=runtime.torch_dtype)
    spans = [Span(session, pos, 1, logit_rows=0) for session in sessions]
    started = _now(runtime)
    out = runtime.forward_batch(spans, inputs)
    elapsed_ms = _now(runtime) - started
    if out.errors:
        first = next(iter(out.errors.values()))
        raise RuntimeError(f"the step probe's dummy rows were refused: {first.message}")
    return elapsed_ms


def _time_head(runtime: StageRuntime, rows: int) -> float:
    """One timed call of the final norm and LM head over ``rows`` dummy rows, in ms."""
    hidden = torch.zeros(rows, runtime.hidden_size, dtype=runtime.torch_dtype)
    started = _now(runtime)
    runtime.head_logits(hidden)
    return _now(runtime) - started


def _now(runtime: StageRuntime) -> float:
    """Milliseconds on a clock that waits for the device's queued work first."""
    if runtime.device.startswith("cuda"):
        torch.cuda.synchronize(runtime.device)
    return time.perf_counter() * 1000.0
