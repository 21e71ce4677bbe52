"""Suffix drafting over the request's own tokens and a shared corpus of earlier ones.

For the current end of the committed sequence the drafter looks for earlier places
where the same tokens occurred, in the request itself and in its scope's corpus
(``mesh/speculative/corpus.py``), and proposes what followed them:

1. *Anchors.* The last ``ngram_max`` tokens (the long anchor) are looked up first;
   only when no earlier occurrence exists, the last ``ngram_min`` tokens. Up to
   ``max_candidates`` occurrences in all, most recent first: the request's own
   matching ones, then the corpus's for the places left.
2. *Match length.* Each occurrence's match is extended backwards, up to
   ``max_match`` (64) tokens, by comparing slices (a binary search over the length).
   Only a match longer than the longest so far needs its exact length; for the
   others it is enough to know that they reach half of it (``match_bound``), which
   takes two or three comparisons instead of the search.
3. *Voting.* The occurrences whose match is at least half the longest one vote. Token
   by token, the continuation most of the still-agreeing voters share is chosen
   (ties: the most recent occurrence); the product of the shares is the proposal's
   agreement, and the proposal stops before it would fall below ``min_agreement``.
4. *Length.* At most ``match_factor`` times the longest match (at least 1), and at
   most k (the window policy's choice): a long exact match whose continuations agree
   gives a long proposal, a short or ambiguous one a short proposal or none.

A continuation inside the request that runs into its end continues periodically,
as the n-gram drafter's does. The request index is incremental (an anchor key ->
newest follower position, and a per-position link to the previous occurrence in an
``array('i')``); commit and rollback cost O(tokens changed) and rollback is exact.
When the request ends, ``finish()`` adds its whole sequence to the corpus.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from mesh.errors import InvalidRequest
from mesh.speculative.corpus import CorpusView, Document, anchor_key
from mesh.speculative.drafter import Drafter

MAX_MATCH = 64


# An earlier occurrence of the current suffix: how many tokens match, the position
# of the token that followed it, and its corpus document (None: the request's own
# tokens). A plain tuple: a proposal may weigh sixteen of them.
Candidate = tuple[int, int, "Document | None"]


class LocalAnchors:
    """The request's anchor index: per anchor length, key -> newest follower position
    and a per-position link to the previous follower of the same key (-1: none)."""

    def __init__(self, anchors: tuple[int, ...]) -> None:
        self.anchors = anchors
        self.heads: list[dict[int, int]] = [{} for _ in anchors]
        self.prev: list[array] = [array("i") for _ in anchors]

    def clear(self) -> None:
        for head, prev in zip(self.heads, self.prev, strict=True):
            head.clear()
            del prev[:]

    def add(self, tokens: Sequence[int], start: int) -> None:
        """Index the anchors followed by ``tokens[j]`` for ``j >= start`` (``start`` is
        the number of positions indexed so far)."""
        for level, n in enumerate(self.anchors):
            head, prev = self.heads[level], self.prev[level]
            for j in range(start, len(tokens)):
                if j < n:
                    prev.append(-1)
                    continue
                key = hash(tuple(tokens[j - n : j]))
                prev.append(head.get(key, -1))
                head[key] = j

    def remove(self, tokens: Sequence[int], length: int) -> None:
        """Undo ``add`` for positions ``>= length``, newest first."""
        for level, n in enumerate(self.anchors):
            head, prev = self.heads[level], self.prev[level]
            for j in range(len(tokens) - 1, max(length, n) - 1, -1):
                key = hash(tuple(tokens[j - n : j]))
                if prev[j] < 0:
                    del head[key]
                else:
                    head[key] = prev[j]
            del prev[length:]

    def occurrences(self, level: int, key: int, limit: int) -> list[int]:
        """Up to ``limit`` follower positions of ``key``, newest first."""
        found: list[int] = []
        position = self.heads[level].get(key, -1)
        prev = self.prev[level]
        while position >= 0 and len(found) < limit:
            found.append(position)
            position = prev[position]
        return found


def match_length(seq: Sequence[int], end: int, suffix: Sequence[int], floor: int) -> int:
    """How many tokens before ``seq[end]`` equal the last ones of ``suffix`` (at most
    ``len(suffix)`` and ``end``); 0 when fewer than ``floor`` do. ``seq`` and
    ``suffix`` are of one type (lists, or ``array('i')``) so slices compare."""
    size = len(suffix)
    top = min(size, end)
    if top < floor:
        return 0
    if seq[end - top : end] == suffix[size - top :]:
        return top
    if seq[end - floor : end] != suffix[size - floor :]:
        return 0
    return _longest(seq, end, suffix, floor, top)


def _longest(seq: Sequence[int], end: int, suffix: Sequence[int], low: int, high: int) -> int:
    """The match length between ``low`` (matches) and ``high`` (does not), by a
    binary search over slice comparisons."""
    size = len(suffix)
    while high - low > 1:
        mid = (low + high) // 2
        if seq[end - mid : end] == suffix[size - mid :]:
            low = mid
        else:
            high = mid
    return low


def match_bound(seq: Sequence[int], end: int, suffix: Sequence[int], floor: int, best: int) -> int:
    """``match_length`` where it exceeds ``best``; where it lies in ``floor .. best``,
    ``floor`` (a lower bound, enough to know the occurrence votes); 0 below ``floor``."""
    size = len(suffix)
    top = min(size, end)
    if top < floor or seq[end - floor : end] != suffix[size - floor :]:
        return 0
    longer = best + 1
    if longer > top or seq[end - longer : end] != suffix[size - longer :]:
        return floor
    if seq[end - top : end] == suffix[size - top :]:
        return top
    return _longest(seq, end, suffix, longer, top)


class SuffixDrafter(Drafter):
    """Longest-match drafting over the request and its scope's corpus (module doc)."""

    name = "suffix"
    prior_cost_per_token_s = 3e-6
    max_match = MAX_MATCH
    max_candidates = 8
    match_factor = 1.0
    min_agreement = 0.5

    def __init__(
        self, ngram_min: int = 2, ngram_max: int = 6, corpus: CorpusView | None = None
    ) -> None:
        super().__init__()
        if not 1 <= ngram_min <= ngram_max <= self.max_match:
            raise InvalidRequest(
                f"ngram_min ({ngram_min}) and ngram_max ({ngram_max}) must satisfy "
                f"1 <= ngram_min <= ngram_max <= {self.max_match}"
            )
        anchors = (ngram_min,) if ngram_min == ngram_max else (ngram_min, ngram_max)
        if corpus is not None and corpus.anchors != anchors:
            raise InvalidRequest(
                f"the corpus indexes anchors {corpus.anchors}, the drafter needs {anchors}"
            )
        self.anchors = anchors
        self.index = LocalAnchors(anchors)
        self.corpus = corpus
        self.last_match = 0
        self.last_from_corpus = False
        self._finished = False

    def lookup(self, k: int) -> tuple[int | None, list[int]]:
        """The longest match and what ``propose(k)`` would return, without recording
        a proposal (auto gating's shadow trials use it)."""
        proposal = self._draft(k)
        return (self.last_match or None), proposal

    def _on_begin(self, prompt_text: str | None) -> None:
        self.index.clear()
        self.index.add(self._tokens, 0)
        self.last_match = 0
        self.last_from_corpus = False
        self._finished = False

    def _propose(self, k: int) -> list[int]:
        return self._draft(k)

    def _on_commit(self, start: int) -> None:
        self.index.add(self._tokens, start)

    def _on_rollback(self, length: int) -> None:
        self.index.remove(self._tokens, length)

    def _on_finish(self) -> None:
        if self.corpus is not None and not self._finished:
            self.corpus.add(self._tokens)
        self._finished = True

    # ---- drafting ---------------------------------------------------------------------

    def _draft(self, k: int) -> list[int]:
        self.last_match = 0
        self.last_from_corpus = False
        tokens = self._tokens
        length = len(tokens)
        suffix = tokens[-self.max_match :]
        packed: array | None = None  # the suffix as array('i'), to compare with documents
        for level in range(len(self.anchors) - 1, -1, -1):
            n = self.anchors[level]
            if length <= n:
                continue
            key = anchor_key(tokens, length, n)
            found: list[Candidate] = []  # most recent first: the request's, then the corpus's
            best = n
            for position in self.index.occurrences(level, key, self.max_candidates):
                size = match_bound(tokens, position, suffix, max(n, (best + 1) // 2), best)
                if size:
                    best = max(best, size)
                    found.append((size, position, None))
            # At most max_candidates in all: the corpus fills what the request left.
            room = self.max_candidates - len(found)
            hits = self.corpus.occurrences(level, key, room) if self.corpus and room else []
            for doc, offset in hits:
                packed = array("i", suffix) if packed is None else packed
                size = match_bound(doc.tokens, offset, packed, max(n, (best + 1) // 2), best)
                if size:
                    best = max(best, size)
                    found.append((size, offset, doc))
            if found:
                return self._vote(self._voters(found, best, suffix, packed), best, k)
        if self.corpus is not None:
            self.corpus.record_lookup(())
        return []

    def _voters(
        self, found: list[Candidate], best: int, suffix: list[int], packed: array | None
    ) -> list[Candidate]:
        """The occurrences whose match is at least half of ``best``: a lower bound
        below that (``match_bound``, taken before ``best`` grew) is measured again."""
        half = (best + 1) // 2
        voters = []
        for candidate in found:
            match, follow, doc = candidate
            if match < half:
                if doc is None:
                    match = match_length(self._tokens, follow, suffix, half)
                else:
                    match = match_length(doc.tokens, follow, packed, half)  # type: ignore[arg-type]
                if not match:
                    continue
                candidate = (match, follow, doc)
            voters.append(candidate)
        return voters

    def _continuation(self, follow: int, size: int) -> tuple[int, ...]:
        """Up to ``size`` tokens after position ``follow`` of the request,
        periodically continued past its end."""
        tokens = self._tokens
        continuation = tokens[follow : follow + size]
        period = len(tokens) - follow
        while len(continuation) < size:
            continuation.append(continuation[len(continuation) - period])
        return tuple(continuation)

    def _vote(self, found: list[Candidate], best: int, k: int) -> list[int]:
        cap = min(k, max(1, int(best * self.match_factor)))
        # Voters with the same continuation vote together: (continuation, documents).
        groups: dict[tuple[int, ...], list[Document | None]] = {}
        for match, follow, doc in found:
            if 2 * match >= best:
                if doc is None:
                    continuation = self._continuation(follow, cap)
                else:
                    continuation = tuple(doc.tokens[follow : follow + cap])
                group = groups.get(continuation)
                if group is None:
                    groups[continuation] = [doc]
                else:
                    group.append(doc)
        # (continuation, its votes, its documents), in the order first seen.
        agreeing = [(c, len(docs), docs) for c, docs in groups.items()]
        proposal: list[int] = []
        agreement = 1.0
        while len(agreeing) > 1 and len(proposal) < cap:
            t = len(proposal)
            counts: dict[int, int] = {}
            live = 0
            for continuation, votes, _ in agreeing:
                if t < len(continuation):
                    live += votes
                    token = continuation[t]
                    counts[token] = counts.get(token, 0) + votes
            if not live:
                break
            token = max(counts, key=counts.__getitem__)  # the first seen wins a tie
            agreement *= counts[token] / live
            if agreement < self.min_agreement:
                break
            proposal.append(token)
            agreeing = [group for group in agreeing if t < len(group[0]) and group[0][t] == token]
        if len(agreeing) == 1:
            proposal = list(agreeing[0][0])  # it agrees with everything chosen so far
        self.last_match = best
        used = [d for _, _, docs in agreeing for d in docs if d is not None] if proposal else []
        self.last_from_corpus = bool(used)
        if self.corpus is not None:
            self.corpus.record_lookup(used)
        return proposal
