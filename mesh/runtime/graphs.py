"""Decode steps with fixed shapes and addresses, replayed as CUDA graphs.

A decode step (one token) launches the same kernels every time; on a GPU, launching
them one by one from Python costs more than running them for a small model. A CUDA
graph records the launches once and replays them with one call, but it replays
exactly what it recorded: the same tensors at the same addresses, the same shapes.

``StaticDecode`` is a decode step written that way for one session's KV buffer. The
token (or hidden state), the position and the rotary angles are copied into tensors
it owns; keys and values are written with ``index_copy_`` at the position tensor;
attention spans the buffer's whole capacity with a mask computed from the position
on the device (the unused tail of a buffer is zero-filled, so masked positions stay
finite). Its output lands in a tensor it owns, which the caller copies out.

``DecodeGraph`` captures a ``StaticDecode`` into a ``torch.cuda.CUDAGraph`` and
replays it. The runtime keeps one per session and captures again when the session's
buffer grows (a new buffer is a new address). On a CPU the same ``StaticDecode``
runs eagerly: that is how the tests check its arithmetic against the regular path.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mesh.runtime.block import DecoderBlock, cap_logits, rms_norm, run_block

# Steps run on a side stream before capture (CUDA's lazy initialisation of kernels
# and workspaces must not happen inside the capture).
WARM_UP_STEPS = 2


class StaticDecode:
    """One decode step over ``kv_layers`` (one ``[2, 1, kv_heads, C, D]`` buffer per
    block), with every input and output at a fixed address."""

    def __init__(
        self,
        blocks: list[DecoderBlock],
        kv_layers: list[torch.Tensor],
        embed: Callable[[torch.Tensor], torch.Tensor] | None,
        head: tuple[torch.Tensor, float, Callable[[torch.Tensor], torch.Tensor]] | None,
        hidden_size: int,
        rotary_width: int,
        window: int | None,
        dtype: torch.dtype,
        device: torch.device,
        rope_kinds: int = 1,
        logit_cap: float | None = None,
    ) -> None:
        self.blocks = blocks
        self.kv_layers = kv_layers
        self.capacity = int(kv_layers[0].shape[3])
        self.embed = embed
        self.head = head
        self.window = window
        self.logit_cap = logit_cap
        if embed is not None:
            self.inputs = torch.zeros(1, dtype=torch.long, device=device)
        else:
            self.inputs = torch.zeros(1, hidden_size, dtype=dtype, device=device)
        self.position = torch.zeros(1, dtype=torch.long, device=device)
        # One row of each rotary table (mesh/runtime/rotary.py).
        angles = (1, 1, rotary_width) if rope_kinds == 1 else (rope_kinds, 1, 1, rotary_width)
        self.cos = torch.zeros(angles, dtype=dtype, device=device)
        self.sin = torch.zeros(angles, dtype=dtype, device=device)
        self.key_positions = torch.arange(self.capacity, device=device)
        self.output: torch.Tensor | None = None

    def load(
        self, inputs: torch.Tensor, position: int, cos: torch.Tensor, sin: torch.Tensor
    ) -> None:
        """Copy one step's inputs into the owned tensors."""
        self.inputs.copy_(inputs)
        self.position.fill_(position)
        self.cos.copy_(cos)
        self.sin.copy_(sin)

    def run(self) -> torch.Tensor:
        """The step over the owned tensors; returns (and keeps) its output tensor."""
        seen = self.key_positions <= self.position
        full = seen.view(1, 1, 1, self.capacity)
        sliding = full
        if self.window is not None:
            sliding = (seen & (self.key_positions > self.position - self.window)).view(
                1, 1, 1, self.capacity
            )
        hidden = self.embed(self.inputs) if self.embed is not None else self.inputs
        for block, kv in zip(self.blocks, self.kv_layers, strict=True):
            mask = sliding if block.sliding else full
            hidden = run_block(block, hidden, self.cos, self.sin, kv, self.position, mask)
        if self.head is not None:
            norm, eps, lm_head = self.head
            hidden = cap_logits(lm_head(rms_norm(hidden, norm, eps)), self.logit_cap).float()
        self.output = hidden
        return hidden


class DecodeGraph:
    """A ``StaticDecode`` recorded as a CUDA graph (or, off CUDA, run eagerly)."""

    def __init__(self, step: StaticDecode, capture: bool) -> None:
        self.step = step
        self.graph: torch.cuda.CUDAGraph | None = None
        self._capture = capture

    @property
    def capacity(self) -> int:
        return self.step.capacity

    def __call__(
        self, inputs: torch.Tensor, position: int, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """Run the step for ``inputs`` at ``position``; returns a fresh output tensor.
        The first call on CUDA warms up and captures; the step it runs then writes
        the same keys and values the real step does, so warming up loses nothing."""
        self.step.load(inputs, position, cos, sin)
        if not self._capture:
            return self.step.run().clone()
        if self.graph is None:
            self.graph = self._record()
        self.graph.replay()
        return self.step.output.clone()  # type: ignore[union-attr]

    def _record(self) -> torch.cuda.CUDAGraph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARM_UP_STEPS):
                self.step.run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA work of other threads (a draft model on stage 0) may go on
        # during the capture.
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            self.step.run()
        return graph
