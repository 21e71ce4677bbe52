"""Prompt-lookup drafting over the request's own tokens (prompt + generated).

The drafter finds the longest suffix of the committed sequence, with length n in
``[ngram_min, ngram_max]``, that occurred earlier, takes its most recent earlier
occurrence, and proposes the tokens that followed it. An incremental index
(n-gram -> positions of the token that followed it) is updated as tokens are
committed, so a proposal costs a handful of dict lookups whatever the context length.
"""

from __future__ import annotations

from collections.abc import Sequence

from mesh.errors import InvalidRequest
from mesh.speculative.drafter import Drafter

Pattern = tuple[int, ...]


class NgramIndex:
    """For every n in ``[ngram_min, ngram_max]``: n-gram -> ascending list of the
    positions of the token that followed each of its occurrences."""

    def __init__(self, ngram_min: int = 2, ngram_max: int = 6) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise InvalidRequest(
                f"ngram_min ({ngram_min}) and ngram_max ({ngram_max}) must satisfy "
                "1 <= ngram_min <= ngram_max"
            )
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self._follow: dict[int, dict[Pattern, list[int]]] = {
            n: {} for n in range(ngram_min, ngram_max + 1)
        }

    def clear(self) -> None:
        for table in self._follow.values():
            table.clear()

    def add(self, tokens: Sequence[int], start: int) -> None:
        """Index the n-grams followed by ``tokens[j]`` for every ``j >= start``."""
        for j in range(max(start, self.ngram_min), len(tokens)):
            for n, table in self._follow.items():
                if j >= n:
                    table.setdefault(tuple(tokens[j - n : j]), []).append(j)

    def remove(self, tokens: Sequence[int], length: int) -> None:
        """Undo ``add`` for followers at positions ``>= length`` (newest first)."""
        for j in range(len(tokens) - 1, max(length, self.ngram_min) - 1, -1):
            for n, table in self._follow.items():
                if j >= n:
                    key = tuple(tokens[j - n : j])
                    positions = table[key]
                    positions.pop()
                    if not positions:
                        del table[key]

    def lookup(self, tokens: Sequence[int], k: int) -> tuple[Pattern | None, list[int]]:
        """The longest matched suffix and up to ``k`` tokens that followed its most
        recent earlier occurrence. A match that runs into the end of the sequence
        continues periodically (the proposal copies itself), which suits repeats."""
        length = len(tokens)
        for n in range(min(self.ngram_max, length), self.ngram_min - 1, -1):
            key = tuple(tokens[length - n :])
            positions = self._follow[n].get(key)
            if not positions:
                continue
            follow = positions[-1]
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
