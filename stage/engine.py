"""The stage engine: applies frames to a layer-range runtime. Plain torch, no network.

A servicer decodes a frame, calls ``StageEngine.process`` and sends what comes out:
a frame with activations for the next stage, or (on the last stage) a TokenResult
for stage 0. The last stage samples with the request's seeded sampler and verifies
speculative windows losslessly.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, replace

import torch

from mesh.codec import ErrorInfo, Frame, FrameKind, StageTiming, TokenResult
from mesh.errors import InvalidRequest, NotFound
from mesh.runtime import StageRuntime
from mesh.sampling import sample_token
from mesh.speculative.verify import verify_window
from mesh.types import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineOutput:
    """What a processed frame produces: at most one of the two is set."""

    forward: Frame | None = None
    result: TokenResult | None = None


@dataclass
class _Session:
    request_id: str
    sampling: SamplingParams
    last_used: float


class StageEngine:
    """Runs frames through one stage's runtime and keeps per-session state."""

    def __init__(self, runtime: StageRuntime, stage_index: int, term: int) -> None:
        self.runtime = runtime
        self.stage_index = stage_index
        self.term = term
        self._sessions: dict[str, _Session] = {}
        self._lock = threading.Lock()

    @property
    def is_first(self) -> bool:
        return self.runtime.is_first

    @property
    def is_last(self) -> bool:
        return self.runtime.is_last

    def session_count(self) -> int:
        with self._lock:
            return len(self._sessions)

    def session_ids(self) -> list[str]:
        with self._lock:
            return list(self._sessions)

    def process(self, frame: Frame, queued_s: float = 0.0) -> EngineOutput:
        """Apply one frame. Raises a MeshError for a frame that must fail."""
        started = time.perf_counter()
        if frame.kind is FrameKind.END:
            self.end_session(frame.session_id)
            return EngineOutput(forward=None if self.is_last else frame)
        session = self._session_for(frame)
        if frame.kind is FrameKind.TRIM:
            if self.runtime.session_length(frame.session_id) > frame.pos_start:
                self.runtime.trim(frame.session_id, frame.pos_start)
            return EngineOutput(forward=None if self.is_last else frame)
        if frame.kind is FrameKind.VERIFY and len(frame.token_ids) < 1:
            raise InvalidRequest("a VERIFY frame needs the current token and its draft tokens")
        inputs = self._inputs(frame)
        output = self.runtime.forward(frame.session_id, frame.pos_start, inputs)
        session.last_used = time.monotonic()
        timing = StageTiming(
            stage_index=self.stage_index,
            compute_ms=(time.perf_counter() - started) * 1000.0,
            queue_ms=queued_s * 1000.0,
        )
        timings = (*frame.timings, timing)
        if not self.is_last:
            return EngineOutput(
                forward=replace(frame, hidden=output, timings=timings, sampling=frame.sampling)
            )
        return EngineOutput(result=self._emit(frame, session, output, timings))

    def end_session(self, session_id: str) -> bool:
        """Free a session's KV and state; False when this stage did not hold it."""
        with self._lock:
            known = self._sessions.pop(session_id, None) is not None
        held = self.runtime.drop_session(session_id)
        return known or held

    def expire_idle(self, idle_timeout_s: float) -> list[str]:
        """End sessions unused for longer than ``idle_timeout_s``."""
        now = time.monotonic()
        with self._lock:
            stale = [sid for sid, s in self._sessions.items() if now - s.last_used > idle_timeout_s]
        for session_id in stale:
            logger.info("session %s expired after %.0fs idle", session_id, idle_timeout_s)
            self.end_session(session_id)
        return stale

    def active_requests(self) -> list[tuple[str, str]]:
        """(session_id, request_id) of every session this stage holds."""
        with self._lock:
            return [(sid, s.request_id) for sid, s in self._sessions.items()]

    @staticmethod
    def error_for(
        frame: Frame, error: BaseException, stage_index: int, term: int = 0
    ) -> TokenResult:
        """The TokenResult that tells stage 0 this frame failed on ``stage_index``."""
        return TokenResult(
            request_id=frame.request_id,
            session_id=frame.session_id,
            pos_start=frame.pos_start,
            error=ErrorInfo.from_exception(error, stage_index=stage_index),
            term=term,
        )

    # ---- internals --------------------------------------------------------------

    def _session_for(self, frame: Frame) -> _Session:
        with self._lock:
            session = self._sessions.get(frame.session_id)
            if session is not None:
                if frame.sampling is not None:
                    session.sampling = frame.sampling
                return session
            if frame.kind is FrameKind.PREFILL and frame.pos_start == 0:
                session = _Session(
                    request_id=frame.request_id,
                    sampling=frame.sampling or SamplingParams(),
                    last_used=time.monotonic(),
                )
                self._sessions[frame.session_id] = session
                return session
        raise NotFound(
            f"stage {self.stage_index} holds no session {frame.session_id!r} "
            f"(request {frame.request_id}); start it with a PREFILL frame at position 0"
        )

    def _inputs(self, frame: Frame) -> torch.Tensor:
        if self.is_first:
            return torch.tensor(frame.token_ids, dtype=torch.long)
        if frame.hidden is None:
            raise InvalidRequest(
                f"frame for session {frame.session_id!r} carries no activations; "
                f"stage {self.stage_index} takes hidden states from its upstream stage"
            )
        return frame.hidden

    def _emit(
        self,
        frame: Frame,
        session: _Session,
        logits: torch.Tensor,
        timings: tuple[StageTiming, ...],
    ) -> TokenResult | None:
        if frame.kind is FrameKind.PREFILL and not frame.sample:
            return None
        if frame.kind is FrameKind.VERIFY:
            verdict = verify_window(
                logits, frame.token_ids, session.sampling, pos_first=frame.pos_start + 1
            )
            emitted, accepted = list(verdict.emitted), verdict.accepted_count
        else:
            position = frame.pos_end
            emitted, accepted = [sample_token(logits[-1], session.sampling, position)], 0
        return TokenResult(
            request_id=frame.request_id,
            session_id=frame.session_id,
            pos_start=frame.pos_end if frame.kind is not FrameKind.VERIFY else frame.pos_start + 1,
            token_ids=tuple(emitted),
            accepted_count=accepted,
            timings=timings,
            term=self.term,
        )
