"""One request's progress on stage 0: every token so far, the speculation state
(drafter, window policy, telemetry), and the commit rule for emitted tokens."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

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
        if speculation is not None:
            self.drafter, self.policy, self.strategy = speculation
            self.telemetry = Telemetry()

    @property
    def position(self) -> int:
        """Absolute position of the last committed token (the next frame's pos_start)."""
        return len(self.tokens) - 1

    def tokens_left(self) -> int:
        return self.request.max_new_tokens - self.produced

    def commit(self, emitted: list[int], logprobs: Sequence[Any] = ()) -> TokenEvent:
        """Commit emitted tokens up to a stop token or the token budget (with their
        log-probabilities, when the request asked for them)."""
        finish = None
        out: list[int] = []
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
        )

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
