"""Decode frames of several sessions replayed as CUDA graphs, one set per batch size.

A frame in which every segment is one decode token (the common frame under load)
launches the same kernels every step, many per layer; on a GPU the launches cost
more than the arithmetic for all but the largest models. ``DecodeGraph``
(mesh/runtime/graphs.py) replays a whole step, but only for one session: its
attention reads that session's buffers at fixed addresses. Here the batch is
captured by its row count instead, padded up to a bucket (2, 4, 8, 16, 32 rows), so
any sessions can share one capture.

Attention is what depends on the sessions (their caches, lengths and addresses), so
it stays out of the graphs: a step is ``layers + 1`` graphs, each piece the part of
a layer between two attentions (the output projection and MLP of one layer, then
the norm, the q/k/v linear and rotary of the next), with every session's attention
run eagerly between them into a buffer the next piece reads. Padding rows compute
alongside (every operation in a piece works row by row) and are dropped.

Off CUDA the same pieces run eagerly, which is how the tests check the arithmetic
against the regular path.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from mesh.runtime.block import DecoderBlock, finish, project, rms_norm
from mesh.runtime.sessions import SessionCache

BUCKETS = (2, 4, 8, 16, 32)
# Runs of every piece on a side stream before capture (lazy CUDA initialisation of
# kernels and workspaces must not happen inside a capture).
WARM_UP_STEPS = 2
# The bytes of gathered keys and values ``DecodeAttention`` aims to hold at once (it
# gathers that many layers at a time, at least one).
GATHER_BYTES = 256 << 20
# A frame whose one layer of gathered keys and values would pass this (many sessions
# at long contexts) attends per session instead (``DecodeAttention.fits``).
LAYER_GATHER_LIMIT = 1 << 30

Attend = Callable[[DecoderBlock, torch.Tensor, torch.Tensor], torch.Tensor]
Head = tuple[torch.Tensor, float, Callable[[torch.Tensor], torch.Tensor], bool]


def bucket_for(rows: int) -> int | None:
    """The smallest bucket holding ``rows`` decode rows (None beyond the largest)."""
    for size in BUCKETS:
        if rows <= size:
            return size
    return None


class BucketStep:
    """The pieces of one decode step over ``rows`` rows, at fixed addresses."""

    def __init__(
        self,
        blocks: list[DecoderBlock],
        rows: int,
        embed: Callable[[torch.Tensor], torch.Tensor] | None,
        head: Head | None,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
        capture: bool,
    ) -> None:
        self.blocks = blocks
        self.rows = rows
        self.embed = embed
        self.head = head
        head_dim = blocks[0].head_dim
        if embed is not None:
            self.inputs = torch.zeros(rows, dtype=torch.long, device=device)
        else:
            self.inputs = torch.zeros(rows, hidden_size, dtype=dtype, device=device)
        self.cos = torch.zeros(rows, 1, head_dim, dtype=dtype, device=device)
        self.sin = torch.zeros(rows, 1, head_dim, dtype=dtype, device=device)
        self.attended = [
            torch.zeros(rows, block.heads * head_dim, dtype=dtype, device=device)
            for block in blocks
        ]
        # What each piece leaves for the next: the residual stream entering each
        # layer, the q/k/v rows and rotated query/key view of each layer, the output.
        self.hidden: list[torch.Tensor | None] = [None] * len(blocks)
        self.qkv: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(blocks)
        self.output: torch.Tensor | None = None
        self._capture = capture
        self._graphs: list[torch.cuda.CUDAGraph] | None = None

    def _piece(self, index: int) -> None:
        """Piece ``index``: the end of layer ``index - 1`` (when there is one) and the
        start of layer ``index`` (or the head, after the last layer)."""
        if index == 0:
            hidden = self.embed(self.inputs) if self.embed is not None else self.inputs
        else:
            before = self.blocks[index - 1]
            hidden = finish(before, self.hidden[index - 1], self.attended[index - 1])  # type: ignore[arg-type]
        if index < len(self.blocks):
            self.hidden[index] = hidden
            self.qkv[index] = project(self.blocks[index], hidden, self.cos, self.sin)
            return
        if self.head is not None:
            norm, eps, lm_head, native = self.head
            hidden = lm_head(rms_norm(hidden, norm, eps, native)).float()
        self.output = hidden

    def _pieces(self) -> range:
        return range(len(self.blocks) + 1)

    def __call__(
        self, inputs: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        """One step for ``inputs`` (at most ``rows`` rows, with their rotary angles);
        ``attend`` runs a layer's attention for the real rows of its q/k/v. Returns
        a fresh tensor of the real rows' outputs."""
        count = inputs.shape[0]
        self.inputs[:count].copy_(inputs)
        self.cos[:count].copy_(cos)
        self.sin[:count].copy_(sin)
        if self._capture and self._graphs is None:
            self._graphs = self._record()
        for index in self._pieces():
            if self._graphs is not None:
                self._graphs[index].replay()
            else:
                self._piece(index)
            if index < len(self.blocks):
                qkv, query_key = self.qkv[index]  # type: ignore[misc]
                block = self.blocks[index]
                self.attended[index][:count].copy_(attend(block, qkv[:count], query_key[:count]))
        return self.output[:count].clone()  # type: ignore[index]

    def _record(self) -> list[torch.cuda.CUDAGraph]:
        """Warm every piece up on a side stream, then capture each into its own graph;
        the graphs share one memory pool and replay in the order captured, so what
        one piece leaves stays in place for the next."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARM_UP_STEPS):
                for index in self._pieces():
                    self._piece(index)
        torch.cuda.current_stream().wait_stream(side)
        pool = torch.cuda.graph_pool_handle()
        graphs = []
        for index in self._pieces():
            graph = torch.cuda.CUDAGraph()
            # thread_local: CUDA work of other threads (a draft model on stage 0) may
            # go on during the capture.
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                self._piece(index)
            graphs.append(graph)
        return graphs

    @property
    def captured(self) -> bool:
        return self._graphs is not None


class BatchDecodeGraphs:
    """A ``BucketStep`` per bucket, made on first use."""

    def __init__(self, make: Callable[[int], BucketStep]) -> None:
        self._make = make
        self._steps: dict[int, BucketStep] = {}

    def step_for(self, rows: int) -> BucketStep | None:
        size = bucket_for(rows)
        if size is None:
            return None
        step = self._steps.get(size)
        if step is None:
            step = self._steps[size] = self._make(size)
        return step

    def buckets(self) -> list[int]:
        """Bucket sizes made so far."""
        return sorted(self._steps)


class DecodeAttention:
    """Attention of one decode row per session for a whole frame, a few calls per
    layer whatever the number of sessions (the regular path calls SDPA once per
    session and layer, which costs more than a step's graphs on a GPU).

    The sessions' keys and values before this step are gathered once into one
    zero-padded tensor ``[sessions, layers, 2, kv_heads, longest, D]`` (in chunks of
    layers within ``budget_bytes``, default ``GATHER_BYTES``); each layer appends the
    step's own key and value as one more position and attends under a mask that
    keeps each session to its positions (and window). The step's keys and values are
    written into the sessions' caches once, after the last layer (``write_back``)."""

    def __init__(
        self,
        caches: list[SessionCache],
        positions: list[int],
        window: int | None,
        budget_bytes: int | None = None,
    ) -> None:
        layout = caches[0].layout
        self.caches = caches
        self.positions = positions
        self.first_layer = layout.first_layer
        self.layer_count = layout.layer_count
        self.longest = max(positions)
        device = layout.device
        per_layer = self.layer_bytes(caches, positions)
        budget = GATHER_BYTES if budget_bytes is None else budget_bytes
        self.chunk = max(1, min(self.layer_count, budget // max(per_layer, 1)))
        self._gathered: torch.Tensor | None = None
        self._chunk_start = -1
        keys = torch.arange(self.longest + 1, device=device)
        at = torch.tensor(positions, device=device).unsqueeze(1)
        own = (keys < at) | (keys == self.longest)
        self.full = own.view(len(caches), 1, 1, -1)
        self.sliding = self.full
        if window is not None:
            self.sliding = (own & ((keys > at - window) | (keys == self.longest))).view(
                len(caches), 1, 1, -1
            )
        self._new: list[torch.Tensor] = []

    @staticmethod
    def layer_bytes(caches: list[SessionCache], positions: list[int]) -> int:
        """Bytes of one layer's gathered keys and values for these sessions."""
        layout = caches[0].layout
        element = torch.empty((), dtype=layout.dtype).element_size()
        return len(caches) * 2 * layout.kv_heads * max(positions) * layout.head_dim * element

    @classmethod
    def fits(cls, caches: list[SessionCache], positions: list[int]) -> bool:
        """Whether one layer's gathered keys and values stay within
        ``LAYER_GATHER_LIMIT``."""
        return cls.layer_bytes(caches, positions) <= LAYER_GATHER_LIMIT

    def _history(self, layer: int) -> torch.Tensor:
        """``[sessions, 2, kv_heads, longest, D]`` of ``layer`` (0-based, owned)."""
        start = layer - layer % self.chunk
        if self._chunk_start != start:
            count = min(self.chunk, self.layer_count - start)
            layout = self.caches[0].layout
            shape = (len(self.caches), count, 2, layout.kv_heads, self.longest, layout.head_dim)
            gathered = torch.zeros(shape, dtype=layout.dtype, device=layout.device)
            for row, (cache, position) in enumerate(zip(self.caches, self.positions, strict=True)):
                if position:
                    gathered[row, :, :, :, :position].copy_(
                        cache.held(position)[start : start + count]
                    )
            self._gathered, self._chunk_start = gathered, start
        return self._gathered[:, layer - start]  # type: ignore[index]

    def __call__(
        self, block: DecoderBlock, qkv: torch.Tensor, query_key: torch.Tensor
    ) -> torch.Tensor:
        rows, dim = qkv.shape[0], block.head_dim
        kv_heads = block.heads // block.groups
        new = qkv[:, block.q_width :].view(rows, 2, kv_heads, 1, dim)
        self._new.append(new)
        history = self._history(block.layer_index - self.first_layer)
        keys_values = torch.cat([history, new], dim=3)
        # The heads sharing a key/value head become that head's query rows.
        query = query_key[:, : block.heads].reshape(rows, kv_heads, block.groups, dim)
        mask = self.sliding if block.sliding else self.full
        attended = F.scaled_dot_product_attention(
            query, keys_values[:, 0], keys_values[:, 1], attn_mask=mask, scale=block.scaling
        )
        return attended.reshape(rows, block.heads * dim)

    def write_back(self) -> None:
        """Write every layer's new key and value into each session's cache."""
        new = torch.stack(self._new)  # [layers, sessions, 2, kv_heads, 1, D]
        for row, (cache, position) in enumerate(zip(self.caches, self.positions, strict=True)):
            cache.write_step(new[:, row], position)
