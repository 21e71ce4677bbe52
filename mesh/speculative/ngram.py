"""Prompt-lookup drafting over the request's own tokens (prompt + generated).

The drafter finds the longest suffix of the committed sequence, with length n in
``[ngram_min, ngram_max]``, that occurred earlier, takes its most recent earlier
occurrence, and proposes the tokens that followed it. An incremental index
(n-gram -> position of the token that followed it) is updated as tokens are
committed, so a proposal costs a handful of dict lookups whatever the context length.
"""

from __future__ import annotations

from collections.abc import Sequence

from mesh.errors import InvalidRequest
from mesh.speculative.drafter import Drafter

Pattern = tuple[int, ...]


class NgramIndex:
    """For every n in ``[ngram_min, ngram_max]``: n-gram -> position of the token that
    followed its most recent occurrence, with a per-position link to the occurrence
    before (so a rollback restores earlier matches exactly). Values are plain ints:
    no per-entry lists, little work for the garbage collector on long prompts."""

    def __init__(self, ngram_min: int = 2, ngram_max: int = 6) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise InvalidRequest(
                f"ngram_min ({ngram_min}) and ngram_max ({ngram_max}) must satisfy "
                "1 <= ngram_min <= ngram_max"
            )
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        sizes = range(ngram_min, ngram_max + 1)
        self._last: dict[int, dict[Pattern, int]] = {n: {} for n in sizes}
        # _previous[n][j]: the follower position of the previous occurrence of the
        # n-gram followed by position j (-1 if none, or if j < n).
        self._previous: dict[int, list[int]] = {n: [] for n in sizes}

    def clear(self) -> None:
        for n in self._last:
            self._last[n].clear()
            self._previous[n].clear()

    def add(self, tokens: Sequence[int], start: int) -> None:
        """Index the n-grams followed by ``tokens[j]`` for every ``j >= start``
        (``start`` must equal the number of positions indexed so far)."""
        for j in range(start, len(tokens)):
            for n, last in self._last.items():
                if j < n:
                    self._previous[n].append(-1)
                    continue
                key = tuple(tokens[j - n : j])
                self._previous[n].append(last.get(key, -1))
                last[key] = j

    def remove(self, tokens: Sequence[int], length: int) -> None:
        """Undo ``add`` for positions ``>= length``, newest first."""
        for j in range(len(tokens) - 1, length - 1, -1):
            for n, last in self._last.items():
                previous = self._previous[n].pop()
                if j < n:
                    continue
                key = tuple(tokens[j - n : j])
                if previous < 0:
                    del last[key]
                else:
                    last[key] = previous

    def lookup(self, tokens: Sequence[int], k: int) -> tuple[Pattern | None, list[int]]:
        """The longest matched suffix and up to ``k`` tokens that followed its most
        recent earlier occurrence. A match that runs into the end of the sequence
        continues periodically (the proposal copies itself), which suits repeats."""
        length = len(tokens)
        for n in range(min(self.ngram_max, length), self.ngram_min - 1, -1):
            key = tuple(tokens[length - n :])
            follow = self._last[n].get(key)
            if follow is None:
                continue
            proposal: list[int] = []
            for i in range(k):
                index = follow + i
                proposal.append(tokens[index] if index < length else proposal[index - length])
            return key, proposal
        return None, []


class NgramDrafter(Drafter):
    """Prompt lookup: longest suffix match, most recent earlier occurrence."""

    name = "ngram"
    prior_cost_per_token_s = 2e-6

    def __init__(self, ngram_min: int = 2, ngram_max: int = 6) -> None:
        super().__init__()
        self.index = NgramIndex(ngram_min, ngram_max)
        self.last_pattern: Pattern | None = None

    def lookup(self, k: int) -> tuple[Pattern | None, list[int]]:
        """What ``propose(k)`` would return, without recording a proposal."""
        return self.index.lookup(self._tokens, k)

    def _on_begin(self, prompt_text: str | None) -> None:
        self.index.clear()
        self.index.add(self._tokens, 0)
        self.last_pattern = None

    def _propose(self, k: int) -> list[int]:
        self.last_pattern, proposal = self.index.lookup(self._tokens, k)
        return proposal

    def _on_commit(self, start: int) -> None:
        self.index.add(self._tokens, start)

    def _on_rollback(self, length: int) -> None:
        self.index.remove(self._tokens, length)


class MemoryNgramDrafter(NgramDrafter):
    """N-gram drafting that remembers, per matched pattern, how many tokens were
    accepted the last time it was used, and proposes at most one more than that
    (so a pattern that once failed can grow back)."""

    name = "ngram-memory"

    def __init__(self, ngram_min: int = 2, ngram_max: int = 6) -> None:
        super().__init__(ngram_min, ngram_max)
        self.memory: dict[Pattern, int] = {}

    def _on_begin(self, prompt_text: str | None) -> None:
        super()._on_begin(prompt_text)
        self.memory = {}

    def _propose(self, k: int) -> list[int]:
        proposal = super()._propose(k)
        if self.last_pattern is not None and self.last_pattern in self.memory:
            proposal = proposal[: self.memory[self.last_pattern] + 1]
        return proposal

    def _on_accept(self, accepted_count: int, proposal: list[int]) -> None:
        if proposal and self.last_pattern is not None:
            self.memory[self.last_pattern] = accepted_count
