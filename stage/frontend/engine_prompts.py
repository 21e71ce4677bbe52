"""The prompt side of stage 0's engine core (stage/frontend/engine_core.py): prefill
chunks, the frame of new prompts sent while the pipe is full (and the prompts that
join it), choices of one request (n > 1) that start from their first choice's
session, and sessions that start from a kept prefix.

``PromptSteps`` is a part of ``EngineCore``, kept apart for size; it uses the core's
state (running requests, frames sent, the prefix cache, limits, clock).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from mesh.errors import MeshError
from mesh.frames import Frame, Pooling, Segment, SegmentKind
from stage.frontend.engine_types import EngineLimits, InFlight, PipelineInfo, SentFrame, Tracked
from stage.frontend.expectation import Expected
from stage.frontend.prefix_index import PrefixIndex

# Stage 0 forgets a kept prefix after this share of the stages' idle timeout, before
# any stage drops it (a stage sees each use a hop later, and sweeps now and then).
PREFIX_IDLE_MARGIN = 0.9

logger = logging.getLogger(__name__)

# The longest chunk of a scored prompt: the last stage computes the head on every
# row of it (rows x vocabulary logits: 128 x 152k float32 is 78 MB).
SCORED_CHUNK_TOKENS = 128


class PromptSteps:
    """Prompt segments of an ``EngineCore`` (whose ``_pack``, ``_take_ends``,
    ``_claim_flights``, ``_forget`` and ``_prompt_rows`` they call)."""

    # Set by EngineCore.__init__.
    limits: EngineLimits
    clock: Callable[[], float]
    info: PipelineInfo | None
    running: dict[str, Tracked]
    frames: dict[int, SentFrame]
    prefixes: PrefixIndex | None
    prefix_hits: int
    prefix_lookups: int
    prefix_lost: int
    cached_tokens_total: int
    _ends: list[Segment]
    _next_frame_id: int

    def _prompts_ahead(self, info: PipelineInfo) -> Frame | None:
        """With the pipe full, a frame of the first prompt chunks of requests that
        arrived since (``limits.prompts_ahead``; one such frame in the pipe at a
        time, which later arrivals join while stage 0 has not started it:
        ``open_prompts_frame``, ``join_prompts_frame``). Without it a new prompt waits
        for a frame's answer and then rides in the next frame, behind the whole frame
        ahead of it on every stage; sent now, it is queued on stage 0 right behind the
        frames being computed there."""
        if not self.limits.prompts_ahead or self._prompts_frame() is not None:
            return None
        now = self.clock()
        # Frames of decode rows queue behind this one on every stage.
        room = self._prompt_rows(0, info.step_tokens or self.limits.step_tokens)
        segments = self._fresh_prompts(room, info, now)
        if not segments:
            return None
        return self._pack(self._take_ends() + segments, info, now, prompts_ahead=True)

    def _prompts_frame(self) -> SentFrame | None:
        return next((f for f in self.frames.values() if f.prompts_ahead), None)

    def _fresh_prompts(
        self, room: int, info: PipelineInfo, now: float, frame_id: int = 0
    ) -> list[Segment]:
        """First prompt chunks of requests that have sent nothing yet, within ``room``
        rows."""
        segments: list[Segment] = []
        for tracked in self.running.values():
            if room <= 0:
                break
            fresh = tracked.prefilling and tracked.prefilled == 0 and tracked.in_flight is None
            if (
                not fresh
                or tracked.recover_by is not None
                or self._waits_for_fork(tracked, frame_id)
            ):
                continue
            segment = self._prefill_segment(tracked, info.term, room, now)
            segments.append(segment)
            room -= segment.token_count
        return segments

    def open_prompts_frame(self) -> int:
        """The id of the frame of new prompts in the pipe when more new prompts wait
        and its step budget has room for them (0: none). Only the last frame sent
        takes more: a prompt joined to an earlier one would reach the stages before
        the ENDs of a later frame, whose sessions it may replace or start from. Nor
        does a frame that holds a session with an END waiting, or a new session that
        starts from one (see ``_joinable``)."""
        info, sent = self.info, self._prompts_frame()
        if info is None or sent is None or not self._joinable(sent, info):
            return 0
        if sent.frame_id != self._next_frame_id - 1:
            return 0
        if sent.rows >= (info.step_tokens or self.limits.step_tokens):
            return 0
        waiting = any(
            t.prefilling and t.prefilled == 0 and t.in_flight is None and t.recover_by is None
            for t in self.running.values()
        )
        return sent.frame_id if waiting else 0

    def _joinable(self, sent: SentFrame, info: PipelineInfo) -> bool:
        """Whether new prompts (and the ENDs waiting, which go first with them) may
        join frame ``sent``. A stage applies a frame's ENDs before its rows, so an
        END joined to a frame that holds a segment of its session would run before
        that segment (a request cancelled while its prompt waits there: the prompt
        then opens a session nothing ends), and one whose session a new session of
        the frame copies (``prefix_from``) would take the positions away first.
        Such ENDs go in a later frame, and the new prompts with them."""
        if not sent.prompts_ahead or sent.term != info.term:
            return False
        return not any(
            end.session_id in sent.kinds or end.session_id in sent.sources for end in self._ends
        )

    def join_prompts_frame(self, frame_id: int) -> list[Segment]:
        """First chunks of new prompts for frame ``frame_id`` (``open_prompts_frame``),
        which stage 0 has not started: the caller adds them to it. The frame's
        record counts them from now on."""
        info, sent = self.info, self.frames.get(frame_id)
        if info is None or sent is None or not self._joinable(sent, info):
            return []
        now = self.clock()
        budget = self._prompt_rows(0, info.step_tokens or self.limits.step_tokens)
        segments = self._fresh_prompts(budget - sent.rows, info, now, frame_id)
        if not segments:
            return []
        segments = self._take_ends() + segments
        self._claim_flights(frame_id)
        sent.rows += sum(s.token_count for s in segments)
        sent.outstanding.update(s.session_id for s in segments)
        sent.kinds.update((s.session_id, s.kind) for s in segments)
        sent.sources.update(s.prefix_from for s in segments if s.prefix_from)
        for segment in segments:
            tracked = self.running.get(segment.request_id)
            if tracked is not None and tracked.prompt_frame == self._next_frame_id:
                tracked.prompt_frame = frame_id  # its last chunk rides in this frame
        return segments

    def _prefill_segment(self, tracked: Tracked, term: int, room: int, now: float) -> Segment:
        run = tracked.run
        tokens = run.tokens
        first = tracked.prefilled == 0
        prefix_from = ""
        if first:
            prefix_from = self._fork(tracked) or self._start_from_prefix(tracked)
        start = tracked.prefilled
        count = min(self.limits.prefill_chunk_tokens, room, len(tokens) - start)
        if run.request.score_prompt and not run.prompt_scored:
            # The last stage holds a row of logits per token of a scored chunk.
            count = min(count, SCORED_CHUNK_TOKENS)
        final = start + count >= len(tokens)
        session = run.request.request_id
        score = run.request.score_prompt and not run.prompt_scored
        pooling = Pooling.NONE
        if run.request.pooling and not run.embedded and (final or run.request.pooling == "mean"):
            pooling = Pooling(run.request.pooling)
            run.pooled_sizes[start] = count
        segment = Segment(
            request_id=session,
            session_id=session,
            kind=SegmentKind.PREFILL,
            pos_start=start,
            token_ids=tuple(tokens[start : start + count]),
            sampling=run.request.sampling if first else None,
            sample=final,
            epoch=tracked.epoch,
            prefix_from=prefix_from,
            score=score,
            next_token=tokens[start + count] if score and not final else None,
            pooling=pooling,
        )
        tracked.prefilled = start + count
        tracked.touched = now
        if final:
            tracked.in_flight = InFlight(segment, Expected.for_segment(segment, term), 0, now)
            tracked.prompt_frame = self._next_frame_id
        return segment

    def _fork_parent(self, tracked: Tracked) -> Tracked | None:
        """The running first choice whose session this choice (n > 1) is to start
        from, or None (not a forked choice, or its first choice is gone: it then
        reads its prompt as any request does)."""
        parent_id = tracked.run.request.fork_of
        if not parent_id or tracked.prefilled or tracked.no_prefix:
            return None
        parent = self.running.get(parent_id)
        if parent is None or parent.recover_by is not None:
            return None
        return parent

    def _waits_for_fork(self, tracked: Tracked, frame_id: int = 0) -> bool:
        """True while the first choice's prompt has not been sent in a frame before
        ``frame_id`` (0: the next frame packed): each stage must have read it before
        this choice copies it, and a frame's sessions copy what was held before it ran
        (a choice joined to the frame of new prompts that holds its first choice's
        prompt found too few positions)."""
        parent = self._fork_parent(tracked)
        if parent is None:
            return False
        target = frame_id or self._next_frame_id
        return not (parent.prompt_frame and parent.prompt_frame < target)

    def _fork(self, tracked: Tracked) -> str:
        """Start a forked choice from its first choice's prompt positions: all but the
        prompt's last token, which it reads to sample its own first token."""
        parent = self._fork_parent(tracked)
        if parent is None or not parent.prompt_frame:
            return ""
        length = len(tracked.run.request.prompt_tokens) - 1
        if length <= 0:
            return ""
        tracked.prefilled = length
        tracked.prefix_from = parent.run.request.request_id
        tracked.run.cached_tokens = length
        return tracked.prefix_from

    def _start_from_prefix(self, tracked: Tracked) -> str:
        """Start the request's session from the longest kept prefix of its tokens:
        its name ("" for none); ``tracked.prefilled`` is then its length."""
        if self.prefixes is None or tracked.no_prefix:
            return ""
        self.prefix_lookups += 1
        if self.info is not None:
            # What the stages have dropped by now as idle is not offered to them.
            self.prefixes.expire(self.info.session_idle_s * PREFIX_IDLE_MARGIN)
        hit = self.prefixes.lookup(tracked.run.tokens, tracked.run.request.prefix_partition)
        if hit is None:
            return ""
        self.prefixes.touch(hit.name)
        self.prefix_hits += 1
        self.cached_tokens_total += hit.length
        tracked.prefilled = hit.length
        tracked.prefix_from = hit.name
        tracked.run.cached_tokens = hit.length
        return hit.name

    def _read_again(self, tracked: Tracked, error: MeshError) -> None:
        """A stage lacked the prefix the session was to start from: forget it and
        read the request's tokens again from position 0 (what was sent is void)."""
        name = tracked.prefix_from
        logger.info(
            "request %s: prefix %s is gone on a stage (%s); reading %s tokens from 0",
            tracked.run.request.request_id,
            name,
            error.message,
            len(tracked.run.tokens),
        )
        self.prefix_lost += 1
        if self.prefixes is not None and self.prefixes.remove(name):
            self._ends.append(self._forget(name))
        tracked.read_from_zero()
        tracked.run.cached_tokens = 0
