"""What one decoder layer and the LM head cost on this stage's device, measured.

After a stage loads its layers it runs a few decode steps of a handful of dummy
rows (throw-away sessions, dropped afterwards) and times them: the first step is
the warm-up (it opens the sessions and touches every weight; with ``--compile`` the
load has already compiled the decode path), then steps with and without logits
alternate until ``repeats`` pairs or ``budget_s`` are spent. The layer figure is a
step without logits divided by the stage's layers (stage 0's embedding lookup rides
along: it is a gather of a few rows); the head figure is what asking for the logits
adds (the last stage only). The coordinator's planner splits layers with them.
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
PROBE_REPEATS = 5
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
    with_head: list[float] = []
    without_head: list[float] = []
    started = time.perf_counter()
    try:
        _step(runtime, sessions, 0, logits=False)  # warm-up; opens the sessions
        for pos in range(1, min(positions, 2 * repeats + 1), 2):
            without_head.append(_step(runtime, sessions, pos, logits=False))
            with_head.append(_step(runtime, sessions, pos + 1, logits=True))
            if time.perf_counter() - started > budget_s:
                break
    finally:
        for session in sessions:
            runtime.drop_session(session)
    layers = max(1, len(runtime.layer_range))
    plain = statistics.median(without_head) if without_head else 0.0
    head = 0.0
    if runtime.is_last and with_head:
        head = max(0.0, statistics.median(with_head) - plain)
    probe = StepProbe(plain / layers, head, rows, len(with_head) + len(without_head))
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


def _step(runtime: StageRuntime, sessions: list[str], pos: int, *, logits: bool) -> float:
    """One timed decode step of every probe session at ``pos``, in milliseconds."""
    count = len(sessions)
    if runtime.is_first:
        inputs = torch.zeros(count, dtype=torch.long)
    else:
        inputs = torch.zeros(count, runtime.hidden_size, dtype=runtime.torch_dtype)
    spans = [Span(session, pos, 1, logit_rows=1 if logits else 0) for session in sessions]
    cuda = runtime.device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize(runtime.device)
    started = time.perf_counter()
    out = runtime.forward_batch(spans, inputs)
    if cuda:
        torch.cuda.synchronize(runtime.device)
    elapsed_ms = (time.perf_counter() - started) * 1000.0
    if out.errors:
        first = next(iter(out.errors.values()))
        raise RuntimeError(f"the step probe's dummy rows were refused: {first.message}")
    return elapsed_ms
