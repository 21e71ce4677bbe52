"""The drafter interface and the bookkeeping every drafter shares.

A drafter lives for one request. It keeps its own copy of the request's committed
token sequence (prompt + generated) and proposes continuations of it:

    begin(prompt)            committed = prompt
    propose(k)               up to k draft tokens continuing committed (may be [])
    accept(n, next_token)    committed += first n proposed + next_token
    extend(tokens)           committed += tokens (not from this drafter's proposal)
    rollback(length)         committed = committed[:length]
    finish()                 the request ended; committed is final

The caller commits the first generated token (sampled by the prefill) with
``accept(0, token)``; ``last_token`` is the ``current`` token of the next window
and ``committed_length - 1`` its position.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Sequence

from mesh.errors import Fatal


class Drafter(ABC):
    """Base class of all drafters; subclasses implement ``_propose`` and the hooks."""

    name: str = "drafter"
    #: Cost per proposed token assumed before anything was measured, in seconds.
    prior_cost_per_token_s: float = 0.0
    #: Weight of history in the measured cost (exponential decay per propose call).
    cost_decay: float = 0.9

    def __init__(self) -> None:
        self._tokens: list[int] = []
        self._pending: list[int] = []
        self._cost_time_s = 0.0
        self._cost_tokens = 0.0
        # A drafter that delegates (composite, auto, prediction): which inner drafter
        # made each proposal still awaiting its verdict (several windows of a request
        # may be in flight at once).
        self._sources: dict[tuple[int, ...], Drafter] = {}

    # ---- public interface -------------------------------------------------------------

    def begin(self, prompt_tokens: Sequence[int], prompt_text: str | None = None) -> None:
        """Start a request. ``prompt_text`` feeds text detectors (auto gating) only."""
        self._tokens = [int(t) for t in prompt_tokens]
        self._pending = []
        self._sources.clear()
        self._on_begin(prompt_text)

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` draft tokens continuing the committed sequence (maybe none)."""
        self._pending = []
        if k <= 0:
            return []
        started = time.perf_counter()
        proposal = [int(t) for t in self._propose(k)][:k]
        elapsed = time.perf_counter() - started
        if proposal:
            self._cost_time_s = self.cost_decay * self._cost_time_s + elapsed
            self._cost_tokens = self.cost_decay * self._cost_tokens + len(proposal)
        self._pending = proposal
        return list(proposal)

    def propose_ahead(self, assumed: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens continuing the committed sequence followed by
        ``assumed`` (draft tokens still being verified), for a window sent before
        their verdict. The committed sequence is left as it was (the hooks see the
        assumed tokens come and go), and so is the last proposal."""
        if k <= 0:
            return []
        length, pending = len(self._tokens), self._pending
        self._extend([int(t) for t in assumed])
        try:
            started = time.perf_counter()
            proposal = [int(t) for t in self._propose(k)][:k]
            elapsed = time.perf_counter() - started
        finally:
            self.rollback(length)
            self._pending = pending
        if proposal:
            self._cost_time_s = self.cost_decay * self._cost_time_s + elapsed
            self._cost_tokens = self.cost_decay * self._cost_tokens + len(proposal)
        return proposal

    def accept(
        self, accepted_count: int, next_token: int, proposal: Sequence[int] | None = None
    ) -> None:
        """Commit the first ``accepted_count`` tokens of the last proposal (or of
        ``proposal``, the drafts of the window this verdict answers, when several
        windows were in flight) and then ``next_token`` (the target's token after
        them)."""
        proposal = self._pending if proposal is None else [int(t) for t in proposal]
        if not 0 <= accepted_count <= len(proposal):
            raise Fatal(
                f"{self.name}: accepted_count {accepted_count} is outside [0, {len(proposal)}] "
                "(the last proposal's length); call accept once per propose"
            )
        self._pending = []
        self._on_accept(accepted_count, proposal)
        self._extend(proposal[:accepted_count] + [int(next_token)])

    def extend(self, tokens: Sequence[int]) -> None:
        """Commit tokens that did not come from this drafter's proposal (another drafter
        proposed them, or the caller decoded without speculation)."""
        self._pending = []
        self._extend([int(t) for t in tokens])

    def finish(self) -> None:
        """The request ended: its committed sequence is final (a drafter that learns
        across requests records it here)."""
        self._pending = []
        self._on_finish()

    def rollback(self, length: int) -> None:
        """Truncate the committed sequence to ``length`` tokens."""
        if not 0 <= length <= len(self._tokens):
            raise Fatal(f"{self.name}: cannot roll back to {length}; {len(self._tokens)} committed")
        self._pending = []
        if length < len(self._tokens):
            self._on_rollback(length)
            del self._tokens[length:]

    @property
    def committed_length(self) -> int:
        return len(self._tokens)

    @property
    def last_token(self) -> int:
        """The newest committed token: the ``current`` token of the next window."""
        if not self._tokens:
            raise Fatal(f"{self.name}: nothing committed yet; call begin() first")
        return self._tokens[-1]

    @property
    def committed(self) -> list[int]:
        """A copy of the committed sequence."""
        return list(self._tokens)

    @property
    def cost_per_token_s(self) -> float:
        """Measured seconds per proposed token (decayed average), or the prior."""
        if self._cost_tokens <= 0.0:
            return self.prior_cost_per_token_s
        return self._cost_time_s / self._cost_tokens

    def _note_source(self, proposal: Sequence[int], source: Drafter | None) -> None:
        """Remember that ``source`` made ``proposal`` (for ``_source_of``)."""
        if proposal and source is not None:
            if len(self._sources) > 64:  # proposals that never got a verdict
                self._sources.clear()
            self._sources[tuple(proposal)] = source

    def _source_of(self, proposal: Sequence[int]) -> Drafter | None:
        """The inner drafter that made ``proposal`` (None: not one of them)."""
        return self._sources.pop(tuple(proposal), None) if proposal else None

    # ---- subclass hooks ---------------------------------------------------------------

    @abstractmethod
    def _propose(self, k: int) -> Sequence[int]:
        """Draft tokens continuing ``self._tokens``."""

    def _on_begin(self, prompt_text: str | None) -> None:
        """Reset per-request state; ``self._tokens`` already holds the prompt."""
        return None

    def _on_commit(self, start: int) -> None:
        """Tokens ``self._tokens[start:]`` were just committed."""
        return None

    def _on_rollback(self, length: int) -> None:
        """The committed sequence is about to be truncated to ``length`` (``self._tokens``
        still holds the old tokens)."""
        return None

    def _on_accept(self, accepted_count: int, proposal: list[int]) -> None:
        """Verification kept ``accepted_count`` tokens of ``proposal`` (before commit)."""
        return None

    def _on_finish(self) -> None:
        """The request ended (``self._tokens`` is its whole sequence)."""
        return None

    def _extend(self, tokens: list[int]) -> None:
        if tokens:
            start = len(self._tokens)
            self._tokens.extend(tokens)
            self._on_commit(start)


class CompositeDrafter(Drafter):
    """The n-gram drafter first; the draft model only when the n-gram has nothing."""

    name = "composite"

    def __init__(self, ngram: Drafter, draft: Drafter) -> None:
        super().__init__()
        self.ngram = ngram
        self.draft = draft
        self.last_source: Drafter | None = None
        self._accepted: tuple[int, list[int], Drafter | None] | None = None

    def _on_begin(self, prompt_text: str | None) -> None:
        self.ngram.begin(self._tokens, prompt_text)
        self.draft.begin(self._tokens, prompt_text)
        self.last_source = None

    def _propose(self, k: int) -> list[int]:
        proposal = self.ngram.propose(k)
        self.last_source = self.ngram
        if not proposal:
            proposal = self.draft.propose(k)
            self.last_source = self.draft if proposal else None
        self._note_source(proposal, self.last_source)
        return proposal

    def _on_accept(self, accepted_count: int, proposal: list[int]) -> None:
        source = self._source_of(proposal)
        self._accepted = (accepted_count, proposal, source) if proposal else None

    def _on_commit(self, start: int) -> None:
        # The drafter that proposed learns through accept(); the other sees plain commits.
        tokens = self._tokens[start:]
        accepted, self._accepted = self._accepted, None
        for child in (self.ngram, self.draft):
            if accepted is not None and child is accepted[2]:
                child.accept(accepted[0], tokens[-1], accepted[1])
            else:
                child.extend(tokens)

    def _on_rollback(self, length: int) -> None:
        self.ngram.rollback(min(length, self.ngram.committed_length))
        self.draft.rollback(min(length, self.draft.committed_length))

    def _on_finish(self) -> None:
        self.ngram.finish()
        self.draft.finish()
