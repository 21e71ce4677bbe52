"""One request's progress on stage 0: every token so far, the speculation state
(drafter, window policy, telemetry), and the commit rule for emitted tokens."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from mesh.errors import Unavailable
from mesh.speculative import Telemetry
from stage.frontend.backend import GenerationRequest, GenerationStats, TokenEvent


class RequestRun:
    """One request's progress: every token so far, speculation state, counters."""

    def __init__(self, request: GenerationRequest, speculation) -> None:
        self.request = request
        self.tokens: list[int] = list(request.prompt_tokens)
        self.produced = 0
        # Prompt positions its session started with from a kept prefix.
        self.cached_tokens = 0
        self.term = 0
        self.recovered = False
        self.prompt_ms = 0.0
        # On the engine core's clock (time.perf_counter when serving).
        self.started = time.perf_counter()
        self.decode_started = self.started
        self.drafter = self.policy = None
        self.strategy = ""
        self.telemetry: Telemetry | None = None
        # Verify windows drafted ahead of a verdict: sent, dropped (a verdict refuted
        # them), their rows, and the deepest the request went.
        self.ahead_sent = 0
        self.ahead_dropped = 0
        self.ahead_wasted = 0
        self.deepest = 1
        # A scored prompt (``request.score_prompt``): the scores received, by
        # position, until the prompt's last chunk is answered; then handed out once
        # with the first event.
        self.prompt_scores: dict[int, Any] = {}
        self.prompt_scored = False
        self._scores_out: tuple[Any, ...] = ()
        # An embedded prompt (``request.pooling``): the rows each chunk sent to be
        # pooled covers (by its first position, as last sent) and what came back;
        # the prompt's embedding once its last chunk is answered, handed out once.
        self.pooled_sizes: dict[int, int] = {}
        self.pooled_parts: dict[int, tuple[float, ...]] = {}
        self.embedded = False
        self._embedding_out: tuple[float, ...] = ()
        if speculation is not None:
            self.drafter, self.policy, self.strategy = speculation
            self.telemetry = Telemetry()

    @property
    def position(self) -> int:
        """Absolute position of the last committed token (the next frame's pos_start)."""
        return len(self.tokens) - 1

    def tokens_left(self) -> int:
        return self.request.max_new_tokens - self.produced

    def record_prompt_scores(self, first: int, entries: Sequence[Any]) -> None:
        """Scores of the prompt positions ``first ...`` (those past the prompt, which
        a re-read after a recovery may carry, are not the prompt's)."""
        if self.prompt_scored:
            return
        for position, entry in enumerate(entries, start=first):
            if 0 < position < len(self.request.prompt_tokens):
                self.prompt_scores[position] = entry

    def finish_prompt_scores(self) -> None:
        """The prompt's last chunk was answered: every position after the first must
        have its score (raises Unavailable otherwise, never a partial answer)."""
        if self.prompt_scored:
            return
        length = len(self.request.prompt_tokens)
        missing = [p for p in range(1, length) if p not in self.prompt_scores]
        if missing:
            raise Unavailable(
                f"request {self.request.request_id}: the scores of {len(missing)} of "
                f"{length - 1} prompt positions never came back; retry the request"
            )
        self._scores_out = tuple(self.prompt_scores[p] for p in range(1, length))
        self.prompt_scores = {}
        self.prompt_scored = True

    def record_pooled(self, start: int, values: Sequence[float]) -> None:
        """The pooled rows of the chunk that starts at ``start``."""
        if not self.embedded:
            self.pooled_parts[start] = tuple(values)

    def finish_pooled(self, final_start: int) -> None:
        """The prompt's last chunk (from ``final_start``) was answered: its embedding
        from the chunks that tile the prompt (raises Unavailable when one never came
        back)."""
        if self.embedded:
            return
        length = len(self.request.prompt_tokens)
        if self.request.pooling == "last":
            parts = [self.pooled_parts.get(final_start)]
        else:
            parts, at = [], 0
            while at < length and at in self.pooled_sizes:
                parts.append(self.pooled_parts.get(at))
                at += self.pooled_sizes[at]
            if at != length:
                parts.append(None)
        if any(part is None for part in parts):
            raise Unavailable(
                f"request {self.request.request_id}: a part of the prompt's embedding never "
                "came back; retry the request"
            )
        total = [sum(column) for column in zip(*parts, strict=True)]
        scale = 1.0 / length if self.request.pooling == "mean" else 1.0
        self._embedding_out = tuple(value * scale for value in total)
        self.pooled_sizes, self.pooled_parts = {}, {}
        self.embedded = True

    def commit(self, emitted: list[int], logprobs: Sequence[Any] = ()) -> TokenEvent:
        """Commit emitted tokens up to a stop token or the token budget (with their
        log-probabilities, when the request asked for them)."""
        finish = None
        out: list[int] = []
        if self.tokens_left() <= 0:  # a scored or embedded prompt, nothing to generate
            emitted, finish = [], "length"
        for token in emitted:
            if token in self.request.stop_token_ids:
                finish = "stop"
                break
            out.append(token)
            if self.produced + len(out) >= self.request.max_new_tokens:
                finish = "length"
                break
        self.produced += len(out)
        self.tokens.extend(out)
        return TokenEvent(
            token_ids=tuple(out),
            finish_reason=finish,
            stats=self.stats(),
            logprobs=tuple(logprobs[: len(out)]),
            prompt_logprobs=self._take_scores(),
            embedding=self._take_embedding(),
        )

    def _take_embedding(self) -> tuple[float, ...]:
        embedding, self._embedding_out = self._embedding_out, ()
        return embedding

    def _take_scores(self) -> tuple[Any, ...]:
        scores, self._scores_out = self._scores_out, ()
        return scores

    def observe(
        self,
        drafts: list[int],
        accepted: int,
        emitted: list[int],
        round_s: float,
        draft_s: float,
    ) -> None:
        if self.drafter is None or not emitted:
            return
        if drafts:
            self.drafter.accept(accepted, emitted[-1], drafts)
        else:
            self.drafter.extend(emitted)
        if not self.recovered:
            self.policy.observe(len(drafts), accepted, round_s, draft_s)
        self.telemetry.record_round(len(drafts), accepted, len(emitted), round_s, draft_s)

    def stats(self) -> GenerationStats:
        speculation: dict[str, float] = {}
        if self.telemetry is not None:
            t = self.telemetry
            speculation = {
                "drafted": t.drafted,
                "accepted": t.accepted,
                "accept_rate": round(t.accept_rate, 4),
                "windows": t.windows,
                "tokens_per_round": round(t.mean_tokens_per_round, 4),
            }
            if self.ahead_sent:
                speculation.update(
                    windows_ahead=self.ahead_sent,
                    windows_dropped=self.ahead_dropped,
                    wasted_tokens=self.ahead_wasted,
                    depth=self.deepest,
                )
        return GenerationStats(
            prompt_tokens=len(self.request.prompt_tokens),
            completion_tokens=self.produced,
            prompt_ms=self.prompt_ms,
            decode_ms=(time.perf_counter() - self.decode_started) * 1000.0,
            speculation=speculation,
            cached_tokens=self.cached_tokens,
        )
