"""The CUDA-graph side of a stage runtime: single-token frames through a session's
fixed-shape step (mesh/runtime/graphs.py), other frames of up to 32 rows through
their bucket's step (mesh/runtime/batch_graphs.py), turning them on, checking them
against eager steps and turning them off.

``GraphSteps`` is a part of ``StageRuntime`` (mesh/runtime/stage.py), kept apart
for size; it uses the runtime's modules, sessions and lock.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from mesh.errors import MeshError
from mesh.runtime.batch_graphs import BatchGraphs, BucketStep, FrameAttention
from mesh.runtime.block import DecoderBlock, attend_segments
from mesh.runtime.graphs import DecodeGraph, StaticDecode
from mesh.runtime.rotary import RotaryAngles
from mesh.runtime.sessions import SessionCache, SessionTable
from mesh.runtime.skeleton import StageModules
from mesh.runtime.spans import BatchOutput, Span

logger = logging.getLogger(__name__)


class GraphSteps:
    """Graph-replayed steps of a ``StageRuntime`` (whose ``forward``,
    ``forward_batch``, ``drop_session``, ``_run`` and ``_segment_rows`` they call)."""

    # Set by StageRuntime.__init__.
    _modules: StageModules
    _blocks: list[DecoderBlock]
    _sessions: SessionTable
    _angles: RotaryAngles
    _lock: Any
    _device: torch.device
    _dtype: torch.dtype
    _is_first: bool
    _is_last: bool
    _hidden_size: int
    _vocab_size: int
    _sliding_window: int | None
    # Single-token frames through a fixed-shape step: None (off), or whether to
    # capture it as a CUDA graph.
    _graph_capture: bool | None
    # Frames of up to 32 rows (other than one session's single token) through
    # per-bucket steps, while graphs are on.
    _batch_graphs: BatchGraphs | None
    graph_frames: dict[str, int]

    def _run_bucket(
        self,
        step: BucketStep,
        opened: list[tuple[int, Span, SessionCache, int]],
        prepared: torch.Tensor,
        errors: dict[int, MeshError],
    ) -> BatchOutput | None:
        """A frame of at most ``step.rows`` rows through its bucket's step; None when
        the step could not be captured (graphs are then off and the caller runs the
        frame eagerly; no cache was written)."""
        cos, sin, parts = self._segment_rows(opened)
        batched = None
        segments = [(part.cache, part.at, part.count) for part in parts]
        capped = any(block.softcap is not None for block in self._blocks)
        if not self._modules.row_invariant and not capped and FrameAttention.fits(segments):
            batched = FrameAttention(segments, self._sliding_window)

        def attend(block: DecoderBlock, qkv: torch.Tensor, query_key: torch.Tensor) -> torch.Tensor:
            if batched is not None:
                return batched(block, qkv, query_key)
            return attend_segments(block, qkv, query_key, parts)

        try:
            out = step(prepared, cos, sin, attend)
        except Exception as error:  # noqa: BLE001 - a step that cannot be captured runs eagerly
            if not self._graph_capture or step.captured:
                raise
            logger.warning(
                "CUDA graph capture of %d-row frames failed (%s); running frames eagerly",
                step.rows,
                error,
            )
            self._drop_graphs()
            return None
        if batched is not None:
            batched.write_back()
        self.graph_frames["bucket"] += 1
        placed: dict[int, tuple[int, int]] = {}
        kept: list[int] = []
        for (index, span, _, _), part in zip(opened, parts, strict=True):
            part.cache.commit(part.at + part.count)
            wanted = span.logits_wanted() if self._is_last else part.count
            placed[index] = (len(kept), wanted)
            kept.extend(range(part.row + part.count - wanted, part.row + part.count))
        if len(kept) < out.shape[0]:
            out = out[kept]
        return BatchOutput(out, placed, errors)

    def _run_static(
        self, cache: SessionCache, pos_start: int, prepared: torch.Tensor
    ) -> torch.Tensor:
        graph = cache.decode_graph
        if not isinstance(graph, DecodeGraph) or graph.capacity != cache.capacity:
            graph = DecodeGraph(self._static_step(cache), capture=bool(self._graph_capture))
            cache.decode_graph = graph
        cos, sin = self._angles(pos_start, 1)
        cache.begin(pos_start)
        try:
            output = graph(prepared, pos_start, cos, sin)
        except Exception as error:  # noqa: BLE001 - a step that cannot be captured runs eagerly
            if not self._graph_capture:
                raise
            logger.warning("CUDA graph capture failed (%s); running decode steps eagerly", error)
            self._drop_graphs()
            return self._run(cache, pos_start, prepared, 1)
        cache.commit(pos_start + 1)
        self.graph_frames["session"] += 1
        return output

    def _static_step(self, cache: SessionCache) -> StaticDecode:
        modules = self._modules
        head = None
        if self._is_last:
            head = (modules.norm, modules.norm_eps, modules.lm_head)
        return StaticDecode(
            self._blocks,
            [cache.layer(block.layer_index) for block in self._blocks],
            embed=modules.embed if self._is_first else None,
            head=head,  # type: ignore[arg-type]
            hidden_size=self._hidden_size,
            rotary_width=self._angles.width,
            window=self._sliding_window,
            dtype=self._dtype,
            device=self._device,
            rope_kinds=self._angles.kinds,
            logit_cap=modules.logit_cap,
        )

    def enable_cuda_graphs(self) -> bool:
        """Replay single-token frames (decode steps) as CUDA graphs, one captured per
        session and KV buffer size (mesh/runtime/graphs.py), and other frames of up
        to 32 rows by bucket (mesh/runtime/batch_graphs.py). Only on a CUDA device:
        elsewhere it logs why and returns False. A step that cannot be captured, or
        whose replay disagrees with the eager step at warm-up, turns graphs off again
        with a logged reason."""
        if self._device.type != "cuda":
            logger.warning(
                "CUDA graphs need a CUDA device; %s runs decode steps eagerly", self._device
            )
            return False
        self.use_static_decode(capture=True)
        return True

    def use_static_decode(self, capture: bool) -> None:
        """Run single-token frames through the fixed-shape step, and other frames of up
        to 32 rows through the step of their bucket, captured as CUDA graphs when
        ``capture`` (CUDA only), else run as they are (any device; the tests use it
        to check the steps' arithmetic)."""
        if capture and self._device.type != "cuda":
            raise ValueError("capturing a CUDA graph needs a CUDA device")
        self._graph_capture = capture
        if any(block.experts is not None for block in self._blocks):
            # Routing picks experts by the data (shapes that change every step).
            logger.info("frames other than single tokens run eagerly (sparse experts)")
            return
        self._batch_graphs = BatchGraphs(self._bucket_step)

    def _bucket_step(self, rows: int) -> BucketStep:
        modules = self._modules
        head = None
        if self._is_last:
            head = (modules.norm, modules.norm_eps, modules.lm_head, modules.row_invariant)
        return BucketStep(
            self._blocks,
            rows,
            embed=modules.embed if self._is_first else None,
            head=head,  # type: ignore[arg-type]
            hidden_size=self._hidden_size,
            dtype=self._dtype,
            device=self._device,
            capture=bool(self._graph_capture),
            rope_kinds=self._angles.kinds,
            logit_cap=modules.logit_cap,
            rotary_width=self._angles.width,
        )

    def disable_graphs(self) -> None:
        """Back to the regular decode path; drops every captured step."""
        with self._lock:
            self._drop_graphs()

    def _drop_graphs(self) -> None:
        self._graph_capture = None
        self._batch_graphs = None
        for cache in self._sessions.caches():
            cache.decode_graph = None

    def check_graphs(self, tolerance: float = 1e-2) -> bool:
        """Decode throw-away steps, one session's and a frame of two sessions' rows (or
        of one session's two, when the stage may hold one session), both replayed and
        eagerly; when they disagree by more than ``tolerance`` of
        the eager output's magnitude, or a step could not be captured, log it and turn
        graphs off. Returns whether graphs stay on."""
        first, second = "__graph-check__", "__graph-check-2__"
        generator = torch.Generator().manual_seed(0)
        if self._is_first:
            inputs = torch.randint(0, self._vocab_size, (4,), generator=generator)
        else:
            inputs = torch.randn(4, self._hidden_size, generator=generator).to(self._dtype)
        # A frame of two sessions' tokens, or of one session's two (a stage that may
        # hold one session).
        two = self._sessions.max_sessions >= 2
        batch = [Span(first, 2, 1), Span(second, 1, 1)] if two else [Span(first, 2, 2)]

        def steps() -> torch.Tensor:
            single = self.forward(first, 1, inputs[1:2])
            both = self.forward_batch(batch, inputs[2:4])
            return torch.cat([single.float(), both.rows.float()])  # type: ignore[union-attr]

        try:
            self.forward(first, 0, inputs[:1])
            if two:
                self.forward(second, 0, inputs[:1])
            replayed = steps()
            capture, batch_graphs = self._graph_capture, self._batch_graphs
            if capture is None:
                return False  # a capture failed and said why
            self._graph_capture, self._batch_graphs = None, None
            try:
                eager = steps()
            finally:
                self._graph_capture, self._batch_graphs = capture, batch_graphs
        finally:
            self.drop_session(first)
            self.drop_session(second)
        difference = (replayed - eager).abs().max().item()
        scale = max(eager.abs().max().item(), 1.0)
        if not difference <= tolerance * scale:
            logger.warning(
                "a CUDA graph replay differs from the eager step by %.3g (scale %.3g); "
                "running decode steps eagerly",
                difference,
                scale,
            )
            self.disable_graphs()
            return False
        logger.info("decode steps replay as CUDA graphs (checked: max difference %.3g)", difference)
        return True

    @property
    def cuda_graphs(self) -> bool:
        """True while decode steps replay as CUDA graphs."""
        return bool(self._graph_capture)
