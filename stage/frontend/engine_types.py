"""The values stage 0's engine core works with: its limits, what it learns of the
loaded pipeline, and what it tracks per request and per frame in flight."""

from __future__ import annotations

from dataclasses import dataclass, field

from mesh.errors import MeshError
from mesh.frames import Segment, SegmentKind
from mesh.settings.sections import FrontendConfig
from stage.frontend.backend import TokenEvent
from stage.frontend.expectation import Expected
from stage.frontend.request_run import RequestRun


@dataclass(frozen=True)
class EngineLimits:
    """``step_tokens``: rows one frame may hold (decode and verify rows first, prefill
    chunks in what is left); ``draft_tokens``: draft rows one step may hold, shared
    among the requests that speculate in it; ``prefill_chunk_tokens``: the longest
    prompt chunk of one request in one step; ``prefix_cache_tokens``: positions of
    finished requests kept on the stages for later prompts (0: none);
    ``max_depth``: verify windows one request may have in flight (1: one window,
    then its verdict); ``prompts_ahead``: with the pipe full, new prompts' first
    chunks may go at once in one frame beyond the frames-in-flight cap."""

    max_sessions: int = FrontendConfig.max_concurrent_requests
    max_queued: int = FrontendConfig.max_queued
    step_tokens: int = FrontendConfig.max_batch_tokens
    draft_tokens: int = 64
    prefill_chunk_tokens: int = 512
    round_timeout_s: float = 120.0
    recovery_timeout_s: float = 60.0
    prefix_cache_tokens: int = FrontendConfig.prefix_cache_tokens
    max_depth: int = FrontendConfig.max_windows_in_flight
    prompts_ahead: bool = FrontendConfig.prompts_ahead
    decode_stall_ms: float = FrontendConfig.decode_stall_ms

    @classmethod
    def of(cls, serving: FrontendConfig) -> EngineLimits:
        """The engine limits stage 0's [frontend] settings give."""
        return cls(
            max_sessions=serving.max_concurrent_requests,
            max_queued=serving.max_queued,
            step_tokens=serving.max_batch_tokens,
            prefix_cache_tokens=serving.prefix_cache_tokens,
            max_depth=serving.max_windows_in_flight,
            prompts_ahead=serving.prompts_ahead,
            decode_stall_ms=serving.decode_stall_ms,
        )


@dataclass(frozen=True)
class PipelineInfo:
    """What stage 0 learns of the loaded pipeline, once per load."""

    term: int
    stage_count: int
    model_id: str = ""
    context_length: int = 0
    # The step token budget the coordinator set (0: the engine's own).
    step_tokens: int = 0
    # Sessions every stage keeps KV for (0: not known): the engine never runs more
    # requests at once, whatever its own limit.
    kv_sessions: int = 0
    # Seconds after which the stages drop an unused session or kept prefix (0: never).
    session_idle_s: float = 0.0


@dataclass
class InFlight:
    """The segment of a request waiting for its answer."""

    segment: Segment
    expected: Expected
    frame_id: int
    sent_at: float
    drafts: list[int] = field(default_factory=list)
    draft_s: float = 0.0


@dataclass
class Tracked:
    """A running request as the core sees it."""

    run: RequestRun
    # Of ``run.tokens``, how many the pipeline's KV holds or has been sent as prefill.
    prefilled: int = 0
    # Reading its prompt (or re-reading everything after a recovery).
    prefilling: bool = True
    in_flight: InFlight | None = None
    # Verify windows sent after ``in_flight`` before its verdict, oldest first
    # (stage/frontend/ahead.py), the depth chosen for them, and the request's
    # measured send-to-verdict time of a window (seconds, averaged).
    ahead: list[InFlight] = field(default_factory=list)
    depth: int = 1
    round_s: float = -1.0
    # Recent share of its verify windows accepted whole, and of the bonus tokens a
    # window drafted ahead guessed right (-1: none seen yet).
    p_whole: float = -1.0
    p_guess: float = -1.0
    # Set while waiting for a pipeline newer than ``failed_term``.
    recover_by: float | None = None
    failed_term: int = 0
    # The answer of the lost step comes from the re-prefill (``resumed``): its
    # drafts, if it was a verify window.
    lost: InFlight | None = None
    resumed: bool = False
    # Raised when the request's segments in the pipe are void (its prompt is read
    # again from position 0); answers of another epoch are dropped.
    epoch: int = 0
    # The kept prefix its session started from, and how many positions of it.
    prefix_from: str = ""
    no_prefix: bool = False
    # The frame that carried the last chunk of its prompt (0: not sent yet): the
    # choices forked from it may start in a later frame.
    prompt_frame: int = 0
    # Times in a row a step left it out to keep the frames in the pipe even (it goes
    # first in the next one).
    passed_over: int = 0
    # When its last prompt chunk was packed (the core's clock; 0: none yet): a
    # session opened on the stages and left waiting behind other prompts goes first
    # before the stages' idle sweep would drop it.
    touched: float = 0.0
    # Times its tokens were read again from 0 because a stage no longer held its
    # session (bounded: a stage that keeps losing it fails the request).
    rereads: int = 0

    def read_from_zero(self) -> None:
        """Void its segments in the pipe (a new epoch) and read its tokens again from
        position 0, starting from no kept prefix."""
        self.epoch += 1
        self.prefilled = 0
        self.prompt_frame = 0
        self.prefilling = True
        self.in_flight = None
        self.ahead.clear()
        self.prefix_from = ""
        self.no_prefix = True


@dataclass
class SentFrame:
    frame_id: int
    term: int
    sent_at: float
    rows: int
    outstanding: set[str]
    kinds: dict[str, SegmentKind]
    # Sessions and kept prefixes the frame's new sessions copy (``prefix_from``).
    sources: set[str] = field(default_factory=set)
    # Sent beyond the frames-in-flight cap: new prompts' first chunks only.
    prompts_ahead: bool = False


@dataclass(frozen=True)
class Outcome:
    """Something for one request's consumer: an event, or the error that ends it."""

    request_id: str
    event: TokenEvent | None = None
    error: MeshError | None = None
