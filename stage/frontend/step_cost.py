"""Whether a draft row pays in a batched step: a pure rule over the measured cost of
a step by its row count.

A step of ``n`` decoding requests commits ``n`` tokens in ``a + b * n`` (``a``: what a
frame costs whatever its rows, ``b``: what each row adds, both on the pipeline's
slowest stage). One more row costs ``b`` and commits the ``j``-th draft token of a
window with probability ``alpha ** j`` (``alpha``: the request's acceptance per draft
token). The row raises the step's tokens per second only when
``alpha ** j > n * b / (a + b * n)``. With one request and a frame whose cost is
mostly fixed (a GEMV reads every weight once) almost any acceptance pays; with many
requests in a step whose kernels grow with rows, only drafts that are nearly sure
do. So the window a request may send is the largest ``k`` whose last row still
pays. The engine core applies it when two or more requests decode in a step; a
request alone is left to its own window policy, which weighs its drafts against its
measured round time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class StepCostFit:
    """Decayed least-squares fit of a frame's cost (ms, on its slowest stage) against
    its rows: ``cost = fixed_ms + per_row_ms * rows``."""

    decay: float = 0.98
    _sums: list[float] = field(default_factory=lambda: [0.0] * 5)  # w, r, t, rr, rt
    # The most rows of a frame observed (the range the fit has seen).
    max_rows: int = 0

    def observe(self, rows: int, cost_ms: float) -> None:
        if rows <= 0 or not cost_ms > 0.0:
            return
        self.max_rows = max(self.max_rows, rows)
        r, t = float(rows), float(cost_ms)
        for i, value in enumerate((1.0, r, t, r * r, r * t)):
            self._sums[i] = self.decay * self._sums[i] + value

    def model(self) -> tuple[float, float] | None:
        """``(fixed_ms, per_row_ms)``, or None until the rows have varied."""
        w, sr, st, srr, srt = self._sums
        if w < 4.0:
            return None
        mean_r, mean_t = sr / w, st / w
        var_r = srr / w - mean_r * mean_r
        if var_r < 1.0:
            return None
        per_row = max(0.0, (srt / w - mean_r * mean_t) / var_r)
        return max(mean_t - per_row * mean_r, 0.0), per_row

    def cost_per_row(self) -> float | None:
        """The frames' cost over their rows (ms a row, their fixed cost counted as
        rows' cost: an upper bound of ``per_row_ms``), or None before any frame; what
        goes by until ``model`` can tell the two apart."""
        _, sr, st, _, _ = self._sums
        return st / sr if sr > 0.0 else None


def row_threshold(model: tuple[float, float] | None, decoding: int) -> float:
    """The probability of commit a draft row must beat in a step of ``decoding``
    requests (0 when nothing is known yet)."""
    if model is None or decoding <= 0:
        return 0.0
    fixed_ms, per_row_ms = model
    denominator = fixed_ms + per_row_ms * decoding
    return decoding * per_row_ms / denominator if denominator > 0 else 0.0


def paying_window(alpha: float, threshold: float, cap: int) -> int:
    """The largest ``k <= cap`` with ``alpha ** k > threshold``."""
    if cap <= 0 or threshold <= 0.0:
        return max(cap, 0)
    if alpha <= threshold:
        return 0
    if alpha >= 1.0:
        return cap
    return max(0, min(cap, math.ceil(math.log(threshold) / math.log(alpha)) - 1))


def acceptance(drafted: int, accepted: int) -> float:
    """A request's acceptance per draft token, with a weak prior of 0.5 (so a request
    that has not drafted yet may probe)."""
    return (accepted + 1.0) / (drafted + 2.0)
