"""Data-plane values: frames of segments, their results, timings and errors.

Plain frozen dataclasses, free of protobuf: the stage engine, the runtime and stage
0's engine core work with these; only ``mesh.codec`` (and the servicers and links
that call it) turns them into messages.

A frame is one step's work for one stage: one segment per session in the step and
one activation tensor holding every segment's rows in segment order
(``[sum of token counts, hidden]``). The last stage answers one ``FrameResult`` with
one ``SegmentResult`` per segment that asked for tokens.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass, fields

import torch

from mesh.errors import MeshError, from_code, grpc_code_name
from mesh.types import SamplingParams


class SegmentKind(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    VERIFY = "verify"
    END = "end"

    @property
    def computes(self) -> bool:
        """True for kinds that run tokens through the layers (and carry activations)."""
        return self is not SegmentKind.END


class Pooling(enum.Enum):
    """How the last stage pools a PREFILL segment's rows of the final-normed hidden
    state (embeddings): not at all, their sum (stage 0 divides a prompt's sum by its
    length: the mean), or the segment's last row."""

    NONE = "none"
    MEAN = "mean"
    LAST = "last"


@dataclass(frozen=True)
class StageTiming:
    """Time one stage spent on a frame (sent as float32 milliseconds)."""

    stage_index: int
    compute_ms: float
    queue_ms: float = 0.0


@dataclass(frozen=True)
class ErrorInfo:
    """A per-segment error: a gRPC status code name, a message, the failing stage."""

    code: str
    message: str
    stage_index: int = 0

    @classmethod
    def from_exception(cls, error: BaseException, stage_index: int = 0) -> ErrorInfo:
        if isinstance(error, MeshError):
            message = error.message
        else:
            message = f"{type(error).__name__}: {error}"
        return cls(grpc_code_name(error), message, stage_index)

    def to_error(self) -> MeshError:
        """The typed mesh error for this code (Fatal for codes without a class)."""
        return from_code(self.code, self.message)


@dataclass(frozen=True)
class Segment:
    """One session's part of a frame: ``token_ids`` sit at positions
    ``[pos_start, pos_start + len)``. ``sample`` is honoured on PREFILL segments:
    False means a prompt chunk after which the last stage samples nothing."""

    request_id: str
    session_id: str
    kind: SegmentKind
    pos_start: int
    token_ids: tuple[int, ...] = ()
    sampling: SamplingParams | None = None
    sample: bool = True
    epoch: int = 0
    # Prefix cache (docs/protocol.md): the kept prefix a new session starts from
    # (PREFILL), keep the session's first pos_start positions as a prefix (END),
    # drop the kept prefix named session_id (END).
    prefix_from: str = ""
    keep_prefix: bool = False
    forget_prefix: bool = False
    # A verify window drafted ahead (docs/protocol.md): its first token guesses the
    # last token the session's previous window emits; the last stage runs it only
    # when the session's latest verdict ends at pos_start with that token.
    ahead: bool = False
    # Prompt scoring (docs/protocol.md), PREFILL only: the last stage answers the
    # log-probabilities of the segment's tokens after its first and of
    # ``next_token`` (the token after its last, on a chunk of a longer prompt).
    score: bool = False
    next_token: int | None = None
    # Embeddings (docs/protocol.md), PREFILL only: the last stage answers the
    # segment's rows after the final norm, pooled (``SegmentResult.pooled``).
    pooling: Pooling = Pooling.NONE

    def __post_init__(self) -> None:
        if not isinstance(self.token_ids, tuple):
            object.__setattr__(self, "token_ids", tuple(int(t) for t in self.token_ids))

    @property
    def scored_tokens(self) -> tuple[int, ...]:
        """The tokens a scoring segment's rows predict, row by row."""
        if not self.score:
            return ()
        tail = () if self.next_token is None else (self.next_token,)
        return self.token_ids[1:] + tail

    @property
    def token_count(self) -> int:
        """Rows of the frame's tensor this segment holds."""
        return len(self.token_ids) if self.kind.computes else 0

    @property
    def pos_end(self) -> int:
        """One past the position of the last token: the KV length after this segment."""
        return self.pos_start + self.token_count

    @property
    def emits(self) -> bool:
        """True when the last stage answers this segment with tokens (or, scoring,
        with the prompt's log-probabilities; pooling, with its pooled rows)."""
        if self.kind is SegmentKind.PREFILL:
            return self.sample or self.score or self.pooling is not Pooling.NONE
        return self.kind is not SegmentKind.END

    def result_pos(self) -> int:
        """Position of the first token the last stage emits for this segment."""
        if self.kind is SegmentKind.VERIFY:
            return self.pos_start + 1
        return self.pos_end

    def max_emitted(self) -> int:
        """Tokens the answer may hold: draft count + 1 for VERIFY, else 1."""
        return self.token_count if self.kind is SegmentKind.VERIFY else 1


