"""Drafting from a client's prediction (OpenAI's Predicted Outputs).

The client sends the text it expects back, typically the file being edited. The
prediction is tokenized once; the drafter keeps a cursor into it, the place where
the output is expected to go on, and proposes the prediction's tokens from there.
Every committed token that equals the prediction's token at the cursor moves the
cursor on and counts as an accepted prediction token. When the output leaves the
prediction (an insertion, a deletion, a rewrite), the cursor is lost; after each
commit the drafter looks for the output's last ``anchor`` tokens in the prediction
(at or after where it was last aligned first, then anywhere) and continues from
there, so an edit in the middle of a file costs only the tokens around it. While
the cursor is lost, or past the prediction's end, the server's own drafter (if any)
proposes. Drafts never change the output: verification keeps only tokens the
target model would have produced.

``accepted_tokens`` counts prediction tokens the output reproduced in place, each
at most once (an output that repeats the predicted text again does not accept its
tokens twice); ``rejected_tokens`` is the rest of the prediction (the meanings
OpenAI gives ``accepted_prediction_tokens`` and ``rejected_prediction_tokens``:
they sum to the prediction's length).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np

from mesh.speculative.drafter import Drafter

# Output tokens that must match the prediction to find the cursor again.
ANCHOR_TOKENS = 4
# Odd multiplier of the anchor hash (wrapping uint64 arithmetic).
_HASH_MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)


class AnchorIndex:
    """Where each run of ``anchor`` tokens starts in a token sequence. Built with
    array operations (a prediction may hold ~250,000 tokens: a dict of tuples took
    0.4 s of stage 0's event loop): the runs' hashes sorted once; a lookup finds
    the equal hashes by binary search and keeps the starts whose tokens match."""

    def __init__(self, tokens: Sequence[int], anchor: int) -> None:
        self.anchor = anchor
        self.tokens = np.asarray(tokens, dtype=np.int64)
        count = len(self.tokens) - anchor + 1
        if count <= 0:
            self._hashes = np.zeros(0, dtype=np.uint64)
            self._starts = np.zeros(0, dtype=np.int64)
            return
        hashes = self._hash_runs(self.tokens.astype(np.uint64), count)
        order = np.argsort(hashes, kind="stable")  # equal hashes keep their starts' order
        self._hashes, self._starts = hashes[order], order.astype(np.int64)

    def _hash_runs(self, values: np.ndarray, count: int) -> np.ndarray:
        hashes = np.zeros(count, dtype=np.uint64)
        with np.errstate(over="ignore"):
            for offset in range(self.anchor):
                hashes = hashes * _HASH_MULTIPLIER + values[offset : offset + count]
        return hashes

    def starts(self, run: Sequence[int]) -> list[int]:
        """The starts of ``run`` (``anchor`` tokens), ascending."""
        if len(run) != self.anchor or not len(self._hashes):
            return []
        key = self._hash_runs(np.asarray(run, dtype=np.uint64), 1)[0]
        low = int(np.searchsorted(self._hashes, key, side="left"))
        high = int(np.searchsorted(self._hashes, key, side="right"))
        wanted = list(run)
        return [
            int(start)
            for start in self._starts[low:high]
            if self.tokens[start : start + self.anchor].tolist() == wanted
        ]


class PredictionDrafter(Drafter):
    """Proposes the client's predicted tokens from an aligned cursor; ``fallback``
    proposes where the prediction has nothing to say."""

    name = "prediction"
    prior_cost_per_token_s = 1e-6

    def __init__(
        self,
        prediction: Sequence[int],
        fallback: Drafter | None = None,
        anchor: int = ANCHOR_TOKENS,
    ) -> None:
        super().__init__()
        self.prediction = [int(t) for t in prediction]
        self.fallback = fallback
        self.anchor = max(1, anchor)
        self._index = AnchorIndex(self.prediction, self.anchor)
        self._prompt_length = 0
        # History of (committed length, cursor, matched) so a rollback restores them.
        self._cursor: int | None = 0
        self._furthest = 0
        self.accepted_tokens = 0
        # The prediction places accepted so far, in order (a rollback unmarks the
        # latest), and a mark per place.
        self._marked: list[int] = []
        self._seen = bytearray(len(self.prediction))
        self._history: list[tuple[int, int | None, int, int]] = []
        self._source: Drafter | None = None
        self._fallback_accepted: tuple[int, list[int]] | None = None

    @property
    def rejected_tokens(self) -> int:
        return len(self.prediction) - self.accepted_tokens

    @property
    def cursor(self) -> int | None:
        """Where the output is expected to go on in the prediction (None: lost)."""
        return self._cursor

    # ---- Drafter hooks ----------------------------------------------------------------

    def _on_begin(self, prompt_text: str | None) -> None:
        self._prompt_length = len(self._tokens)
        self._cursor, self._furthest, self.accepted_tokens = 0, 0, 0
        self._marked = []
        self._seen = bytearray(len(self.prediction))
        self._history = []
        self._source = None
        if self.fallback is not None:
            self.fallback.begin(self._tokens, prompt_text)

    def _propose(self, k: int) -> list[int]:
        cursor = self._cursor
        if cursor is not None and cursor < len(self.prediction):
            self._source = self
            return self.prediction[cursor : cursor + k]
        if self.fallback is not None:
            proposal = self.fallback.propose(k)
            self._source = self.fallback if proposal else None
            self._note_source(proposal, self._source)
            return proposal
        self._source = None
        return []

    def _on_accept(self, accepted_count: int, proposal: list[int]) -> None:
        from_fallback = self.fallback is not None and self._source_of(proposal) is self.fallback
        self._fallback_accepted = (accepted_count, proposal) if from_fallback else None

    def _on_commit(self, start: int) -> None:
        new = self._tokens[start:]
        self._history.append((start, self._cursor, self._furthest, self.accepted_tokens))
        self._follow(start, len(self._tokens))
        if self.fallback is not None:
            accepted, self._fallback_accepted = self._fallback_accepted, None
            if accepted is not None:
                self.fallback.accept(accepted[0], new[-1], accepted[1])
            else:
                self.fallback.extend(new)

    def _on_rollback(self, length: int) -> None:
        while self._history and self._history[-1][0] >= length:
            _, self._cursor, self._furthest, self.accepted_tokens = self._history.pop()
        if self.fallback is not None:
            self.fallback.rollback(min(length, self.fallback.committed_length))
        # A rollback inside a commit batch: replay the batch's surviving tokens.
        if self._history:
            start = self._history[-1][0]
            if start < length:
                _, self._cursor, self._furthest, self.accepted_tokens = self._history.pop()
                self._history.append((start, self._cursor, self._furthest, self.accepted_tokens))
                self._unmark()
                self._follow(start, length)
        self._unmark()

    def _unmark(self) -> None:
        """Forget the places accepted after the state ``accepted_tokens`` was restored to."""
        while len(self._marked) > self.accepted_tokens:
            self._seen[self._marked.pop()] = 0

    def _on_finish(self) -> None:
        if self.fallback is not None:
            self.fallback.finish()

    # ---- alignment --------------------------------------------------------------------

    def _follow(self, start: int, end: int) -> None:
        """Move the cursor over committed tokens ``start .. end``, finding it again
        after each token while it is lost."""
        for index in range(start, end):
            token = self._tokens[index]
            cursor = self._cursor
            if cursor is not None and cursor < len(self.prediction):
                if self.prediction[cursor] == token:
                    self._cursor = cursor + 1
                    self._furthest = max(self._furthest, self._cursor)
                    if not self._seen[cursor]:
                        self._seen[cursor] = 1
                        self._marked.append(cursor)
                        self.accepted_tokens += 1
                    continue
            self._cursor = None
            self._realign(index + 1)

    def _realign(self, end: int) -> None:
        """Find the output's ``anchor`` tokens before ``end`` in the prediction: the
        first occurrence at or after the furthest aligned place, else the last one."""
        if end - self._prompt_length < self.anchor:
            return
        starts = self._index.starts(self._tokens[end - self.anchor : end])
        if not starts:
            return
        index = bisect.bisect_left(starts, self._furthest - self.anchor)
        start = starts[index] if index < len(starts) else starts[-1]
        self._cursor = start + self.anchor
        self._furthest = max(self._furthest, self._cursor)


def prediction_counts(prediction: Sequence[int], output: Sequence[int]) -> tuple[int, int]:
    """``(accepted, rejected)`` prediction tokens of a finished completion: those the
    output reproduced in place (aligning as the drafter does) and the rest."""
    drafter = PredictionDrafter(prediction)
    drafter.begin([])
    drafter.extend(output)
    return drafter.accepted_tokens, drafter.rejected_tokens
