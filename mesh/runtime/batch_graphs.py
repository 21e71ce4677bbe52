"""Frames of up to 32 rows, of any sessions, replayed as CUDA graphs by row count.

A frame of a few rows (decode tokens of several sessions, verify windows, a short
prompt chunk: the frames a loaded stage runs) launches the same kernels every step,
many per layer; on a GPU the launches cost more than the arithmetic for all but the
largest models. ``DecodeGraph`` (mesh/runtime/graphs.py) replays a whole step, but
only for one session's single token: its attention reads that session's buffers at
fixed addresses. Here a frame is captured by its row count instead, padded up to a
bucket (2, 4, 8, 16, 32 rows), so any sessions and any mix of segments share one
capture.

Attention is what depends on the sessions (their caches, lengths and addresses), so
it stays out of the graphs: a step is ``layers + 1`` graphs, each piece the part of
a layer between two attentions (the output projection and MLP of one layer, then
the norm, the q/k/v linear and rotary of the next), with the frame's attention run
eagerly between them (``FrameAttention``: a few calls per layer for every session
at once) into a buffer the next piece reads. Padding rows compute alongside (every
operation in a piece works row by row) and are dropped.

Off CUDA the same pieces run eagerly, which is how the tests check the arithmetic
against the regular path.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from mesh.runtime.block import DecoderBlock, cap_logits, finish, project, rms_norm
from mesh.runtime.sessions import SessionCache

BUCKETS = (2, 4, 8, 16, 32)
# Runs of every piece on a side stream before capture (lazy CUDA initialisation of
# kernels and workspaces must not happen inside a capture).
WARM_UP_STEPS = 2
# The bytes of gathered keys and values ``FrameAttention`` aims to hold at once (it
# gathers that many layers at a time, at least one).
GATHER_BYTES = 256 << 20
# A frame whose one layer of gathered keys and values would pass this (many sessions
# at long contexts) attends per session instead (``FrameAttention.fits``).
LAYER_GATHER_LIMIT = 1 << 30
# The gathered key length is rounded up to a multiple of this (masked slots), so that
# frames of neighbouring lengths share shapes: the allocator reuses their blocks, and
# an attention backend that prepares per shape prepares far fewer.
KEY_BLOCK = 64

Attend = Callable[[DecoderBlock, torch.Tensor, torch.Tensor], torch.Tensor]
Head = tuple[torch.Tensor, float, Callable[[torch.Tensor], torch.Tensor], bool]


def key_length(keys: int) -> int:
    """``keys`` rounded up to a multiple of ``KEY_BLOCK``."""
    return -(-keys // KEY_BLOCK) * KEY_BLOCK


def bucket_for(rows: int) -> int | None:
    """The smallest bucket holding ``rows`` rows (None beyond the largest)."""
    for size in BUCKETS:
        if rows <= size:
            return size
    return None


class BucketStep:
    """The pieces of one step over a frame of up to ``rows`` rows, at fixed addresses."""

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
        rope_kinds: int = 1,
        logit_cap: float | None = None,
        rotary_width: int | None = None,
    ) -> None:
        self.blocks = blocks
        self.logit_cap = logit_cap
        self.rows = rows
        self.embed = embed
        self.head = head
        head_dim = blocks[0].head_dim
        if embed is not None:
            self.inputs = torch.zeros(rows, dtype=torch.long, device=device)
        else:
            self.inputs = torch.zeros(rows, hidden_size, dtype=dtype, device=device)
        # Each row's angles in every rotary table (mesh/runtime/rotary.py).
        width = head_dim if rotary_width is None else rotary_width
        angles = (rows, 1, width) if rope_kinds == 1 else (rope_kinds, rows, 1, width)
        self.cos = torch.zeros(angles, dtype=dtype, device=device)
        self.sin = torch.zeros(angles, dtype=dtype, device=device)
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
            hidden = lm_head(rms_norm(hidden, norm, eps, native))
            hidden = cap_logits(hidden, self.logit_cap).float()
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
        self.cos.narrow(-3, 0, count).copy_(cos)
        self.sin.narrow(-3, 0, count).copy_(sin)
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


class BatchGraphs:
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


class FrameAttention:
    """Attention of a whole frame's segments (each a session's rows at its own
    positions: a decode token, a verify window, a short prompt chunk) in a few calls
    per layer whatever the number of sessions (the regular path calls SDPA once per
    session and layer, which costs more than a step's graphs on a GPU).

    The sessions' keys and values before this frame are gathered once into one
    zero-padded tensor ``[sessions, layers, 2, kv_heads, length, D]`` (``length``: the
    longest history plus the widest segment, rounded up to ``KEY_BLOCK``; in chunks of
    layers within ``budget_bytes``, default ``GATHER_BYTES``). Each layer
    lays the frame's rows out as ``[sessions, widest segment]`` (padding slots zero),
    writes each segment's new keys and values right after its own session's history
    (its positions ``at ..``, as the session's own cache holds them), and attends under
    one mask that keeps each row to its session's positions up to its own and the
    window of sliding layers. Every session's keys thus sit where its own cache holds
    them, followed only by masked slots, as in the one-session step
    (mesh/runtime/graphs.py), whatever else the frame holds. The frame's keys and
    values are written into the sessions' caches once, after the last layer
    (``write_back``)."""

    def __init__(
        self,
        segments: list[tuple[SessionCache, int, int]],
        window: int | None,
        budget_bytes: int | None = None,
    ) -> None:
        caches = [cache for cache, _, _ in segments]
        layout = caches[0].layout
        self.caches = caches
        self.positions = [at for _, at, _ in segments]
        self.counts = [count for _, _, count in segments]
        self.first_layer = layout.first_layer
        self.layer_count = layout.layer_count
        self.longest = max(self.positions)
        self.width = max(self.counts)
        self.length = key_length(self.longest + self.width)
        self.rows = sum(self.counts)
        device = layout.device
        per_layer = self.layer_bytes(segments)
        budget = GATHER_BYTES if budget_bytes is None else budget_bytes
        self.chunk = max(1, min(self.layer_count, budget // max(per_layer, 1)))
        self._gathered: torch.Tensor | None = None
        self._chunk_start = -1
        sessions, width = len(segments), self.width
        # Where each row sits in the [sessions * width] layout, and which row (or the
        # zero row, ``rows``) fills each slot of it.
        slots = [b * width + c for b, count in enumerate(self.counts) for c in range(count)]
        self._slots = torch.tensor(slots, device=device)
        source = torch.full((sessions * width,), self.rows, dtype=torch.long)
        source[slots] = torch.arange(self.rows)
        self._source = source.to(device)
        # Where each row's keys and values go in the gathered tensor: its session, and
        # the row's own position.
        self._row_session = torch.tensor(
            [b for b, count in enumerate(self.counts) for _ in range(count)], device=device
        )
        self._row_position = torch.tensor(
            [at + c for at, count in zip(self.positions, self.counts, strict=True)
             for c in range(count)],
            device=device,
        )  # fmt: skip
        self.full, self.sliding = self._masks(window, layout.device)
        self._new: list[torch.Tensor] = []

    def _masks(self, window: int | None, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``[sessions, 1, width, length]`` boolean masks (True = attend) of
        full and sliding layers. A padding slot attends as its segment's last row (so
        no row of the mask is empty; its output is dropped)."""
        at = torch.tensor(self.positions, device=device).view(-1, 1, 1)
        count = torch.tensor(self.counts, device=device).view(-1, 1, 1)
        row = torch.arange(self.width, device=device).view(1, -1, 1)
        query = at + torch.minimum(row, count - 1)
        keys = torch.arange(self.length, device=device).view(1, 1, -1)
        full = keys <= query
        sliding = full
        if window is not None:
            sliding = full & (query - keys < window)
        return full.unsqueeze(1), sliding.unsqueeze(1)

    @staticmethod
    def layer_bytes(segments: list[tuple[SessionCache, int, int]]) -> int:
        """Bytes of one layer's gathered keys and values for these segments."""
        layout = segments[0][0].layout
        element = torch.empty((), dtype=layout.dtype).element_size()
        length = key_length(max(at for _, at, _ in segments) + max(c for _, _, c in segments))
        return len(segments) * 2 * layout.kv_heads * length * layout.head_dim * element

    @classmethod
    def fits(cls, segments: list[tuple[SessionCache, int, int]]) -> bool:
        """Whether one layer's gathered keys and values stay within
        ``LAYER_GATHER_LIMIT``."""
        return cls.layer_bytes(segments) <= LAYER_GATHER_LIMIT

    def _history(self, layer: int) -> torch.Tensor:
        """``[sessions, 2, kv_heads, length, D]`` of ``layer`` (0-based, owned): each
        session's history, zeros after it."""
        start = layer - layer % self.chunk
        if self._chunk_start != start:
            count = min(self.chunk, self.layer_count - start)
            layout = self.caches[0].layout
            shape = (len(self.caches), count, 2, layout.kv_heads, self.length, layout.head_dim)
            gathered = torch.zeros(shape, dtype=layout.dtype, device=layout.device)
            for row, (cache, position) in enumerate(zip(self.caches, self.positions, strict=True)):
                if position:
                    gathered[row, :, :, :, :position].copy_(
                        cache.held(position)[start : start + count]
                    )
            self._gathered, self._chunk_start = gathered, start
        return self._gathered[:, layer - start]  # type: ignore[index]

    def _laid_out(self, rows: torch.Tensor) -> torch.Tensor:
        """``[rows, ...]`` as ``[sessions * width, ...]`` (padding slots zero)."""
        if self.width == 1:
            return rows
        padded = torch.cat([rows, rows.new_zeros((1, *rows.shape[1:]))])
        return padded.index_select(0, self._source)

    def __call__(
        self, block: DecoderBlock, qkv: torch.Tensor, query_key: torch.Tensor
    ) -> torch.Tensor:
        sessions, width, dim = len(self.caches), self.width, block.head_dim
        kv_heads, groups = block.heads // block.groups, block.groups
        new = qkv[:, block.q_width :]
        self._new.append(new)
        keys_values = self._history(block.layer_index - self.first_layer)
        keys_values[self._row_session, :, :, self._row_position] = new.view(-1, 2, kv_heads, dim)
        # The heads sharing a key/value head become that head's query rows:
        # [sessions, kv_heads, groups * width, D], rows ordered (group, position).
        query = self._laid_out(query_key[:, : block.heads])
        query = query.view(sessions, width, kv_heads, groups, dim).permute(0, 2, 3, 1, 4)
        query = query.reshape(sessions, kv_heads, groups * width, dim)
        mask = self.sliding if block.sliding else self.full
        if groups > 1 and width > 1:
            mask = mask.unsqueeze(2).expand(sessions, 1, groups, width, -1).flatten(2, 3)
        attended = F.scaled_dot_product_attention(
            query, keys_values[:, 0], keys_values[:, 1], attn_mask=mask, scale=block.scaling
        )
        attended = attended.view(sessions, kv_heads, groups, width, dim).permute(0, 3, 1, 2, 4)
        attended = attended.reshape(sessions * width, block.heads * dim)
        return attended if width == 1 else attended.index_select(0, self._slots)

    def write_back(self) -> None:
        """Write every layer's new keys and values into each session's cache."""
        new = torch.stack(self._new)  # [layers, rows, 2 * kv_heads * D]
        layout = self.caches[0].layout
        row = 0
        for cache, position, count in zip(self.caches, self.positions, self.counts, strict=True):
            rows = new[:, row : row + count].view(
                self.layer_count, count, 2, layout.kv_heads, layout.head_dim
            )
            cache.write_rows(rows.permute(0, 2, 3, 1, 4), position)
            row += count
