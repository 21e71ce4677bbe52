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

A model whose layer types rotate by different tables (Gemma 3: sliding-window layers
by a base of 10,000, the others by their own base and scaling) gives its module the
layer type as an argument; ``RotaryAngles`` built with those ``kinds`` returns every
table at once, ``[kinds, T, 1, head_dim]``, and each block picks its own
(``DecoderBlock.rope_index``). Rows are always on the third dimension from the end.
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
    """``cos``/``sin'`` of ``[T, 1, head_dim]`` for positions ``start .. start + T``
    (``[kinds, T, 1, head_dim]`` with ``kinds``)."""

    __slots__ = ("_module", "_dtype", "_device", "_static", "_cos", "_sin", "_kinds")

    def __init__(
        self,
        module: nn.Module,
        dtype: torch.dtype,
        device: torch.device,
        kinds: tuple[str, ...] | None = None,
    ) -> None:
        self._module = module
        self._dtype = dtype
        self._device = device
        self._kinds = kinds
        rope_type = getattr(module, "rope_type", "default")
        types = rope_type.values() if isinstance(rope_type, dict) else [rope_type]
        self._static = all("dynamic" not in str(t) and str(t) != "longrope" for t in types)
        empty = (0, 1, 0) if kinds is None else (len(kinds), 0, 1, 0)
        self._cos = torch.empty(empty, dtype=dtype, device=device)
        self._sin = self._cos

    @property
    def width(self) -> int:
        """How many dimensions of each head the angles turn (the head's, or its first
        part where the model rotates part of it)."""
        return int(self(0, 1)[0].shape[-1])

    @property
    def kinds(self) -> int:
        """How many tables each call returns (1: a ``[T, 1, head_dim]`` tensor)."""
        return 1 if self._kinds is None else len(self._kinds)

    @property
    def static(self) -> bool:
        """True when the angles come from a table (they depend on the position only)."""
        return self._static

    def __call__(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        end = start + count
        if not self._static:
            return self._compute(start, end)
        held = self._cos.shape[-3]
        if end > held:
            size = -(-end // TABLE_STEP_POSITIONS) * TABLE_STEP_POSITIONS
            self._cos, self._sin = self._compute(0, max(size, 2 * held))
        return self._cos[..., start:end, :, :], self._sin[..., start:end, :, :]

    def _compute(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(start, end, device=self._device).unsqueeze(0)
        probe = torch.empty(0, dtype=self._dtype, device=self._device)
        if self._kinds is None:
            cos, sin = self._module(probe, positions)
            return cos[0].unsqueeze(1), signed_sin(sin[0]).unsqueeze(1)
        tables = [self._module(probe, positions, kind) for kind in self._kinds]
        cos = torch.stack([c[0].unsqueeze(1) for c, _ in tables])
        sin = torch.stack([signed_sin(s[0]).unsqueeze(1) for _, s in tables])
        return cos, sin