def _same(a: object, b: object) -> bool:
    """Field equality that also compares tensors (dtype, shape and values)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        same_layout = a.dtype == b.dtype and a.shape == b.shape
        return same_layout and torch.equal(a.cpu(), b.cpu())
    return a == b


@dataclass(frozen=True, eq=False)
class Frame:
    """One step's work for one stage. ``hidden`` is ``[row_count, hidden_size]``
    activations entering the receiving stage (None on stage 0's input and for a frame
    of END segments only)."""

    term: int
    frame_id: int
    segments: tuple[Segment, ...]
    hidden: torch.Tensor | None = None
    timings: tuple[StageTiming, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.segments, tuple):
            object.__setattr__(self, "segments", tuple(self.segments))
        if not isinstance(self.timings, tuple):
            object.__setattr__(self, "timings", tuple(self.timings))

    @property
    def row_count(self) -> int:
        return sum(s.token_count for s in self.segments)

    def spans(self) -> Iterator[tuple[Segment, int, int]]:
        """``(segment, first row, row count)`` for every segment, in order."""
        row = 0
        for segment in self.segments:
            yield segment, row, segment.token_count
            row += segment.token_count

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Frame):
            return NotImplemented
        return all(_same(getattr(self, f.name), getattr(other, f.name)) for f in fields(self))

    __hash__ = None  # type: ignore[assignment]


@dataclass(frozen=True)
class FrameAck:
    """Sent back on the Forward stream, only for a frame refused whole."""

    frame_id: int
    error: ErrorInfo | None = None


@dataclass(frozen=True)
class TokenLogprob:
    """An emitted token's log-probability and its likeliest alternatives
    ``(token, logprob)``, best first."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class SegmentResult:
    """Emitted tokens (or an error) for one segment. ``pos_start`` is the position of
    the first emitted token (of the failed segment for an error); ``accepted_count``
    how many draft tokens of a VERIFY segment were kept."""

    request_id: str
    session_id: str
    pos_start: int
    token_ids: tuple[int, ...] = ()
    accepted_count: int = 0
    error: ErrorInfo | None = None
    epoch: int = 0
    # One per emitted token when the session asked for log-probabilities.
    logprobs: tuple[TokenLogprob, ...] = ()
    # The last stage dropped the segment unrun (a refuted ``ahead`` window).
    dropped: bool = False
    # A scoring segment's ``scored_tokens``, scored: positions ``pos + 1 ...`` of
    # the segment (``Segment.pos_start + 1`` on).
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    # A pooling segment's rows after the final norm, pooled (``Segment.pooling``).
    pooled: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.token_ids, tuple):
            object.__setattr__(self, "token_ids", tuple(int(t) for t in self.token_ids))
        if not isinstance(self.pooled, tuple):
            object.__setattr__(self, "pooled", tuple(float(v) for v in self.pooled))

    @property
    def ok(self) -> bool:
        return self.error is None

    @classmethod
    def failure(cls, segment: Segment, error: BaseException, stage_index: int) -> SegmentResult:
        """The answer telling stage 0 that ``segment`` failed on ``stage_index``."""
        return cls(
            request_id=segment.request_id,
            session_id=segment.session_id,
            pos_start=segment.pos_start,
            error=ErrorInfo.from_exception(error, stage_index=stage_index),
            epoch=segment.epoch,
        )


@dataclass(frozen=True)
class FrameResult:
    """Results for the segments of one frame of ``term`` (the term of the frame it
    answers, never the answering stage's), with the timings the frame collected.

    ``reopened``: a stage's note that it opened its Return link again on ``term``
    after it broke (no results; ``frame_id`` is the highest frame of the term it had
    finished): answers or refusals of frames up to it may have been lost with the
    old link. With ``reopened_link`` "forward" (``frame_id`` 0): a stage after
    stage 0 opened its Forward link again, so the pipeline below it is whole."""

    term: int
    frame_id: int
    results: tuple[SegmentResult, ...]
    timings: tuple[StageTiming, ...] = ()
    reopened: bool = False
    reopened_link: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.results, tuple):
            object.__setattr__(self, "results", tuple(self.results))
        if not isinstance(self.timings, tuple):
            object.__setattr__(self, "timings", tuple(self.timings))


@dataclass(frozen=True)
class FrameProgress:
    """How far the frames of its term have come through one stage (heartbeats carry
    it; the coordinator finds a stage whose data path is stuck while it still
    heartbeats by it: ``coordinator/registry.py``, "stalls").

    ``done``: the highest frame id the stage has finished (passed on, answered or
    failed; 0: none). Stage 0 alone fills the rest: ``waiting_frame``, the frame it
    has waited longest for an answer to (0: none) and for ``waiting_s``;
    ``waiting_compute_s``, stage 0's own compute time for that frame (0 while
    unknown; the coordinator scales it by the stages' step times into the round the
    frame should take); ``longest_round_s``, the
    longest round among its recently answered frames. ``received``: bytes the
    process has read from its framed TCP data links so far (it grows while a frame
    is on its way over a slow link; only its changes mean anything)."""

    done: int = 0
    waiting_frame: int = 0
    waiting_s: float = 0.0
    waiting_compute_s: float = 0.0
    longest_round_s: float = 0.0
    received: int = 0
