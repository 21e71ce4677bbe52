"""Run one layer range of an HF decoder with per-session KV caches.

``forward(session_id, pos_start, inputs)`` is the whole contract: the first stage
takes token ids, the others take hidden states; the last stage returns float32
logits, the others hidden states. Before running, the session is cropped to
``pos_start`` (the rollback rule of the mesh); positions and the causal mask come
from ``pos_start``.
"""

from __future__ import annotations

import logging
import threading
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from mesh.errors import InvalidRequest, MeshError
from mesh.runtime.batch_graphs import BatchGraphs
from mesh.runtime.block import (
    SegmentRows,
    attention_masks,
    cap_logits,
    rms_norm,
    run_block,
    run_block_segments,
)
from mesh.runtime.native_layers import native_layers
from mesh.runtime.qkernels import NativeInt4Linear, NativeInt8Linear
from mesh.runtime.rotary import RotaryAngles
from mesh.runtime.sessions import SessionCache, SessionTable, kv_layout, token_limit
from mesh.runtime.skeleton import StageModules, resolve_dtype
from mesh.runtime.spans import BatchOutput, Span
from mesh.runtime.stage_graphs import GraphSteps
from mesh.types import LayerRange, SamplingParams

logger = logging.getLogger(__name__)
NATIVE_LINEARS = (NativeInt4Linear, NativeInt8Linear)


@dataclass(frozen=True)
class RuntimeStats:
    """What a stage's sessions hold: how many, and the bytes of their KV caches and
    of the kept prefixes."""

    sessions: int = 0
    kv_bytes: int = 0
    prefix_bytes: int = 0


class _StatsLock:
    """The runtime's lock. Whoever releases it records the sessions' figures first
    (``RuntimeStats``), so that readers which must never wait for a step (heartbeats,
    metrics scrapes) read figures as of the last release."""

    def __init__(self, record: Callable[[], None]) -> None:
        self._lock = threading.Lock()
        self._record = record

    def __enter__(self) -> _StatsLock:
        self._lock.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self._record()
        finally:
            self._lock.release()


