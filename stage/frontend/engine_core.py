"""Stage 0's engine core: a step loop over every running request. No asyncio, no
network: the caller (stage/frontend/scheduler.py) feeds it requests, results and the
clock, submits the frames it packs, and hands out the events it produces.

Each step (``next_frame``): END segments of finished requests; then one segment per
running request with nothing in flight (a decode token, or a verify window of
``[current, drafts...]`` from its proposer, windows shrunk to the step's draft
budget); then prefill chunks of requests still reading their prompt, within what is
left of the step's token budget (decode first: a long prompt never stalls the
others' tokens). Up to ``frames_in_flight`` frames (the stage count: one per stage)
are in the pipe at once, and besides them one frame of the first prompt chunks of
requests that arrived while the pipe was full (so a new prompt does not wait for a
frame's answer first). Results commit tokens through the request's one commit
rule (``RequestRun.commit``: stop tokens, the token budget); the request's state is
the one copy of its tokens.

A segment that fails because the pipeline went away (UNAVAILABLE, a stale term, no
answer in time) puts its request into recovery: when a pipeline of a newer term is
loaded, the request re-reads every token it has (prompt and output) as prefill and
carries on; past the recovery deadline it fails. Any other error fails the request.
"""

from __future__ import annotations

import logging
import math
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import replace

from mesh.errors import (
    CapacityExceeded,
    InvalidRequest,
    MeshError,
    NotFound,
    PrefixMissing,
    StaleTerm,
    Unavailable,
)
from mesh.frames import Frame, FrameResult, Pooling, Segment, SegmentKind, SegmentResult
from mesh.speculative import RoundContext, plan_window
from stage.frontend import ahead
from stage.frontend.backend import POOLINGS, GenerationRequest
from stage.frontend.engine_prompts import PromptSteps
from stage.frontend.engine_types import (
    EngineLimits,
    InFlight,
    Outcome,
    PipelineInfo,
    SentFrame,
    Tracked,
)
from stage.frontend.expectation import Expected, stale_reason
from stage.frontend.prefix_index import PrefixIndex
from stage.frontend.request_run import RequestRun
from stage.frontend.step_cost import StepCostFit, acceptance, paying_window, row_threshold

logger = logging.getLogger(__name__)

# Answered rounds the stall rule's "longest recent round" looks back over: at most
# this many, none older than ROUND_MAX_AGE_S, and a high percentile of them rather
# than the longest, so that one slow round (a first grammar, a stage that hung and
# woke) does not stretch the stall deadline for long after.
ROUNDS_KEPT = 64
ROUND_MAX_AGE_S = 120.0
ROUND_PERCENTILE = 0.9
# Prompt rows a frame may always hold while requests decode (``_prompt_rows``), and
# the rows of a first prompt chunk among decoding requests before any prompt frame
# was measured.
MIN_PROMPT_ROWS = 16
FIRST_PROMPT_ROWS = 64
# Times a request's tokens are read again after a stage lost its session before the
# request fails (a stage that keeps dropping it is not waited on forever).
MAX_REREADS = 3
# Sessions of unclaimed results remembered as ended.
UNCLAIMED_ENDS_KEPT = 1024


