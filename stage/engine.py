"""The stage engine: applies frames of segments to a layer-range runtime. Plain
torch, no network.

The node hands a decoded frame to ``StageEngine.process`` and sends what comes out:
a frame with the activations of the segments that ran for the next stage, or (on
the last stage) one FrameResult answering every segment, plus the failures of
single segments for stage 0. The last stage samples with each session's seeded
sampler and verifies speculative windows losslessly.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from mesh.errors import InvalidRequest, MeshError
from mesh.frames import (
    Frame,
    FrameResult,
    Pooling,
    Segment,
    SegmentKind,
    SegmentResult,
    StageTiming,
    TokenLogprob,
)
from mesh.grammar import OutputConstraint, TokenGrammars, mask_rows
from mesh.runtime import BatchOutput, Span, StageRuntime
from mesh.sampling import sample_token, token_logprob
from mesh.speculative.verify import verify_window
from mesh.types import SamplingParams

logger = logging.getLogger(__name__)

# Rows of a scored prompt chunk turned into log-probabilities at a time.
SCORE_ROWS = 64


@dataclass(frozen=True)
class EngineOutput:
    """What a processed frame produces: the frame for the next stage (not on the
    last stage), the answer for stage 0 (the last stage), and the segments that
    failed here (any stage; on the last stage they are part of ``result``)."""

    forward: Frame | None = None
    result: FrameResult | None = None
    failures: tuple[SegmentResult, ...] = ()


class StageEngine:
    """Runs frames through one stage's runtime. The runtime's session table is the
    one owner of a session's state (KV, length, request, sampling, last use)."""

    def __init__(
        self,
        runtime: StageRuntime,
        stage_index: int,
        term: int,
        grammars: TokenGrammars | None = None,
    ) -> None:
        self.runtime = runtime
        self.stage_index = stage_index
        self.term = term
        # Structured output (on the last stage): the compiler, and the grammar state
        # of each session that has a grammar (derived from its output tokens).
        self.grammars = grammars
        self._constraints: dict[str, OutputConstraint] = {}
        # Windows drafted ahead that this (last) stage dropped unrun.
        self.dropped_segments = 0

    @property
    def is_first(self) -> bool:
        return self.runtime.is_first

    @property
    def is_last(self) -> bool:
        return self.runtime.is_last

    def session_count(self) -> int:
        return len(self.runtime.sessions())

    def session_ids(self) -> list[str]:
        return self.runtime.sessions()

    def active_requests(self) -> list[tuple[str, str]]:
        """(session_id, request_id) of every session this stage holds."""
        return self.runtime.session_requests()

    def end_session(self, session_id: str) -> bool:
        """Free a session's KV and state; False when this stage did not hold it."""
        return self.runtime.drop_session(session_id)

    def expire_idle(self, idle_timeout_s: float) -> list[str]:
        """End sessions unused for longer than ``idle_timeout_s``."""
        return self.runtime.expire_idle(time.monotonic(), idle_timeout_s)

    def process(self, frame: Frame, queued_s: float = 0.0) -> EngineOutput:
        """Apply one frame: END segments drop their sessions, the others run in one
        batched forward pass. A segment that cannot run fails alone; an error that
        concerns the whole frame (its tensor) raises a MeshError."""
        started = time.perf_counter()
        computing: list[Segment] = []
        ending: list[Segment] = []
        for segment in frame.segments:
            (computing if segment.kind.computes else ending).append(segment)
        for segment in ending:
            if segment.keep_prefix:
                self.runtime.keep_prefix(segment.session_id, segment.pos_start)
            elif not segment.forget_prefix:
                self.end_session(segment.session_id)
        failures: list[SegmentResult] = []
        refuted = self._refuted(computing) if self.is_last else set()
        hidden = frame.hidden
        if refuted:
            hidden = _without_rows(frame, refuted)
            computing = [s for s in computing if id(s) not in refuted]
            self.dropped_segments += len(refuted)
        out = BatchOutput(None)
        if computing:
            out = self.runtime.forward_batch(
                [self._span(s) for s in computing], self._inputs(frame, computing, hidden)
            )
            for index, error in out.errors.items():
                failures.append(SegmentResult.failure(computing[index], error, self.stage_index))
        # After the frame's sessions have copied what they start from.
        for segment in ending:
            if segment.forget_prefix:
                self.runtime.forget_prefix(segment.session_id)
        timing = StageTiming(
            stage_index=self.stage_index,
            compute_ms=(time.perf_counter() - started) * 1000.0,
            queue_ms=queued_s * 1000.0,
        )
        timings = (*frame.timings, timing)
        ran = [(i, s) for i, s in enumerate(computing) if i not in out.errors]
        if not self.is_last:
            kept = {id(s) for _, s in ran}
            segments = tuple(s for s in frame.segments if id(s) in kept or not s.kind.computes)
            forward = None
            if segments:
                forward = Frame(frame.term, frame.frame_id, segments, out.rows, timings)
            return EngineOutput(forward=forward, failures=tuple(failures))
        # One answer per segment, so stage 0 knows when the frame has left the pipe:
        # tokens, an error, or (END, a prompt chunk) an empty acknowledgement.
        failed = {id(computing[i]): f for i, f in zip(out.errors, failures, strict=True)}
        before: dict[int, list[int]] = {}
        for _, s in ran:
            try:
                before[id(s)] = self.runtime.record_history(s.session_id, s.pos_start, s.token_ids)
            except InvalidRequest as error:
                failed[id(s)] = SegmentResult.failure(s, error, self.stage_index)
                failures.append(failed[id(s)])
        emitted: dict[int, SegmentResult] = {}
        for i, s in ran:
            if not s.emits or id(s) not in before:
                continue
            try:
                emitted[id(s)] = self._emit(s, out.of(i), before[id(s)], out.pooled.get(i))
            except MeshError as error:  # a grammar the output cannot follow
                failed[id(s)] = SegmentResult.failure(s, error, self.stage_index)
                failures.append(failed[id(s)])
        self._forget_constraints()
        for answer in emitted.values():
            if not answer.token_ids:  # a scored prompt chunk
                continue
            position = answer.pos_start + len(answer.token_ids) - 1
            self.runtime.set_verdict(answer.session_id, position, answer.token_ids[-1])
        answers = tuple(
            emitted.get(id(s)) or failed.get(id(s)) or _acknowledged(s, dropped=id(s) in refuted)
            for s in frame.segments
        )
        result = FrameResult(frame.term, frame.frame_id, answers, timings)
        return EngineOutput(result=result, failures=tuple(failures))

    # ---- internals --------------------------------------------------------------

    def _span(self, segment: Segment) -> Span:
        if not self.is_last or segment.kind is SegmentKind.VERIFY or segment.score:
            logit_rows = -1
        elif segment.kind is SegmentKind.PREFILL and not segment.sample:
            logit_rows = 0
        else:
            logit_rows = 1
        return Span(
            session_id=segment.session_id,
            pos_start=segment.pos_start,
            count=segment.token_count,
            logit_rows=logit_rows,
            creates=segment.kind is SegmentKind.PREFILL
            and (segment.pos_start == 0 or bool(segment.prefix_from)),
            request_id=segment.request_id,
            sampling=segment.sampling,
            prefix_from=segment.prefix_from,
            pooling="" if segment.pooling is Pooling.NONE else segment.pooling.value,
        )

    def _refuted(self, computing: list[Segment]) -> set[int]:
        """The windows drafted ahead whose assumption a verdict has refuted: the
        session's last emitted token is not at their ``pos_start``, or is not their
        first token (``id`` of each such segment)."""
        refuted: set[int] = set()
        for segment in computing:
            if segment.ahead:
                verdict = self.runtime.verdict(segment.session_id)
                if verdict != (segment.pos_start, segment.token_ids[0]):
                    refuted.add(id(segment))
        return refuted

    def _inputs(
        self, frame: Frame, computing: list[Segment], hidden: torch.Tensor | None
    ) -> torch.Tensor:
        if self.is_first:
            return torch.tensor([t for s in computing for t in s.token_ids], dtype=torch.long)
        if hidden is None:
            raise InvalidRequest(
                f"frame {frame.frame_id} carries no activations; stage {self.stage_index} "
                "takes hidden states from its upstream stage"
            )
        return hidden

    def _emit(
        self,
        segment: Segment,
        logits: torch.Tensor,
        before: list[int],
        pooled: torch.Tensor | None = None,
    ) -> SegmentResult:
        """The segment's tokens; ``before`` is the session's token ids before it (kept
        only where penalties use them); ``pooled``, a pooling segment's pooled rows."""
        sampling = self.runtime.session_sampling(segment.session_id)
        scored = self._score(segment, logits, sampling) if segment.score else ()
        pooled_values = tuple(pooled.tolist()) if pooled is not None else ()
        if segment.kind is SegmentKind.PREFILL and not segment.sample:
            return SegmentResult(
                request_id=segment.request_id,
                session_id=segment.session_id,
                # The first position scored (a chunk's answer has no flight to
                # place it by on stage 0).
                pos_start=segment.pos_start + 1,
                epoch=segment.epoch,
                prompt_logprobs=scored,
                pooled=pooled_values,
            )
        sampled = logits if segment.kind is SegmentKind.VERIFY else logits[-1:]
        if not bool(torch.isfinite(sampled).all()):
            raise MeshError(
                f"stage {self.stage_index} computed NaN or Inf logits for session "
                f"{segment.session_id}: the model overflows in its dtype (serve it in "
                "bfloat16 or float32) or its weights are damaged"
            )
        if sampling.grammar:
            logits = self._constrain(segment, logits, before, sampling)
        if segment.kind is SegmentKind.VERIFY:
            verdict = verify_window(
                logits, segment.token_ids, sampling, segment.pos_start + 1, before
            )
            emitted, accepted = list(verdict.emitted), verdict.accepted_count
            rows = [logits[i] for i in range(len(emitted))]
            # Row i follows the window's first i + 1 tokens (penalties see them).
            seens = [[*before, *segment.token_ids[: i + 1]] for i in range(len(emitted))]
        else:
            seen = [*before, *segment.token_ids] if sampling.uses_history else []
            emitted = [sample_token(logits[-1], sampling, segment.pos_end, seen)]
            accepted = 0
            rows, seens = [logits[-1]], [seen]
        logprobs: tuple[TokenLogprob, ...] = ()
        if sampling.top_logprobs >= 0:
            logprobs = tuple(
                TokenLogprob(*token_logprob(row, sampling, token, seen))
                for row, token, seen in zip(rows, emitted, seens, strict=True)
            )
        return SegmentResult(
            request_id=segment.request_id,
            session_id=segment.session_id,
            pos_start=segment.result_pos(),
            token_ids=tuple(emitted),
            accepted_count=accepted,
            epoch=segment.epoch,
            logprobs=logprobs,
            prompt_logprobs=scored,
            pooled=pooled_values,
        )

    def _score(
        self, segment: Segment, logits: torch.Tensor, sampling: SamplingParams
    ) -> tuple[TokenLogprob, ...]:
        """The log-probabilities of a scoring segment's ``scored_tokens``, row by
        row, under the model's own distribution, with ``top_logprobs`` alternatives."""
        targets = segment.scored_tokens
        if not targets:
            return ()
        vocab = logits.shape[-1]
        if min(targets) < 0 or max(targets) >= vocab:
            raise InvalidRequest(
                f"segment of request {segment.request_id!r}: a token to score is outside "
                f"the vocabulary [0, {vocab})"
            )
        top_k = min(max(sampling.top_logprobs, 0), vocab)
        scored: list[TokenLogprob] = []
        # In slices, so that a long chunk never holds float32 log-softmax of every row.
        for first in range(0, len(targets), SCORE_ROWS):
            # On the logits' device: only the chosen and top values leave it.
            wanted = torch.tensor(
                targets[first : first + SCORE_ROWS], dtype=torch.long, device=logits.device
            )
            rows = logits[first : first + len(wanted)].detach().float()
            logprobs = torch.log_softmax(rows, dim=-1)
            chosen = logprobs.gather(1, wanted[:, None])[:, 0].tolist()
            tops: list[tuple[tuple[int, float], ...]] = [()] * len(chosen)
            if top_k:
                values, indices = torch.topk(logprobs, top_k, dim=-1)
                tops = [
                    tuple(zip(i, v, strict=True))
                    for i, v in zip(indices.tolist(), values.tolist(), strict=True)
                ]
            scored.extend(TokenLogprob(c, t) for c, t in zip(chosen, tops, strict=True))
        return tuple(scored)

    def _constrain(
        self,
        segment: Segment,
        logits: torch.Tensor,
        before: list[int],
        sampling: SamplingParams,
    ) -> torch.Tensor:
        """The segment's logits rows with what the session's grammar forbids at each
        row set to -inf (row i of a verify window after its first i draft tokens)."""
        if self.grammars is None:
            raise InvalidRequest(
                f"stage {self.stage_index} is not the last stage and cannot apply a grammar"
            )
        constraint = self._constraints.get(segment.session_id)
        if constraint is None or constraint.spec != sampling.grammar:
            constraint = self.grammars.constraint(sampling.grammar, logits.shape[-1])
            self._constraints[segment.session_id] = constraint
        if segment.kind is SegmentKind.VERIFY:
            seen, drafts = [*before, segment.token_ids[0]], segment.token_ids[1:]
        else:
            seen, drafts = [*before, *segment.token_ids], ()
            logits = logits[-1:]
        return mask_rows(constraint, logits, seen[sampling.prompt_tokens :], drafts)

    def _forget_constraints(self) -> None:
        """Drop the grammar state of sessions this stage no longer holds."""
        if self._constraints:
            held = set(self.runtime.sessions())
            for session_id in [s for s in self._constraints if s not in held]:
                del self._constraints[session_id]


def _acknowledged(segment: Segment, dropped: bool = False) -> SegmentResult:
    return SegmentResult(
        request_id=segment.request_id,
        session_id=segment.session_id,
        pos_start=segment.pos_start if dropped else segment.pos_end,
        epoch=segment.epoch,
        dropped=dropped,
    )


def _without_rows(frame: Frame, left_out: set[int]) -> torch.Tensor | None:
    """The frame's activations without the rows of the segments in ``left_out``."""
    if frame.hidden is None:
        return None
    kept = [
        frame.hidden[first : first + count]
        for segment, first, count in frame.spans()
        if count and id(segment) not in left_out
    ]
    return torch.cat(kept) if kept else frame.hidden[:0]