class StageRuntime(GraphSteps):
    """The owned layers of one stage (plus embed / norm / head at the ends) and its sessions."""

    def __init__(
        self,
        config: PretrainedConfig,
        modules: StageModules,
        layer_range: LayerRange,
        device: torch.device,
        dtype: str,
        max_sessions: int = 64,
        max_tokens_per_session: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._config = config
        self._modules = modules
        self._layer_range = layer_range
        self._device = device
        self._dtype_name = dtype
        self._dtype = resolve_dtype(dtype)
        self._is_first = layer_range.is_first()
        self._is_last = layer_range.is_last(config.num_hidden_layers)
        self._hidden_size = int(config.hidden_size)
        self._vocab_size = int(config.vocab_size)
        self._param_bytes = modules.param_bytes()
        self._stats = RuntimeStats()
        self._lock = _StatsLock(self._record_stats)
        self._sessions = SessionTable(
            kv_layout(config, layer_range, device, self._dtype),
            max_sessions=max_sessions,
            max_tokens_per_session=token_limit(config, max_tokens_per_session),
            clock=clock,
        )
        self._sliding_window = sliding_window(config)
        self._blocks = modules.blocks
        self._native_layers = (
            native_layers(self._blocks, self._dtype) if device.type == "cpu" else None
        )
        self._compiled: Callable[..., torch.Tensor] | None = None
        self._angles = RotaryAngles(modules.rotary, self._dtype, device, modules.rope_kinds)
        # Single-token frames through a fixed-shape step (mesh/runtime/graphs.py):
        # None (off), or whether to capture it as a CUDA graph.
        self._graph_capture: bool | None = None
        # Frames of up to 32 rows (other than one session's single token) through
        # per-bucket steps (mesh/runtime/batch_graphs.py), while graphs are on.
        self._batch_graphs: BatchGraphs | None = None
        # Frames run through those steps: "session" (one session's token), "bucket".
        self.graph_frames = {"session": 0, "bucket": 0}

    # ---- description ------------------------------------------------------------

    @property
    def config(self) -> PretrainedConfig:
        return self._config

    @property
    def layer_range(self) -> LayerRange:
        return self._layer_range

    @property
    def is_first(self) -> bool:
        return self._is_first

    @property
    def is_last(self) -> bool:
        return self._is_last

    @property
    def hidden_size(self) -> int:
        return self._hidden_size

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def param_bytes(self) -> int:
        """Bytes of parameters this stage holds (a tied embedding/head counts once)."""
        return self._param_bytes

    @property
    def device(self) -> str:
        return str(self._device)

    @property
    def dtype(self) -> str:
        return self._dtype_name

    @property
    def torch_dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def max_sessions(self) -> int:
        return self._sessions.max_sessions

    @property
    def max_tokens_per_session(self) -> int:
        return self._sessions.max_tokens_per_session

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes one token of one session takes on this stage."""
        return self._sessions.layout.bytes_per_token()

    def kv_bytes(self) -> int:
        """Bytes currently allocated to the KV caches of all sessions."""
        with self._lock:
            return self._sessions.kv_bytes()

    def stats(self) -> RuntimeStats:
        """The sessions' count and bytes as of the last time the runtime was
        released, without waiting: heartbeats and metrics read this while a step may
        hold the runtime for seconds (a long prompt chunk); a heartbeat that waited
        for it would make the coordinator take a busy stage for dead."""
        return self._stats

    def _record_stats(self) -> None:
        # Called with the lock held, by whoever releases it.
        self._stats = RuntimeStats(
            len(self._sessions.ids()),
            self._sessions.kv_bytes(),
            self._sessions.prefix_nbytes(),
        )

    # ---- sessions ---------------------------------------------------------------

    def sessions(self) -> list[str]:
        with self._lock:
            return self._sessions.ids()

    def session_length(self, session_id: str) -> int:
        """Tokens the session holds; 0 for a session this stage does not hold."""
        with self._lock:
            return self._sessions.length(session_id)

    def session_sampling(self, session_id: str) -> SamplingParams:
        """The sampling parameters the session was opened with (defaults when unknown)."""
        with self._lock:
            cache = self._sessions.get(session_id)
            return cache.sampling if cache is not None else SamplingParams()

    def record_history(
        self, session_id: str, pos_start: int, token_ids: Sequence[int]
    ) -> list[int]:
        """Keep ``token_ids`` as the session's tokens from ``pos_start`` on (what was
        there is cropped, like its KV; kept with a prefix, so that a session started
        from it can use penalties) and return the tokens before ``pos_start`` for
        sessions whose sampling uses them (``[]`` otherwise)."""
        bad = [t for t in token_ids if not 0 <= t < self._vocab_size]
        if bad:
            # The first stage checks the ids it embeds; a later one checks those it
            # keeps and verifies against.
            raise InvalidRequest(
                f"session {session_id}: token id {bad[0]} is out of range [0, {self._vocab_size})"
            )
        with self._lock:
            cache = self._sessions.get(session_id)
            if cache is None:
                return []
            history = cache.history
            if len(history) < pos_start:
                if not cache.sampling.uses_history:
                    history.clear()  # out of step: never kept wrong
                    return []
                raise InvalidRequest(
                    f"session {session_id} holds {len(history)} token ids but a segment "
                    f"starts at position {pos_start}; send its tokens from position 0"
                )
            del history[pos_start:]
            before = list(history) if cache.sampling.uses_history else []
            history.extend(int(t) for t in token_ids)
            return before

    def verdict(self, session_id: str) -> tuple[int, int] | None:
        """(position, token) of the last token emitted for the session, or None."""
        with self._lock:
            cache = self._sessions.get(session_id)
            return cache.verdict if cache is not None else None

    def set_verdict(self, session_id: str, position: int, token: int) -> None:
        with self._lock:
            cache = self._sessions.get(session_id)
            if cache is not None:
                cache.verdict = (position, token)

    def session_requests(self) -> list[tuple[str, str]]:
        """(session_id, request_id) of every session this stage holds."""
        with self._lock:
            return [(sid, self._sessions.get(sid).request_id) for sid in self._sessions.ids()]  # type: ignore[union-attr]

    def drop_session(self, session_id: str) -> bool:
        """Free the session's KV; False when the stage did not hold it."""
        with self._lock:
            return self._sessions.drop(session_id)

    def keep_prefix(self, session_id: str, length: int) -> bool:
        """End the session, keeping its first ``length`` positions for later sessions
        (``Span.prefix_from``); False when nothing was kept."""
        with self._lock:
            return self._sessions.keep_prefix(session_id, length)

    def forget_prefix(self, name: str) -> bool:
        with self._lock:
            return self._sessions.forget_prefix(name)

    def prefixes(self) -> dict[str, int]:
        """Kept prefixes: name -> positions, least recently used first."""
        with self._lock:
            return self._sessions.prefixes()

    def prefix_nbytes(self) -> int:
        with self._lock:
            return self._sessions.prefix_nbytes()

    def set_prefix_bytes(self, limit: int) -> None:
        """Bytes of kept prefixes this stage may hold (0: keep none)."""
        with self._lock:
            self._sessions.prefix_bytes = max(0, limit)

    def trim(self, session_id: str, length: int) -> None:
        """Crop the session to at most ``length`` tokens (NotFound for an unknown session)."""
        with self._lock:
            self._sessions.trim(session_id, length)

    def expire_idle(self, now: float, idle_timeout_s: float) -> list[str]:
        """Drop sessions unused for more than ``idle_timeout_s``; ``now`` is on the
        runtime's clock (``time.monotonic()`` unless another clock was given)."""
        with self._lock:
            return self._sessions.expire_idle(now, idle_timeout_s)

    # ---- compute ------------------------------------------------------------------

    def forward(self, session_id: str, pos_start: int, inputs: torch.Tensor) -> torch.Tensor:
        """Run a frame of ``T`` tokens of one session starting at absolute position
        ``pos_start``.

        ``inputs``: token ids ``[T]`` on the first stage, hidden states ``[T, hidden]``
        otherwise. Returns hidden states ``[T, hidden]`` in the runtime dtype, or on
        the last stage float32 logits ``[T, vocab]``.
        """
        with self._lock, torch.inference_mode():
            prepared = self._prepare(inputs)
            count = prepared.shape[0]
            cache = self._sessions.open_for_frame(session_id, pos_start, count)
            return self._run(cache, pos_start, prepared, count)

    def forward_batch(self, spans: Sequence[Span], inputs: torch.Tensor) -> BatchOutput:
        """Run the rows of several sessions in one pass: ``inputs`` holds the spans'
        rows in order (token ids ``[N]`` on the first stage, hidden states ``[N,
        hidden]`` otherwise). Every linear runs on all rows at once; attention runs
        per span against that session's cache. A span that cannot run (its position,
        a limit, a bad token id, a session named twice) is refused alone
        (``BatchOutput.errors``). A tensor that does not fit the spans raises."""
        with self._lock, torch.inference_mode():
            prepared = self._prepare(inputs, check_ids=False)
            total = sum(span.count for span in spans)
            if prepared.shape[0] != total:
                raise InvalidRequest(
                    f"the frame's tensor has {prepared.shape[0]} rows, its segments {total}"
                )
            # Token ids are checked where they arrived (the wire's CPU tensor): on a GPU,
            # reading a minimum off the device would wait for every queued kernel.
            finite = None
            if not self._is_first and inputs.is_floating_point() and inputs.device.type == "cpu":
                # Rows a stage before computed as NaN or Inf would run on and be
                # sampled from (garbage text, a poisoned KV): each span is checked
                # where it arrived, on the wire's CPU tensor.
                finite = torch.isfinite(inputs).all(dim=-1)
            opened, errors = self._open_spans(spans, inputs if self._is_first else None, finite)
            if not opened:
                return BatchOutput(None, {}, errors)
            # Pooled rows come from the hidden state before the head, which the
            # graphs of a step (one session's, a bucket's) keep inside them.
            pooling = self._is_last and any(span.pooling for _, span, _, _ in opened)
            single = len(opened) == 1 and (opened[0][1].count == 1 or self._batch_graphs is None)
            if single and not pooling:
                index, span, cache, row = opened[0]
                rows = prepared[row : row + span.count]
                out = self._run(cache, span.pos_start, rows, span.logits_wanted())
                return BatchOutput(out, {index: (0, out.shape[0])}, errors)
            return self._run_spans(opened, prepared, errors, graphs=not pooling)

    def _open_spans(
        self, spans: Sequence[Span], ids: torch.Tensor | None, finite: torch.Tensor | None = None
    ) -> tuple[list[tuple[int, Span, SessionCache, int]], dict[int, MeshError]]:
        """Each span's session opened for the frame (or its error); ``ids``, the
        frame's token ids on the first stage, are checked span by span, and so is
        ``finite`` (per row: the activations a later stage received are finite)."""
        opened: list[tuple[int, Span, SessionCache, int]] = []
        errors: dict[int, MeshError] = {}
        seen: set[str] = set()
        row = 0
        for index, span in enumerate(spans):
            try:
                if span.count < 1:
                    raise InvalidRequest(f"session {span.session_id}: a segment needs a token")
                if span.session_id in seen:
                    raise InvalidRequest(
                        f"session {span.session_id} has two segments in one frame; "
                        "send its next segment in a later frame"
                    )
                if ids is not None:
                    self._check_ids(ids[row : row + span.count])
                if finite is not None and not bool(finite[row : row + span.count].all()):
                    # The server's fault, not the client's: an internal error (500).
                    raise MeshError(
                        f"the activations of session {span.session_id} from the stage before "
                        "hold NaN or Inf values: that stage's compute overflowed (serve the "
                        "model in bfloat16 or float32) or its weights are damaged"
                    )
                cache = self._sessions.open_for_frame(
                    span.session_id, span.pos_start, span.count, span.creates, span.prefix_from
                )
                if span.request_id:
                    cache.request_id = span.request_id
                if span.sampling is not None:
                    cache.sampling = span.sampling
            except MeshError as error:
                errors[index] = error
            else:
                seen.add(span.session_id)
                opened.append((index, span, cache, row))
            row += span.count
        return opened, errors

    def _check_ids(self, ids: torch.Tensor) -> None:
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= self._vocab_size:
            raise InvalidRequest(
                f"token id out of range [0, {self._vocab_size}): saw {low}..{high}"
            )

    def _run_spans(
        self,
        opened: list[tuple[int, Span, SessionCache, int]],
        prepared: torch.Tensor,
        errors: dict[int, MeshError],
        graphs: bool = True,
    ) -> BatchOutput:
        modules = self._modules
        if errors:
            prepared = torch.cat([prepared[row : row + span.count] for _, span, _, row in opened])
        if self._batch_graphs is not None and graphs:
            step = self._batch_graphs.step_for(prepared.shape[0])
            if step is not None:
                out = self._run_bucket(step, opened, prepared, errors)
                if out is not None:
                    return out
        hidden = modules.embed(prepared) if self._is_first else prepared  # type: ignore[misc]
        cos, sin, parts = self._segment_rows(opened)
        hidden = self._layers(hidden, cos, sin, parts)
        for part in parts:
            part.cache.commit(part.at + part.count)
        placed: dict[int, tuple[int, int]] = {}
        if not self._is_last:
            for (index, _, _, _), part in zip(opened, parts, strict=True):
                placed[index] = (part.row, part.count)
            return BatchOutput(hidden, placed, errors)
        pieces: list[torch.Tensor] = []
        pooled: dict[int, torch.Tensor] = {}
        out_row = 0
        for (index, span, _, _), part in zip(opened, parts, strict=True):
            wanted = span.logits_wanted()
            pieces.append(hidden[part.row + part.count - wanted : part.row + part.count])
            placed[index] = (out_row, wanted)
            out_row += wanted
            if span.pooling:
                pooled[index] = self._pool(hidden[part.row : part.row + part.count], span.pooling)
        return BatchOutput(self._head(torch.cat(pieces)), placed, errors, pooled)

    def _segment_rows(
        self, opened: list[tuple[int, Span, SessionCache, int]]
    ) -> tuple[torch.Tensor, torch.Tensor, list[SegmentRows]]:
        """The rotary angles of a frame's rows and its segments' rows (masks, caches
        cropped to where each segment starts), in the frame's order."""
        angles = [self._angles(span.pos_start, span.count) for _, span, _, _ in opened]
        cos = torch.cat([c for c, _ in angles], dim=-3)
        sin = torch.cat([s for _, s in angles], dim=-3)
        window = self._sliding_window
        parts: list[SegmentRows] = []
        row = 0
        for _, span, cache, _ in opened:
            masks = attention_masks(span.pos_start, span.count, window, self._device)
            cache.begin(span.pos_start)
            parts.append(SegmentRows(cache, row, span.pos_start, span.count, masks, window))
            row += span.count
        return cos, sin, parts

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final norm and LM head over hidden rows ``[rows, hidden]`` of the last
        stage: float32 logits (the step probe times it, mesh/runtime/probe.py)."""
        with self._lock, torch.inference_mode():
            return self._head(hidden.to(device=self._device, dtype=self._dtype))

    def _pool(self, hidden: torch.Tensor, pooling: str) -> torch.Tensor:
        """One span's rows after the final norm, pooled: their sum ("mean"; the caller
        divides a whole prompt's sum by its length) or its last row ("last"), float32
        ``[hidden]``."""
        modules = self._modules
        rows = hidden[-1:] if pooling == "last" else hidden
        normed = rms_norm(
            rows,
            modules.norm,  # type: ignore[arg-type]
            modules.norm_eps,
            modules.row_invariant,
        )
        return normed.float().sum(dim=0)

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: float32 logits ``[rows, vocab]``."""
        modules = self._modules
        if hidden.shape[0] == 0:
            return torch.empty(0, self._vocab_size, device=hidden.device)
        normed = rms_norm(
            hidden,
            modules.norm,  # type: ignore[arg-type]
            modules.norm_eps,
            modules.row_invariant,
        )
        return cap_logits(modules.lm_head(normed), modules.logit_cap).float()  # type: ignore[misc]

    def _prepare(self, inputs: torch.Tensor, check_ids: bool = True) -> torch.Tensor:
        if not isinstance(inputs, torch.Tensor):
            raise InvalidRequest(f"frame inputs must be a tensor, got {type(inputs).__name__}")
        if self._is_first:
            if inputs.dim() != 1 or inputs.shape[0] == 0:
                raise InvalidRequest(
                    f"the first stage takes token ids of shape [T] with T >= 1, "
                    f"got shape {tuple(inputs.shape)}"
                )
            if inputs.is_floating_point() or inputs.is_complex() or inputs.dtype == torch.bool:
                raise InvalidRequest(f"token ids must be integers, got {inputs.dtype}")
            if check_ids:
                self._check_ids(inputs)  # where they arrived: no wait on a GPU
            return inputs.to(device=self._device, dtype=torch.long)
        if inputs.dim() != 2 or inputs.shape[0] == 0 or inputs.shape[1] != self._hidden_size:
            raise InvalidRequest(
                f"stage {self._layer_range} takes hidden states of shape "
                f"[T, {self._hidden_size}] with T >= 1, got {tuple(inputs.shape)}"
            )
        if not inputs.is_floating_point():
            raise InvalidRequest(f"hidden states must be floating point, got {inputs.dtype}")
        return inputs.to(device=self._device, dtype=self._dtype)

    def _run(
        self, cache: SessionCache, pos_start: int, prepared: torch.Tensor, logit_rows: int
    ) -> torch.Tensor:
        """One session's rows; on the last stage the logits of its last ``logit_rows``."""
        modules = self._modules
        count = prepared.shape[0]
        if count == 1 and self._graph_capture is not None:
            output = self._run_static(cache, pos_start, prepared)
            return output if not self._is_last or logit_rows else output[:0]
        hidden = modules.embed(prepared) if self._is_first else prepared  # type: ignore[misc]
        cos, sin = self._angles(pos_start, count)
        masks = attention_masks(pos_start, count, self._sliding_window, self._device)
        cache.begin(pos_start)
        step = self._compiled if count == 1 else None
        part = SegmentRows(cache, 0, pos_start, count, masks, self._sliding_window)
        try:
            hidden = self._run_layers(hidden, cos, sin, part, step)
        except Exception as error:  # noqa: BLE001 - any compiler failure falls back to eager
            if step is None:
                raise
            logger.warning("torch.compile failed (%s); running decode steps eagerly", error)
            self._compiled = None
            for block in self._blocks:
                block.pack()
            hidden = self._run_layers(hidden, cos, sin, part, None)
        cache.commit(pos_start + count)
        if not self._is_last:
            return hidden
        return self._head(hidden[count - logit_rows :])

    def enable_compile(self) -> None:
        """Run the layers of single-token frames (decode steps) through ``torch.compile``.

        One compiled ``run_block`` serves every layer (they share shapes), so the
        compiler runs once, on the first decode frame (``warm_up`` runs one). The
        layers' dense weights go back from oneDNN's packed layout to plain tensors,
        which the compiler can lower (prefill frames then use them too). Where it
        fails (no C++ compiler, an operator it cannot take, ...) the runtime logs why
        and goes on eagerly; no frame is lost to it.
        """
        native = [
            linear
            for block in self._blocks
            for linear in block.linears()
            if isinstance(linear, NATIVE_LINEARS)
        ]
        if native:
            # A compiled step would call the kernels between graphs, and torch.compile
            # then wrote stale keys into the cache (tested): decode steps stay eager.
            logger.warning(
                "--compile is not used with the stage's own quantised kernels (%d "
                "linears); decode steps run eagerly (--quantised-kernel torch compiles)",
                len(native),
            )
            return
        for block in self._blocks:
            block.unpack()
        # A copy of the function's code: the compiler keeps its compiled versions (and
        # its recompile limit) per code object, so runtimes in one process must not
        # share one.
        code = run_block.__code__.replace()
        fresh = types.FunctionType(code, run_block.__globals__, run_block.__name__)
        self._compiled = torch.compile(fresh, dynamic=True)

    def warm_up(self) -> None:
        """Run a throw-away prefill and decode step (compiling the decode path when
        compilation is on), so the first request does not pay for it."""
        session = "__warm-up__"
        if self._is_first:
            inputs = torch.zeros(2, dtype=torch.long)
        else:
            inputs = torch.zeros(2, self._hidden_size, dtype=self._dtype)
        try:
            self.forward(session, 0, inputs[:1])
            self.forward(session, 1, inputs[1:])
        finally:
            self.drop_session(session)

    @property
    def row_invariant(self) -> bool:
        """Whether every row is computed alike alone, in a window or in a batch
        (mesh/runtime/invariant.py)."""
        return self._modules.row_invariant

    @property
    def compiled(self) -> bool:
        """True while decode steps run through torch.compile."""
        return self._compiled is not None

    @property
    def native_layers(self) -> bool:
        """Whether this stage's layers run in one call of the C loop."""
        return self._native_layers is not None

    def set_native_layers(self, on: bool) -> bool:
        """Run the layers in the C loop (where they qualify) or layer by layer in
        Python (benchmarks and tests compare the two); returns ``native_layers``."""
        with self._lock:
            if on and self._native_layers is None:
                self._native_layers = native_layers(self._blocks, self._dtype)
            elif not on:
                self._native_layers = None
        return self.native_layers

    def _layers(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, parts: list[SegmentRows]
    ) -> torch.Tensor:
        """The owned layers over a frame's segments: in one call of the stage's C loop
        where the layers qualify (mesh/runtime/native_layers.py), else layer by layer."""
        fused = self._native_layers
        if fused is not None:
            out = fused.run(hidden, cos, sin, parts)
            if out is not None:
                return out.to(hidden.dtype)
        for block in self._blocks:
            hidden = run_block_segments(block, hidden, cos, sin, parts)
        return hidden

    def _run_layers(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        part: SegmentRows,
        step: Callable[..., torch.Tensor] | None,
    ) -> torch.Tensor:
        """The owned layers over one session's rows: eagerly as a one-segment batch,
        or through ``step`` (a compiled ``run_block``)."""
        if step is None:
            return self._layers(hidden, cos, sin, [part])
        full_mask, sliding_mask = part.masks
        for block in self._blocks:
            mask = sliding_mask if block.sliding else full_mask
            hidden = block.forward(hidden, cos, sin, part.cache, mask, step)
        return hidden


def sliding_window(config: PretrainedConfig) -> int | None:
    """The model's attention window, when any layer uses one."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if window is None or (layer_types and "sliding_attention" not in layer_types):
        return None
    return int(window)