class EngineCore(PromptSteps):
    """The step loop's state and decisions; see the module docstring."""

    def __init__(
        self, limits: EngineLimits, clock: Callable[[], float], new_speculation=None
    ) -> None:
        self.limits = limits
        self.clock = clock
        self.new_speculation = new_speculation
        self.info: PipelineInfo | None = None
        self.running: dict[str, Tracked] = {}
        self.waiting: deque[RequestRun] = deque()
        self.frames: dict[int, SentFrame] = {}
        self.step_cost = StepCostFit()
        # The same for frames holding prompt rows (``decode_stall_ms``): the longer of
        # their slowest stage's compute and their time on one data link.
        self.prompt_cost = StepCostFit()
        # What a decode frame's round spends outside the stages' compute and queues
        # (ms, EWMA; -1 until measured): the links' latency, which a prompt frame's
        # round also holds beside the time its activations take on the wire.
        self.wire_base_ms = -1.0
        self.stale: list[str] = []
        self.recoveries = 0
        # Requests read again from 0 because a stage no longer held their session.
        self.rereads = 0
        # Sessions of unclaimed results already ended (each is ended once).
        self._unclaimed_ended: OrderedDict[str, None] = OrderedDict()
        # Windows drafted ahead (stage/frontend/ahead.py), and the slowest stage's
        # time per decode or verify frame (seconds, averaged) the depth rule uses.
        self.ahead = ahead.AheadCounters()
        self.step_s = 0.0
        # The prefix cache (stage/frontend/prefix_index.py); None when off.
        self.prefixes = self._prefix_index(limits)
        self.prefix_hits = 0
        self.prefix_lookups = 0
        self.prefix_lost = 0
        self.cached_tokens_total = 0
        self._ends: list[Segment] = []
        self._next_frame_id = 1
        # (answered at, seconds from send to answer) of the latest answered frames of
        # the current term, for the coordinator's stall rule (``oldest_unanswered``).
        self.rounds: deque[tuple[float, float]] = deque(maxlen=ROUNDS_KEPT)
        # The current term when one of its frames went unanswered past the round
        # timeout (0: none since it loaded, or an answer of it came since): its
        # pipeline is taken as stuck until it answers again or a new one loads.
        self.unanswered_term = 0

    def set_limits(self, limits: EngineLimits) -> None:
        """New limits (stage 0's serving settings arrive with every Load). Requests
        already admitted keep running; a resized prefix cache starts empty."""
        if limits.prefix_cache_tokens != self.limits.prefix_cache_tokens:
            self.prefixes = self._prefix_index(limits)
        self.limits = limits

    def _prefix_index(self, limits: EngineLimits) -> PrefixIndex | None:
        """An empty prefix cache index of ``limits``' size (None: the cache is off)."""
        if limits.prefix_cache_tokens <= 0:
            return None
        return PrefixIndex(limits.prefix_cache_tokens, clock=self.clock)

    # ---- requests ---------------------------------------------------------------

    def add(self, request: GenerationRequest) -> RequestRun:
        """Admit a request (running when a session slot is free, else queued)."""
        if not request.prompt_tokens:
            raise InvalidRequest("the prompt is empty; send at least one token")
        if request.max_new_tokens < (0 if request.reads_only else 1):
            raise InvalidRequest(
                f"max_new_tokens is {request.max_new_tokens}; a request generates at least "
                "one token unless it scores or embeds its prompt"
            )
        if request.pooling not in ("", *POOLINGS):
            raise InvalidRequest(
                f"pooling {request.pooling!r} is unknown; use one of {', '.join(POOLINGS)}"
            )
        if self.info is None:
            raise Unavailable("the pipeline is not loaded yet (or is reloading)")
        limits = self.limits
        if len(self.running) + len(self.waiting) >= limits.max_sessions + limits.max_queued:
            raise CapacityExceeded(
                f"{len(self.running)} requests in flight and {len(self.waiting)} queued, "
                "the limit; retry shortly"
            )
        speculation = self.new_speculation(request) if self.new_speculation else None
        run = RequestRun(request, speculation)
        run.started = self.clock()
        self.waiting.append(run)
        self._admit()
        return run

    def cancel(self, request_id: str, keep: bool = True) -> None:
        """Stop a request (its consumer went away, or it ended): free its KV everywhere,
        or with ``keep`` and the prefix cache on, keep the positions it read for later
        prompts that start with them."""
        for run in list(self.waiting):
            if run.request.request_id == request_id:
                self.waiting.remove(run)
                return
        tracked = self.running.pop(request_id, None)
        if tracked is None:
            return
        ahead.end_ahead(tracked, self.ahead)
        if tracked.prefilled or tracked.in_flight is not None:
            self._ends.extend(self._end_segments(tracked, keep))
        self._admit()

    def _end_segments(self, tracked: Tracked, keep: bool) -> list[Segment]:
        """END for the request's session, keeping its positions when that is safe: its
        prompt read in full and no recovery pending; the positions are every token it
        holds but the last (read by no step yet)."""
        request_id = tracked.run.request.request_id
        kept, dropped = False, []
        length = len(tracked.run.tokens) - 1
        safe = not tracked.prefilling and tracked.recover_by is None
        if keep and safe and self.prefixes is not None:
            kept, dropped = self.prefixes.add(
                request_id, tracked.run.tokens[:length], tracked.run.request.prefix_partition
            )
        ends = [
            Segment(
                request_id,
                request_id,
                SegmentKind.END,
                length if kept else 0,
                keep_prefix=kept,
            )
        ]
        ends += [self._forget(name) for name in dropped]
        return ends

    @staticmethod
    def _forget(name: str) -> Segment:
        return Segment(name, name, SegmentKind.END, 0, forget_prefix=True)

    def _admit(self) -> None:
        cap = self.limits.max_sessions
        if self.info is not None and self.info.kv_sessions > 0:
            cap = min(cap, self.info.kv_sessions)
        while self.waiting and len(self.running) < cap:
            run = self._next_waiting()
            self.waiting.remove(run)
            # A scored or embedded prompt is read whole: every position's row must
            # reach the head (or the pooling).
            self.running[run.request.request_id] = Tracked(run, no_prefix=run.request.reads_only)

    def _next_waiting(self) -> RequestRun:
        """The waiting request to admit next: the earliest of those whose tenant (API
        key) runs the fewest now, so one key's burst in the queue does not hold the
        others back; without keys (one tenant), the earliest."""
        running = Counter(tracked.run.request.tenant for tracked in self.running.values())
        return min(self.waiting, key=lambda run: running[run.request.tenant])

    @property
    def queued(self) -> int:
        return len(self.waiting)

    # ---- the pipeline -------------------------------------------------------------

    def set_pipeline(self, info: PipelineInfo | None) -> list[Outcome]:
        """A pipeline was loaded (``info``) or lost (None). Frames of another term
        will never be answered: their requests recover on the new pipeline."""
        previous, self.info = self.info, info
        if previous is not None and (info is None or info.term != previous.term):
            self.unanswered_term = 0
            self.frames.clear()
            self._ends.clear()
            if self.prefixes is not None:
                # The stages of a new pipeline start with nothing kept.
                self.prefixes.clear()
            for tracked in self.running.values():
                if tracked.in_flight is not None or tracked.prefilled:
                    self._lose(tracked, previous.term, "the pipeline was replaced")
        if info is not None:
            self._admit()
        return self.expire()

    def _lose(self, tracked: Tracked, term: int, reason: str) -> None:
        if tracked.recover_by is not None:
            return
        self._leave_frames(tracked.run.request.request_id)
        tracked.lost = tracked.in_flight or tracked.lost
        tracked.resumed = tracked.resumed or not tracked.prefilling
        tracked.in_flight = None
        tracked.ahead.clear()
        tracked.recover_by = self.clock() + self.limits.recovery_timeout_s
        tracked.failed_term = term
        logger.warning(
            "request %s: pipeline lost (%s); waiting up to %.0fs for recovery",
            tracked.run.request.request_id,
            reason,
            self.limits.recovery_timeout_s,
        )

    def _leave_frames(self, request_id: str) -> None:
        """The request waits on none of the frames in the pipe any more (its pipeline
        was lost: it reads its tokens again in a new epoch): a frame left with nothing
        outstanding is over, so that it does not count as waiting (the local stall
        rule, the round timeout) after a break failed its segments with an answer
        that names no frame."""
        for frame_id, sent in list(self.frames.items()):
            if request_id in sent.outstanding:
                sent.outstanding.discard(request_id)
                if _only_ends(sent):
                    del self.frames[frame_id]

    def expire(self) -> list[Outcome]:
        """Round timeouts and recovery deadlines; requests whose pipeline came back
        start re-reading their tokens."""
        now = self.clock()
        outcomes: list[Outcome] = []
        for frame_id, sent in list(self.frames.items()):
            if now - sent.sent_at > self.limits.round_timeout_s:
                if self.frames.pop(frame_id, None) is None:
                    continue  # its requests were lost meanwhile: nothing waits on it
                if sent.term == self._term():
                    self.unanswered_term = sent.term
                for session in sent.outstanding:
                    tracked = self.running.get(session)
                    if tracked is not None and tracked.in_flight is not None:
                        if tracked.in_flight.frame_id == frame_id:
                            self._lose(tracked, sent.term, "no answer in time")
        info = self.info
        for tracked in self.running.values():
            flight = tracked.in_flight
            if (
                flight is not None
                and flight.frame_id
                and flight.frame_id not in self.frames
                and tracked.recover_by is None
                and flight.expected.term == self._term()
            ):
                # Its frame came back whole without an answer this core took for it
                # (none of the rules above should allow that): never wait forever.
                self._reread(tracked, f"frame {flight.frame_id} came back without its answer")
        for request_id, tracked in list(self.running.items()):
            if tracked.recover_by is None:
                continue
            if info is not None and info.term > tracked.failed_term:
                tracked.recover_by = None
                tracked.prefilled = 0
                tracked.prompt_frame = 0
                tracked.prefilling = True
                self.recoveries += 1
                logger.info(
                    "request %s resumes on term %s: re-reading %s tokens",
                    request_id,
                    info.term,
                    len(tracked.run.tokens),
                )
            elif now > tracked.recover_by:
                outcomes.append(self._fail(request_id, Unavailable(
                    f"the pipeline did not recover within {self.limits.recovery_timeout_s:.0f}s "
                    f"for request {request_id}; retry the request"
                )))  # fmt: skip
        return outcomes

    # ---- steps -----------------------------------------------------------------------

    def next_frame(self) -> Frame | None:
        """Pack the next step, or None when there is nothing to send (or the pipe is
        full)."""
        info = self.info
        if info is None:
            return None
        if sum(1 for f in self.frames.values() if not f.prompts_ahead) >= self._frame_cap(info):
            return self._prompts_ahead(info)
        segments = self._take_ends()
        rows = 0
        now = self.clock()
        budget = info.step_tokens or self.limits.step_tokens
        ready = self._spread([t for t in self.running.values() if self._decodes(t)], info)
        share = self._draft_share(len(ready), budget)
        # Alone, a request's own window policy weighs its drafts against its round
        # time; the step rule is about what its drafts cost the others in the step.
        threshold = row_threshold(self.step_cost.model(), len(ready)) if len(ready) > 1 else 0.0
        for tracked in ready:
            segment = self._decode_segment(tracked, info.term, share, threshold, now)
            segments.append(segment)
            rows += segment.token_count
        prompt_cap = self._prompt_rows(rows, budget)
        for tracked in self._prompt_order(info, now):
            room = min(budget, prompt_cap) - rows
            if room <= 0:
                break
            if tracked.prefilling and tracked.in_flight is None and tracked.recover_by is None:
                if self._waits_for_fork(tracked):
                    continue
                segment = self._prefill_segment(tracked, info.term, room, now)
                segments.append(segment)
                rows += segment.token_count
        for segment in self._ahead_segments(info, budget - rows, budget, now):
            segments.append(segment)
            rows += segment.token_count
        if not segments:
            return None
        return self._pack(segments, info, now)

    def _prompt_order(self, info: PipelineInfo, now: float) -> list[Tracked]:
        """The running requests in the order their prompt chunks take a step's room:
        admission order, except that a prompt whose session is open on the stages and
        has waited a third of their idle timeout behind the others goes first (the
        stages would otherwise drop its session as idle before it is read)."""
        idle_s = info.session_idle_s
        if idle_s <= 0:
            return list(self.running.values())

        def waited_long(tracked: Tracked) -> bool:
            return bool(tracked.prefilled) and now - tracked.touched > idle_s / 3

        return sorted(self.running.values(), key=lambda t: not waited_long(t))

    def _prompt_rows(self, decode_rows: int, budget: int) -> int:
        """The rows a frame may hold with its prompt chunks: the step budget, or while
        requests decode (their next tokens wait for this frame, on every stage) what
        keeps the frame near ``limits.decode_stall_ms`` by the measured cost of
        prompt frames, and at least MIN_PROMPT_ROWS of prompt (a long prompt still
        progresses). Until prompt frames of different sizes were measured, their cost
        per row with the fixed cost counted in (an overestimate: smaller chunks)
        stands in. And a frame holds at most twice the rows of the largest prompt
        frame measured (FIRST_PROMPT_ROWS before any): a fit of small frames alone
        cannot see what rows cost (on a slow link between hosts a few 20-row frames
        cost 0.4-0.9 s each, the fit saw no growth, and the next chunk of 512 rows
        held the decoding streams for 20 s), so chunks grow by doubling while the
        fit learns."""
        stall_ms = self.limits.decode_stall_ms
        if stall_ms <= 0 or all(t.prefilling for t in self.running.values()):
            return budget
        model = self.prompt_cost.model()
        per_row = self.prompt_cost.cost_per_row()
        if model is not None and model[1] > 0:
            fixed_ms, per_row_ms = model
            rows = int((stall_ms - fixed_ms) / per_row_ms)
        elif model is None and per_row:
            rows = int(stall_ms / per_row)
        else:
            rows = budget  # the fit sees no cost growing with rows
        seen = self.prompt_cost.max_rows
        rows = min(rows, 2 * seen if seen else decode_rows + FIRST_PROMPT_ROWS)
        return min(budget, max(rows, decode_rows + MIN_PROMPT_ROWS))

    def _take_ends(self) -> list[Segment]:
        """The END segments not sent yet: they go first in the next frame, ahead of
        any new prompt (a stage frees, or keeps as a prefix, the sessions they end
        before it opens the frame's new sessions)."""
        ends, self._ends = self._ends, []
        return ends

    def _pack(
        self, segments: list[Segment], info: PipelineInfo, now: float, prompts_ahead: bool = False
    ) -> Frame:
        """Number the frame, remember it as sent, and return it."""
        frame_id = self._next_frame_id
        self._next_frame_id += 1
        self._claim_flights(frame_id)
        if all(s.kind is SegmentKind.END for s in segments):
            # No request waits on an END: a frame of ENDs alone is not tracked. (A
            # stage that cannot run a frame fails its segments but its ENDs, so one
            # lost to a break would have counted as waiting until its round timeout,
            # holding /health at 503 while nothing else ran.)
            return Frame(info.term, frame_id, tuple(segments))
        self.frames[frame_id] = SentFrame(
            frame_id=frame_id,
            term=info.term,
            sent_at=now,
            rows=sum(s.token_count for s in segments),
            outstanding={s.session_id for s in segments},
            kinds={s.session_id: s.kind for s in segments},
            sources={s.prefix_from for s in segments if s.prefix_from},
            prompts_ahead=prompts_ahead,
        )
        return Frame(info.term, frame_id, tuple(segments))

    def _claim_flights(self, frame_id: int) -> None:
        """Segments just made wait for frame ``frame_id``'s answer."""
        for tracked in self.running.values():
            for flight in ahead.windows(tracked):
                if flight.frame_id == 0:
                    flight.frame_id = frame_id

    def _spread(self, ready: list[Tracked], info: PipelineInfo) -> list[Tracked]:
        """The decoding requests this frame takes: with S stages, at most 1/S of the
        requests decoding (rounded up), so that the S frames in the pipe are about
        the same size and every stage's step costs about the same. Taking every
        ready request made groups that never mix (8 streams over 2 stages ran as a
        frame of 1 and a frame of 7, the small frame's stage waiting on the large
        one's). Requests left for the next frame go first next time."""
        if info.stage_count < 2 or len(ready) <= 1:
            return ready
        decoding = sum(1 for t in self.running.values() if not t.prefilling)
        per_frame = -(-decoding // info.stage_count)
        if len(ready) > per_frame:
            ready = sorted(ready, key=lambda t: -t.passed_over)
        taken, left = ready[:per_frame], ready[per_frame:]
        for tracked in taken:
            tracked.passed_over = 0
        for tracked in left:
            tracked.passed_over += 1
        return taken

    def _frame_cap(self, info: PipelineInfo) -> int:
        """Frames in the pipe at once: one per stage, or as many as the deepest
        request's windows in flight."""
        deepest = max((t.depth for t in self.running.values()), default=1)
        return max(1, info.stage_count, deepest)

    def _ahead_segments(
        self, info: PipelineInfo, room: int, budget: int, now: float
    ) -> list[Segment]:
        """Windows drafted ahead for requests whose windows in flight are fewer than
        their chosen depth. Only while the batch leaves the pipe idle: with as many
        requests decoding as there are stages, every stage already has work."""
        decoding = [t for t in self.running.values() if not t.prefilling]
        if self.limits.max_depth <= 1 or len(decoding) >= max(1, info.stage_count):
            for tracked in decoding:
                tracked.depth = 1
            return []
        segments: list[Segment] = []
        share = self._draft_share(len(decoding), budget)
        for tracked in decoding:
            if room <= 0 or not ahead.may_draft_ahead(tracked):
                continue
            window = self._window(tracked.run, share)
            tracked.depth = ahead.pick_depth(tracked, window, self.step_s, self.limits.max_depth)
            if 1 + len(tracked.ahead) >= tracked.depth:
                continue
            segment = ahead.ahead_segment(tracked, info.term, min(window, room - 1), now)
            if segment is None:
                continue
            segments.append(segment)
            room -= segment.token_count
            self.ahead.sent += 1
            run = tracked.run
            run.ahead_sent += 1
            run.deepest = max(run.deepest, 1 + len(tracked.ahead))
        return segments

    @staticmethod
    def _decodes(tracked: Tracked) -> bool:
        return not tracked.prefilling and tracked.in_flight is None and tracked.recover_by is None

    def _draft_share(self, ready: int, step_tokens: int) -> int:
        """Draft rows each speculating request may add to this step: the step's draft
        budget shared among the requests decoding in it, within the token budget."""
        if ready == 0:
            return 0
        budget = min(self.limits.draft_tokens, max(0, step_tokens - ready))
        return budget // ready

    def _decode_segment(
        self, tracked: Tracked, term: int, share: int, threshold: float, now: float
    ) -> Segment:
        run = tracked.run
        if run.telemetry is not None:
            alpha = acceptance(run.telemetry.drafted, run.telemetry.accepted)
            share = paying_window(alpha, threshold, share)
        drafts, draft_s = self._propose(run, share)
        session = run.request.request_id
        segment = Segment(
            request_id=session,
            session_id=session,
            kind=SegmentKind.VERIFY if drafts else SegmentKind.DECODE,
            pos_start=run.position,
            token_ids=(run.tokens[-1], *drafts),
            epoch=tracked.epoch,
        )
        tracked.in_flight = InFlight(segment, Expected.for_segment(segment, term), 0, now)
        tracked.in_flight.drafts, tracked.in_flight.draft_s = drafts, draft_s
        return segment

    def _window(self, run: RequestRun, share: int) -> int:
        """Drafts the request's policy wants in its next window, within ``share``."""
        if run.drafter is None or share <= 0:
            return 0
        context = RoundContext(
            tokens_left=run.tokens_left(),
            draft_share=share,
            draft_cost_per_token_s=run.drafter.cost_per_token_s,
        )
        window = plan_window(run.policy, context)
        if run.request.max_window:
            window = min(window, run.request.max_window)
        return window

    def _propose(self, run: RequestRun, share: int) -> tuple[list[int], float]:
        window = self._window(run, share)
        if window <= 0:
            return [], 0.0
        started = self.clock()
        drafts = ahead.through_stop(run.drafter.propose(window), run.request.stop_token_ids)
        return drafts, self.clock() - started

    # ---- results -------------------------------------------------------------------

    def on_result(self, result: FrameResult) -> list[Outcome]:
        """Apply the answers of one frame (or the failures of some of its segments)."""
        sent = self.frames.get(result.frame_id)
        if sent is not None and self.info is not None and sent.term == self.info.term:
            now = self.clock()
            self.rounds.append((now, now - sent.sent_at))
        if sent is not None and result.timings and sent.term == result.term:
            # The last stage's answer: the cost of a frame of decode and verify rows on
            # its slowest stage (prompt chunks run in another regime of the kernels).
            slowest_ms = max(t.compute_ms for t in result.timings)
            staged_ms = sum(t.compute_ms + t.queue_ms for t in result.timings)
            wire_ms = max(0.0, (self.clock() - sent.sent_at) * 1000.0 - staged_ms)
            if SegmentKind.PREFILL in sent.kinds.values():
                link_ms = self._link_ms(wire_ms, result)
                self.prompt_cost.observe(sent.rows, max(slowest_ms, link_ms))
                logger.debug(
                    "prompt frame %d of %d rows: compute %.1f ms, link %.1f ms",
                    result.frame_id,
                    sent.rows,
                    slowest_ms,
                    link_ms,
                )
            if all(k in (SegmentKind.DECODE, SegmentKind.VERIFY) for k in sent.kinds.values()):
                self.wire_base_ms = ahead.average(self.wire_base_ms, wire_ms)
                self.step_cost.observe(sent.rows, slowest_ms)
                step_s = slowest_ms / 1000.0
                self.step_s = (
                    step_s
                    if self.step_s <= 0.0
                    else ((1.0 - ahead.EWMA) * self.step_s + ahead.EWMA * step_s)
                )
        if self.unanswered_term and result.term == self.unanswered_term:
            self._answers_again(result.term)
        outcomes: list[Outcome] = []
        for answer in result.results:
            if sent is not None:
                sent.outstanding.discard(answer.session_id)
            outcome = self._apply(answer, result.term, result.frame_id)
            if outcome is not None:
                outcomes.append(outcome)
        if sent is not None and (
            not sent.outstanding
            or (any(a.error is not None for a in result.results) and _only_ends(sent))
        ):
            # Every segment is answered, or the frame failed and only ENDs are left:
            # a stage fails every segment of a frame it cannot run but its ENDs (no
            # request waits on an END), so theirs never come. Kept, the frame would
            # count as waiting (the local stall rule held /health at 503) until its
            # round timeout, and the pipe would hold one frame fewer.
            self.frames.pop(result.frame_id, None)
        return outcomes

    def _link_ms(self, wire_ms: float, result: FrameResult) -> float:
        """How long a prompt frame held one data link: its round outside the stages
        beyond what a decode frame's takes (the links' latency), shared by the
        forward hops that carried its activations. A decode frame's next tokens wait
        behind it on that link as they would behind its compute: on a slow link
        (a few Mbit/s between hosts) this, not the stages, is what the
        ``decode_stall_ms`` cut must bound. 0 until a decode frame was measured."""
        if self.wire_base_ms < 0.0:
            return 0.0
        hops = max(1, len(result.timings) - 1)
        return max(0.0, wire_ms - self.wire_base_ms) / hops

    def _apply(self, answer: SegmentResult, term: int, frame_id: int) -> Outcome | None:
        tracked = self.running.get(answer.request_id)
        if tracked is None:
            if answer.error is not None or answer.token_ids:
                self.stale.append("unclaimed")
                self._end_unclaimed(answer, term)
            return None
        if answer.dropped:
            self.ahead.dropped_by_last_stage += 1
        if answer.epoch != tracked.epoch:
            if answer.error is not None or answer.token_ids:
                self.stale.append("epoch")
            return None
        flight = tracked.in_flight
        if (answer.prompt_logprobs or answer.pooled) and not answer.token_ids and not answer.error:
            # A scored (or pooled) chunk of a longer prompt: its answer's pos_start
            # is the first position it scores (one past the chunk's start).
            if term == self._term() and tracked.recover_by is None:
                tracked.run.record_prompt_scores(answer.pos_start, answer.prompt_logprobs)
                if answer.pooled:
                    tracked.run.record_pooled(answer.pos_start - 1, answer.pooled)
            return None
        if flight is None or flight.frame_id != frame_id:
            if answer.error is not None and term == self._term() and tracked.recover_by is None:
                # A prompt chunk sent without waiting failed on its way.
                if flight is None or answer.pos_start <= flight.segment.pos_start:
                    return self._error(tracked, answer, term)
            if answer.error is not None or answer.token_ids:
                self.stale.append("term" if term != self._term() else "unclaimed")
            return None
        reason = stale_reason(answer, term, flight.expected)
        if reason is not None:
            self.stale.append(reason)
            logger.warning(
                "request %s: dropped a %s of term %s at position %s (%s mismatch)",
                answer.request_id,
                "error" if answer.error is not None else "result",
                term,
                answer.pos_start,
                reason,
            )
            return None
        if answer.error is not None:
            return self._error(tracked, answer, term)
        if answer.dropped:
            # The last stage refuted a window this core took as live: start again
            # from the committed tokens (never seen when both sides agree).
            tracked.in_flight = None
            ahead.drop_ahead(tracked, self.ahead)
            return None
        return self._commit(tracked, flight, answer)

    def _end_unclaimed(self, answer: SegmentResult, term: int) -> None:
        """END, once, the session of a result no running request owns: a session the
        stages opened for frames this core never sent (a faulty peer) or that outlived
        its request would otherwise hold a slot on every stage until the idle sweep."""
        session = answer.session_id
        if term != self._term() or session in self._unclaimed_ended:
            return
        if any(t.run.request.request_id == session for t in self.running.values()):
            return
        self._unclaimed_ended[session] = None
        while len(self._unclaimed_ended) > UNCLAIMED_ENDS_KEPT:
            self._unclaimed_ended.popitem(last=False)
        self._ends.append(Segment(answer.request_id, session, SegmentKind.END, 0))

    def _term(self) -> int:
        return self.info.term if self.info is not None else 0

    def _error(self, tracked: Tracked, answer: SegmentResult, term: int) -> Outcome | None:
        error = answer.error.to_error()  # type: ignore[union-attr]
        if isinstance(error, PrefixMissing) and tracked.prefix_from:
            self._read_again(tracked, error)
            return None
        if isinstance(error, NotFound) and term == self._term():
            # A stage no longer holds the session (its idle sweep, a stage that
            # dropped it): nothing the client did. Read its tokens again from 0.
            if tracked.rereads < MAX_REREADS:
                self._reread(tracked, error.message)
                return None
            return self._fail(
                tracked.run.request.request_id,
                Unavailable(
                    f"a stage lost the session of request {tracked.run.request.request_id} "
                    f"{tracked.rereads + 1} times ({error.message}); retry the request"
                ),
            )
        if isinstance(error, (Unavailable, StaleTerm)) and self.limits.recovery_timeout_s > 0:
            self._lose(tracked, term, error.message)
            return None
        if isinstance(error, StaleTerm):
            error = Unavailable(f"the pipeline moved on from term {term}: {error.message}")
        return self._fail(tracked.run.request.request_id, error)

    def _answers_again(self, term: int) -> int:
        """An answer of ``term`` came after one of its frames went unanswered past the
        round timeout (a stage that hung woke up, a link that dropped packets passes
        them again) and no new pipeline replaced it: the pipeline moves again. The
        requests that lost their frames to the timeout read their tokens again on it
        (a new epoch: the late answers of their old frames are void) rather than wait
        for a pipeline only a coordinator could load."""
        self.unanswered_term = 0
        resumed = 0
        for tracked in self.running.values():
            if tracked.recover_by is None or tracked.failed_term != term:
                continue
            tracked.recover_by = None
            tracked.read_from_zero()
            self.recoveries += 1
            resumed += 1
            logger.info(
                "request %s resumes on term %s, which answers again: re-reading %s tokens",
                tracked.run.request.request_id,
                term,
                len(tracked.run.tokens),
            )
        return resumed

    def links_reopened(
        self, term: int, why: str, answered_upto: int = 0, resume: bool = True
    ) -> None:
        """A data link of ``term`` broke and a stage opened it again, no coordinator
        having replaced the pipeline (``StageNode._repair``). A stage that opened its
        Return link again had finished the term's frames up to ``answered_upto``
        before: the answers (or refusals) of those still waiting went with the old
        link, so those frames are given up and their requests wait as lost (later
        frames are answered on the new link). With ``resume`` (stage 0's own Forward
        link is whole) every request the break lost reads its tokens again on the
        same pipeline (``_answers_again``: a new epoch, late answers of old frames
        are void); without it, they wait for that link."""
        if self.info is None or self.info.term != term:
            return
        voided = [f for f, sent in self.frames.items() if sent.term == term and f <= answered_upto]
        for frame_id in voided:
            sent = self.frames.pop(frame_id, None)
            for session in sent.outstanding if sent is not None else ():
                tracked = self.running.get(session)
                if tracked is not None:
                    self._lose(tracked, term, f"{why}: the answer of frame {frame_id} is lost")
        resumed = self._answers_again(term) if resume else 0
        lost = sum(1 for t in self.running.values() if t.recover_by is not None)
        logger.warning(
            "term %s: %s; %d frame(s) up to frame %d given up; %s",
            term,
            why,
            len(voided),
            answered_upto,
            f"{resumed} request(s) the break lost read their tokens again"
            if resume
            else f"{lost} request(s) the break lost wait for stage 0's own link",
        )

    def _reread(self, tracked: Tracked, why: str) -> None:
        """Void what the request has in the pipe and read its tokens (prompt and
        those it produced) again from position 0 in a new epoch; the answer of the
        re-read stands for the step that was lost, as after a failover."""
        tracked.rereads += 1
        self.rereads += 1
        logger.warning(
            "request %s: %s; reading its %s tokens again from position 0",
            tracked.run.request.request_id,
            why,
            len(tracked.run.tokens),
        )
        tracked.lost = tracked.in_flight or tracked.lost
        tracked.resumed = tracked.resumed or not tracked.prefilling
        tracked.read_from_zero()

    def _fail(self, request_id: str, error: MeshError) -> Outcome:
        self.cancel(request_id, keep=False)
        return Outcome(request_id, error=error)

    def _commit(self, tracked: Tracked, flight: InFlight, answer: SegmentResult) -> Outcome:
        run = tracked.run
        now = self.clock()
        tracked.in_flight = None
        emitted = list(answer.token_ids)
        if answer.prompt_logprobs:
            run.record_prompt_scores(flight.segment.pos_start + 1, answer.prompt_logprobs)
        if flight.segment.kind is SegmentKind.PREFILL:
            tracked.prefilling = False
            lost, tracked.lost = tracked.lost, None
            if not tracked.resumed:
                run.prompt_ms = (now - run.started) * 1000.0
                run.decode_started = now
                if run.drafter is not None:
                    run.drafter.extend(emitted)
            else:
                tracked.resumed = False
                drafts = lost.drafts if lost is not None else []
                run.recovered = True
                run.observe(drafts, 0, emitted, 0.0, 0.0)
                run.recovered = False
        else:
            accepted = answer.accepted_count
            ahead.observe_round(tracked, now - flight.sent_at, len(flight.drafts), accepted)
            run.observe(flight.drafts, accepted, emitted, now - flight.sent_at, flight.draft_s)
        if answer.pooled:
            run.record_pooled(flight.segment.pos_start, answer.pooled)
        try:
            if flight.segment.score:
                run.finish_prompt_scores()
            if flight.segment.pooling is not Pooling.NONE:
                run.finish_pooled(flight.segment.pos_start)
        except Unavailable as error:
            return self._fail(run.request.request_id, error)
        event = run.commit(emitted, answer.logprobs)
        if event.finish_reason is not None:
            self.cancel(run.request.request_id)
            if run.ahead_sent:
                # The windows ahead it ended with are wasted: in its figures too.
                event = replace(event, stats=run.stats())
        elif flight.segment.kind is not SegmentKind.PREFILL:
            ahead.settle(tracked, flight, answer.accepted_count, self.ahead)
        return Outcome(run.request.request_id, event=event)

    def oldest_unanswered(self) -> tuple[int, float, float] | None:
        """The oldest frame of the current term still waiting for its answer: its id,
        when it was sent (this core's clock) and the long round of the latest ones
        (``long_round``; 0: none answered lately); None when nothing of this term is in the pipe."""
        info = self.info
        if info is None:
            return None
        current = [f for f in self.frames.values() if f.term == info.term]
        if not current:
            return None
        oldest = min(current, key=lambda f: f.frame_id)
        return oldest.frame_id, oldest.sent_at, self.long_round()

    def long_round(self) -> float:
        """The stall rule's "longest recent round": the ROUND_PERCENTILE (nearest rank)
        of the rounds answered in the last ROUND_MAX_AGE_S; 0 when none."""
        since = self.clock() - ROUND_MAX_AGE_S
        recent = sorted(r for at, r in self.rounds if at >= since)
        if not recent:
            return 0.0
        return recent[math.ceil(ROUND_PERCENTILE * len(recent)) - 1]

    def recovering(self, term: int) -> bool:
        """Whether a request that lost its frames on ``term`` still waits for the
        pipeline to come back (its recovery deadline has not passed)."""
        return any(
            t.recover_by is not None and t.failed_term == term for t in self.running.values()
        )

    def in_flight_sessions(self) -> Iterator[str]:
        for request_id, tracked in self.running.items():
            if tracked.in_flight is not None:
                yield request_id


def _only_ends(sent: SentFrame) -> bool:
    """Whether nothing but END segments of frame ``sent`` waits for an answer (none:
    true); a request waits on no END."""
    return all(sent.kinds.get(s) is SegmentKind.END for s in sent.outstanding)
