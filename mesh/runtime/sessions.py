"""Per-session KV caches for a stage's owned layers, addressed by absolute position.

Each session owns one preallocated tensor holding keys and values of every owned
layer; it grows by doubling when a frame needs more room. Cropping is only a change
of the committed length: later frames overwrite the positions past it. A decoder
block takes a layer's whole buffers (``layer``) and writes the frame's keys and values
at ``write_at`` (mesh/runtime/block.py).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from mesh.errors import CapacityExceeded, InvalidRequest, NotFound, PrefixMissing, out_of_memory
from mesh.runtime.invariant import KEY_BLOCK
from mesh.types import DEFAULT_PREFIX_BYTES, LayerRange, SamplingParams

logger = logging.getLogger(__name__)

CAPACITY_STEP_TOKENS = 256


@dataclass(frozen=True)
class KVLayout:
    """Shape of one session's cache: owned layers ``[first_layer, first_layer + layer_count)``."""

    first_layer: int
    layer_count: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device

    def bytes_per_token(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.layer_count * self.kv_heads * self.head_dim * element


def buffer_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes of a tensor of ``shape`` and ``dtype``."""
    count = 1
    for size in shape:
        count *= size
    return count * torch.empty((), dtype=dtype).element_size()


class SessionCache:
    """Keys and values of one session: per layer ``[2, 1, kv_heads, capacity, head_dim]``,
    with what else the stage keeps of the session: the request it serves, its
    sampling parameters (the last stage samples with them), the token ids it has
    read when its sampling depends on them (penalties), and its last use."""

    __slots__ = (
        "request_id",
        "sampling",
        "history",
        "verdict",
        "layout",
        "length",
        "capacity",
        "last_used",
        "_buffer",
        "_layers",
        "_at",
        "decode_graph",
    )

    def __init__(self, layout: KVLayout, capacity: int, now: float) -> None:
        self.request_id = ""
        self.sampling = SamplingParams()
        self.history: list[int] = []
        # (position, token) of the last token the last stage emitted for the
        # session: where its next window must start (windows drafted ahead).
        self.verdict: tuple[int, int] | None = None
        self.layout = layout
        self.length = 0
        self.capacity = 0
        self.last_used = now
        self._buffer: torch.Tensor | None = None
        self._layers: list[torch.Tensor] = []
        # The session's captured decode step (mesh/runtime/graphs.py), if any.
        self.decode_graph: object | None = None
        self._at = 0
        self.reserve(capacity)

    def reserve(self, tokens: int) -> None:
        """Make room for ``tokens`` positions, keeping the committed ones."""
        if tokens <= self.capacity:
            return
        layout = self.layout
        shape = (layout.layer_count, 2, 1, layout.kv_heads, tokens, layout.head_dim)
        # Zero-filled: a fixed-shape decode step attends over the whole buffer under a
        # mask, and masked positions must hold finite numbers.
        try:
            buffer = torch.zeros(shape, dtype=layout.dtype, device=layout.device)
        except (RuntimeError, MemoryError) as error:
            if not out_of_memory(error):
                raise
            need = buffer_bytes(shape, layout.dtype)
            raise CapacityExceeded(
                f"this stage is out of memory for {tokens} positions of KV "
                f"({need / 2**20:.0f} MiB on {layout.device}); retry later, shorten the "
                "prompt, or hold KV for fewer sessions or positions (--kv-max-sessions, "
                "--max-tokens-per-session)"
            ) from None
        if self._buffer is not None and self.length:
            buffer[..., : self.length, :] = self._buffer[..., : self.length, :]
        self._buffer = buffer
        self._layers = [buffer[i] for i in range(layout.layer_count)]
        self.capacity = tokens

    def begin(self, pos_start: int) -> None:
        """Crop to ``pos_start`` and write the next frame's keys and values from there."""
        self.length = min(self.length, pos_start)
        self._at = pos_start

    def commit(self, end: int) -> None:
        self.length = end

    @property
    def write_at(self) -> int:
        """Where the current frame's keys and values go."""
        return self._at

    def layer(self, layer_idx: int) -> torch.Tensor:
        """A layer's whole buffer ``[2, 1, kv_heads, capacity, D]``: keys, then values
        (each shaped for SDPA)."""
        return self._layers[layer_idx - self.layout.first_layer]

    def nbytes(self) -> int:
        return 0 if self._buffer is None else self._buffer.nbytes

    def held(self, end: int) -> torch.Tensor:
        """Keys and values of positions ``0 .. end`` of every owned layer: a view
        ``[layers, 2, kv_heads, end, D]``."""
        return self._buffer[:, :, 0, :, :end]  # type: ignore[index]

    def write_rows(self, rows: torch.Tensor, at: int) -> None:
        """Write keys and values of every owned layer for positions ``at ..``
        (``[layers, 2, kv_heads, count, D]``)."""
        self._buffer[:, :, 0, :, at : at + rows.shape[3]].copy_(rows)  # type: ignore[index]

    def copy_prefix(self, source: SessionCache, length: int) -> None:
        """Start from the first ``length`` positions of ``source`` (keys, values and
        the token ids kept with them)."""
        self.reserve(length)
        if length:
            self._buffer[..., :length, :] = source._buffer[..., :length, :]  # type: ignore[index]
        self.length = length
        self.history = source.history[:length]

    def shrink(self) -> None:
        """Give back the room past the committed positions (a kept prefix grows no
        more)."""
        if self._buffer is None or self.capacity <= self.length:
            return
        buffer = self._buffer[..., : self.length, :].clone()
        self._buffer = buffer
        self._layers = [buffer[i] for i in range(self.layout.layer_count)]
        self.capacity = self.length
        self.decode_graph = None


class SessionTable:
    """The sessions of one stage, with their limits, and the prefixes it keeps for
    later sessions (the prefix cache; at most ``prefix_bytes``, least recently used
    ones dropped first). ``clock`` gives the time used for idle expiry
    (``time.monotonic`` unless a test supplies its own)."""

    def __init__(
        self,
        layout: KVLayout,
        max_sessions: int,
        max_tokens_per_session: int,
        clock: Callable[[], float] = time.monotonic,
        prefix_bytes: int = DEFAULT_PREFIX_BYTES,
    ) -> None:
        if max_sessions <= 0:
            raise InvalidRequest(f"max_sessions must be positive, got {max_sessions}")
        if max_tokens_per_session <= 0:
            raise InvalidRequest(
                f"max_tokens_per_session must be positive, got {max_tokens_per_session}"
            )
        self.layout = layout
        self.max_sessions = max_sessions
        self.max_tokens_per_session = max_tokens_per_session
        self._clock = clock
        self._sessions: dict[str, SessionCache] = {}
        self.prefix_bytes = max(0, prefix_bytes)
        self._prefixes: OrderedDict[str, SessionCache] = OrderedDict()

    def open_for_frame(
        self,
        session_id: str,
        pos_start: int,
        count: int,
        creates: bool = True,
        prefix_from: str = "",
    ) -> SessionCache:
        """The session's cache, ready for a frame of ``count`` tokens at ``pos_start``.

        Creates the session when it is new (refused with NotFound unless
        ``creates``): empty, or holding a copy of the first ``pos_start`` positions of
        the kept prefix ``prefix_from`` (PrefixMissing when this stage does not hold
        it); grows its buffer; checks every limit before changing anything. The
        caller crops it to ``pos_start`` through ``SessionCache.begin``.
        """
        cache = self._sessions.get(session_id)
        if cache is None and not creates:
            raise NotFound(
                f"this stage holds no session {session_id!r}; start it with a PREFILL "
                "segment at position 0"
            )
        source = None
        if cache is None and prefix_from:
            # A kept prefix, or a live session (the first choice of a request with
            # n > 1, whose prompt this session shares).
            source = self._prefixes.get(prefix_from) or self._sessions.get(prefix_from)
            if source is None or source.length < pos_start:
                raise PrefixMissing(
                    f"this stage does not hold {pos_start} positions of prefix "
                    f"{prefix_from!r}; send the prompt of session {session_id} from position 0"
                )
        held = cache.length if cache is not None else 0
        if source is not None:
            held = pos_start
        if pos_start < 0:
            raise InvalidRequest(f"frame for session {session_id} starts at {pos_start} (< 0)")
        if pos_start > held:
            raise InvalidRequest(
                f"session {session_id} holds {held} tokens, frame starts at {pos_start}; "
                f"resend the frame from position {held} or earlier"
            )
        end = pos_start + count
        if end > self.max_tokens_per_session:
            raise InvalidRequest(
                f"session {session_id} would hold {end} tokens, over this stage's limit of "
                f"{self.max_tokens_per_session} tokens per session; "
                "shorten the prompt or max_tokens"
            )
        if cache is None:
            if len(self._sessions) >= self.max_sessions:
                raise CapacityExceeded(
                    f"stage holds {len(self._sessions)} sessions, its limit; retry later "
                    "or end idle sessions"
                )
            cache = self._allocated(
                end,
                self._capacity_for(end, 0),
                lambda capacity: SessionCache(self.layout, capacity, self._clock()),
                session_id,
                source,
            )
            if source is not None:
                cache.copy_prefix(source, pos_start)
                source.last_used = cache.last_used
                if prefix_from in self._prefixes:
                    self._prefixes.move_to_end(prefix_from)
            self._sessions[session_id] = cache
        else:
            grown = cache
            self._allocated(
                end,
                self._capacity_for(end, cache.capacity),
                lambda capacity: grown.reserve(capacity) or grown,
                session_id,
                source,
            )
        cache.last_used = self._clock()
        return cache

    def _allocated(
        self,
        tokens: int,
        capacity: int,
        allocate: Callable[[int], SessionCache],
        session_id: str,
        source: SessionCache | None,
    ) -> SessionCache:
        """``allocate(capacity)``; out of memory, again with the least capacity that
        holds ``tokens`` after the kept prefixes (but ``source``) are dropped. When
        that fails too and no other session holds KV here, the session can never
        fit this stage: InvalidRequest (not a CapacityExceeded to retry later)."""
        try:
            return allocate(capacity)
        except CapacityExceeded as first:
            failure = first
            dropped = [n for n, c in self._prefixes.items() if c is not source]
            for name in dropped:
                del self._prefixes[name]
            least = self._capacity_for(tokens, 0)
            if dropped or least < capacity:
                logger.warning(
                    "out of memory for %d positions of session %s: dropped %d kept "
                    "prefixes, trying %d positions",
                    capacity,
                    session_id,
                    len(dropped),
                    least,
                )
                try:
                    return allocate(min(least, capacity))
                except CapacityExceeded as again:
                    failure = again
            others = [c for n, c in self._sessions.items() if n != session_id and c.capacity]
            if others or source is not None:
                raise failure from None
            layout = self.layout
            shape = (layout.layer_count, 2, 1, layout.kv_heads, least, layout.head_dim)
            need = buffer_bytes(shape, layout.dtype)
            raise InvalidRequest(
                f"this stage cannot hold KV for {tokens} positions ({need / 2**20:.0f} MiB "
                f"on {layout.device}) even with no other session and its prefix cache "
                "empty; shorten the prompt or max_tokens, or serve on stages with more "
                "memory"
            ) from None

    def _capacity_for(self, tokens: int, current: int) -> int:
        if tokens <= current:
            return current
        wanted = max(tokens, 2 * current)
        rounded = -(-wanted // CAPACITY_STEP_TOKENS) * CAPACITY_STEP_TOKENS
        # Whole key blocks up to the limit: row-invariant attention reads a query's
        # keys up to its position rounded up to a block (mesh/runtime/invariant.py).
        limit = -(-self.max_tokens_per_session // KEY_BLOCK) * KEY_BLOCK
        return max(tokens, min(rounded, limit))

    def drop(self, session_id: str) -> bool:
        return self._sessions.pop(session_id, None) is not None

    # ---- kept prefixes -------------------------------------------------------------

    def keep_prefix(self, session_id: str, length: int) -> bool:
        """End the session, keeping its first ``length`` positions as the prefix named
        ``session_id`` (False, and the session simply ended, when it is not held or
        nothing can be kept)."""
        cache = self._sessions.pop(session_id, None)
        if cache is None:
            return False
        length = min(cache.length, length)
        if length <= 0 or self.prefix_bytes <= 0:
            return False
        cache.length = length
        cache.shrink()
        cache.last_used = self._clock()
        self._prefixes[session_id] = cache
        self._prefixes.move_to_end(session_id)
        self._evict_prefixes()
        return session_id in self._prefixes

    def forget_prefix(self, name: str) -> bool:
        return self._prefixes.pop(name, None) is not None

    def prefixes(self) -> dict[str, int]:
        """The kept prefixes: name -> positions held, least recently used first."""
        return {name: cache.length for name, cache in self._prefixes.items()}

    def prefix_nbytes(self) -> int:
        return sum(cache.nbytes() for cache in self._prefixes.values())

    def _evict_prefixes(self) -> None:
        held = self.prefix_nbytes()
        while self._prefixes and held > self.prefix_bytes:
            name, cache = self._prefixes.popitem(last=False)
            held -= cache.nbytes()
            logger.debug("dropped kept prefix %s (%s positions)", name, cache.length)

    def length(self, session_id: str) -> int:
        cache = self._sessions.get(session_id)
        return 0 if cache is None else cache.length

    def ids(self) -> list[str]:
        return list(self._sessions)

    def get(self, session_id: str) -> SessionCache | None:
        return self._sessions.get(session_id)

    def caches(self) -> list[SessionCache]:
        return list(self._sessions.values())

    def trim(self, session_id: str, length: int) -> None:
        if length < 0:
            raise InvalidRequest(f"cannot trim session {session_id} to {length} tokens (< 0)")
        cache = self._sessions.get(session_id)
        if cache is None:
            raise NotFound(f"session {session_id} is not held by this stage")
        cache.length = min(cache.length, length)
        cache.last_used = self._clock()

    def expire_idle(self, now: float, idle_timeout_s: float) -> list[str]:
        expired = [
            session_id
            for session_id, cache in self._sessions.items()
            if now - cache.last_used > idle_timeout_s
        ]
        for session_id in expired:
            del self._sessions[session_id]
        if expired:
            logger.info("expired %s idle session(s): %s", len(expired), ", ".join(expired))
        for name, cache in list(self._prefixes.items()):
            if now - cache.last_used > idle_timeout_s:
                del self._prefixes[name]
        return expired

    def kv_bytes(self) -> int:
        return sum(cache.nbytes() for cache in self._sessions.values())


def kv_layout(
    config: PretrainedConfig, layer_range: LayerRange, device: torch.device, dtype: torch.dtype
) -> KVLayout:
    """The cache shape of ``layer_range`` of the model ``config`` describes."""
    heads = int(config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return KVLayout(
        first_layer=layer_range.start,
        layer_count=len(layer_range),
        kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
        head_dim=int(head_dim),
        dtype=dtype,
        device=device,
    )


def token_limit(config: PretrainedConfig, max_tokens_per_session: int | None) -> int:
    """Tokens a session may hold: the requested limit, at most the model's context."""
    context = int(config.max_position_embeddings)
    if max_tokens_per_session is None:
        return context
    if max_tokens_per_session > context:
        logger.warning(
            "max_tokens_per_session %s exceeds the model context %s; using %s",
            max_tokens_per_session,
            context,
            context,
        )
        return context
    return max_tokens_per_session
