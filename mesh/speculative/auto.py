"""Auto gating for n-gram drafting: speculate only where it is likely to pay.

``AutoNgramDrafter`` starts cold: ``propose`` returns nothing, so requests decode
plainly with no verify overhead. It turns warm when

- the prompt text looks favourable (code, diffs, stack traces, JSON, tool calls,
  file paths: the answer tends to copy from the prompt), or
- observation finds repeats: while cold it keeps a "shadow" proposal (what it would
  have proposed) and checks it against the tokens actually committed; enough shadow
  hits among the recent trials turn it warm.

While warm it proposes through the wrapped n-gram drafter and backs off to cold when
the acceptance rate of its proposals falls too low. After a back-off only observed
hits (not the prompt) can warm it again.

The suffix drafter is gated the same way (its shadow trials see the shared corpus
too, so a request that repeats an earlier one warms up on its first hits).
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Sequence
from itertools import islice

from mesh.speculative.drafter import Drafter
from mesh.speculative.ngram import NgramDrafter
from mesh.speculative.suffix import SuffixDrafter

_DETECTORS: tuple[tuple[str, re.Pattern[str], int], ...] = (
    ("code-fence", re.compile(r"```|~~~"), 1),
    (
        "diff",
        re.compile(r"^(?:@@ -\d+(?:,\d+)? \+\d+(?:,\d+)? @@|diff --git |--- a/|\+\+\+ b/)", re.M),
        1,
    ),
    (
        "stack-trace",
        re.compile(
            r"Traceback \(most recent call last\)|^\s*File \".+\", line \d+"
            r"|^\s+at [\w$.<>]+\(.*\)\s*$",
            re.M,
        ),
        1,
    ),
    ("json", re.compile(r"[{\[]\s*\"[^\"\n]{1,80}\"\s*:"), 1),
    (
        "tool-call",
        re.compile(
            r"<tool_call>|\"tool_calls\"|\"function_call\"|\"arguments\"\s*:|<\|python_tag\|>"
        ),
        1,
    ),
    ("file-path", re.compile(r"(?<![\w/.])(?:\.{1,2}/|/)?(?:[\w.-]+/)+[\w-]+\.[A-Za-z]{1,6}\b"), 1),
    (
        "code",
        re.compile(
            r"^\s*(?:def |class |import |from \S+ import |return\b|function |const |let |"
            r"var |public |private |fn |func |#include\b)",
            re.M,
        ),
        2,
    ),
)


def prompt_signals(text: str) -> list[str]:
    """Names of the favourable patterns found in a prompt's text."""
    found = []
    for name, pattern, needed in _DETECTORS:
        if len(list(islice(pattern.finditer(text), needed))) >= needed:
            found.append(name)
    return found


class AutoNgramDrafter(Drafter):
    """Wraps an n-gram (or suffix) drafter with cold observation, warm-up and back-off."""

    name = "ngram-auto"

    def __init__(
        self,
        inner: NgramDrafter | SuffixDrafter,
        shadow_window: int = 4,
        hit_tokens: int = 2,
        warm_hits: int = 2,
        recent_trials: int = 8,
        min_rounds: int = 4,
        backoff_rate: float = 0.3,
        rate_decay: float = 0.7,
    ) -> None:
        super().__init__()
        self.inner = inner
        if isinstance(inner, SuffixDrafter):
            self.name = "suffix-auto"
        self.shadow_window = shadow_window
        self.hit_tokens = hit_tokens
        self.warm_hits = warm_hits
        self.min_rounds = min_rounds
        self.backoff_rate = backoff_rate
        self.rate_decay = rate_decay
        self.prior_cost_per_token_s = inner.prior_cost_per_token_s
        self.signals: list[str] = []
        self.warm = False
        self.transitions = 0
        self._trials: deque[bool] = deque(maxlen=recent_trials)
        self._shadow: list[int] = []
        self._shadow_matched = 0
        self._accepted: tuple[int, list[int]] | None = None
        self._rounds = 0
        self._proposed_sum = 0.0
        self._accepted_sum = 0.0

    @property
    def state(self) -> str:
        return "warm" if self.warm else "cold"

    def _on_begin(self, prompt_text: str | None) -> None:
        self.inner.begin(self._tokens, prompt_text)
        self.signals = prompt_signals(prompt_text) if prompt_text else []
        self._trials.clear()
        self._set_warm(bool(self.signals))
        self.transitions = 0

    def _set_warm(self, warm: bool) -> None:
        if warm != self.warm:
            self.transitions += 1
        self.warm = warm
        self._rounds = 0
        self._proposed_sum = 0.0
        self._accepted_sum = 0.0
        self._shadow = []
        self._shadow_matched = 0

    def _propose(self, k: int) -> list[int]:
        return self.inner.propose(k) if self.warm else []

    def propose_ahead(self, assumed: Sequence[int], k: int) -> list[int]:
        # Cold, nothing is proposed; the assumed tokens must not feed the shadow trials.
        return super().propose_ahead(assumed, k) if self.warm else []

    def _on_accept(self, accepted_count: int, proposal: list[int]) -> None:
        if not proposal:
            return
        self._accepted = (accepted_count, proposal)
        self._rounds += 1
        self._proposed_sum = self.rate_decay * self._proposed_sum + len(proposal)
        self._accepted_sum = self.rate_decay * self._accepted_sum + accepted_count

    @property
    def accept_rate(self) -> float | None:
        """Decayed per-token acceptance of warm proposals (None before any)."""
        return self._accepted_sum / self._proposed_sum if self._proposed_sum else None

    def _on_commit(self, start: int) -> None:
        tokens = self._tokens[start:]
        accepted, self._accepted = self._accepted, None
        if accepted is not None:
            self.inner.accept(accepted[0], tokens[-1], accepted[1])
        else:
            self.inner.extend(tokens)
        if self.warm:
            rate = self.accept_rate
            if self._rounds >= self.min_rounds and rate is not None and rate < self.backoff_rate:
                self._trials.clear()
                self._set_warm(False)
            return
        self._observe(tokens)

    def _observe(self, tokens: list[int]) -> None:
        # A trial ends as a hit once hit_tokens shadow tokens matched, as a miss at the
        # first mismatch before that.
        for token in tokens:
            if not self._shadow:
                break
            if self._shadow[self._shadow_matched] == token:
                self._shadow_matched += 1
                if self._shadow_matched < min(self.hit_tokens, len(self._shadow)):
                    continue
                self._trials.append(True)
            else:
                self._trials.append(False)
            self._shadow = []
        if sum(self._trials) >= self.warm_hits:
            self._trials.clear()
            self._set_warm(True)
            return
        if not self._shadow:
            _, self._shadow = self.inner.lookup(self.shadow_window)
            self._shadow_matched = 0

    def _on_finish(self) -> None:
        self.inner.finish()

    def _on_rollback(self, length: int) -> None:
        self.inner.rollback(length)
        self._shadow = []
        self._shadow_matched = 0
