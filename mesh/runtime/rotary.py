"""Rotary angles per position, in the form the decoder blocks apply them.

HF applies rotary embeddings as ``x * cos + rotate_half(x) * sin`` with
``rotate_half(x) = cat(-x2, x1)``. The blocks compute ``x * cos + swap(x) * sin'``
with ``swap(x) = cat(x2, x1)`` and ``sin' = cat(-sin1, sin2)``: the same products
(a negation is exact), with the sign taken out of the per-layer work.

``RotaryAngles`` wraps the model's own HF rotary module, so every rope type keeps
its arithmetic. For the types whose angles depend only on the position (all but the
dynamic and longrope ones, which rescale with the frame's length) it keeps a table
that grows with the longest position seen, so a decode step looks its angles up
instead of recomputing them.
"""

from __future__ import annotations

import torch
from torch import nn

TABLE_STEP_POSITIONS = 256


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` with its first half negated (see the module docstring)."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


class RotaryAngles:
    """``cos``/``sin'`` of ``[T, 1, head_dim]`` for positions ``start .. start + T``."""

    __slots__ = ("_module", "_dtype", "_device", "_static", "_cos", "_sin")

    def __init__(self, module: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
        self._module = module
        self._dtype = dtype
        self._device = device
        rope_type = str(getattr(module, "rope_type", "default"))
        self._static = "dynamic" not in rope_type and rope_type != "longrope"
        self._cos = torch.empty(0, 1, 0, dtype=dtype, device=device)
        self._sin = self._cos

    @property
    def static(self) -> bool:
        """True when the angles come from a table (they depend on the position only)."""
        return self._static

    def __call__(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        end = start + count
        if not self._static:
            return self._compute(start, end)
        if end > self._cos.shape[0]:
            size = -(-end // TABLE_STEP_POSITIONS) * TABLE_STEP_POSITIONS
            self._cos, self._sin = self._compute(0, max(size, 2 * self._cos.shape[0]))
        return self._cos[start:end], self._sin[start:end]

    def _compute(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(start, end, device=self._device).unsqueeze(0)
        probe = torch.empty(0, dtype=self._dtype, device=self._device)
        cos, sin = self._module(probe, positions)
        return cos[0].unsqueeze(1), signed_sin(sin[0]).unsqueeze(1)
