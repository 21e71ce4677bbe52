"""The shared corpus of finished requests that suffix drafting matches against.

When a request ends, its drafter adds the committed sequence (prompt and output) to
the corpus as one *document*. Documents live in *partitions*: one per scope (the
request's ``user``; ``""`` is the anonymous tenant) in ``"user"`` mode, a single one
in ``"global"`` mode, so one tenant's text never shapes another tenant's drafts
unless the operator chose to share. ``max_tokens`` bounds all partitions together;
the least recently used document (added, or last drawn on by a proposal) is evicted
whole.

Each partition indexes the n-grams of its documents at a few anchor lengths: for
every anchor length, a dict n-gram key -> the newest position that follows it, and
per position links to the previous and the next position with the same key (so a
document anywhere in the chain can be unlinked when it is evicted). Positions are
global to the partition and never reused (``base`` of a document + offset); a
position's document is found by bisection over the live documents' bases.

A lock serialises adding, evicting and walking chains. Documents never change once
added, so a caller may read a document's tokens after the lock is released.
"""

from __future__ import annotations

import itertools
import threading
from array import array
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from mesh.errors import InvalidRequest

SCOPE_MODES = ("user", "global")


def anchor_key(tokens: Sequence[int], end: int, n: int) -> int:
    """The index key of the n-gram ``tokens[end - n : end]`` (a hash: equal n-grams
    give equal keys; a match found through a key is checked token by token)."""
    return hash(tuple(tokens[end - n : end]))


class Document:
    """One finished request's tokens with its links in every anchor chain."""

    __slots__ = ("doc_id", "partition", "base", "tokens", "prev", "next")

    def __init__(self, doc_id: int, partition: str, base: int, tokens: array, levels: int):
        self.doc_id = doc_id
        self.partition = partition
        self.base = base
        self.tokens = tokens
        size = len(tokens)
        self.prev = [array("q", [-1]) * size for _ in range(levels)]
        self.next = [array("q", [-1]) * size for _ in range(levels)]


class _Partition:
    """The documents of one partition and their anchor index."""

    def __init__(self, anchors: tuple[int, ...]) -> None:
        self.anchors = anchors
        self.heads: list[dict[int, int]] = [{} for _ in anchors]
        self.bases: list[int] = []
        self.documents: list[Document] = []
        self.next_base = 0

    def document_at(self, position: int) -> Document:
        return self.documents[bisect_right(self.bases, position) - 1]

    def link(self, doc: Document) -> None:
        tokens = doc.tokens
        for level, n in enumerate(self.anchors):
            head, prev = self.heads[level], doc.prev[level]
            for offset in range(n, len(tokens)):
                position = doc.base + offset
                key = hash(tuple(tokens[offset - n : offset]))
                older = head.get(key, -1)
                if older >= 0:
                    prev[offset] = older
                    holder = doc if older >= doc.base else self.document_at(older)
                    holder.next[level][older - holder.base] = position
                head[key] = position
        self.bases.append(doc.base)
        self.documents.append(doc)

    def unlink(self, doc: Document) -> None:
        tokens = doc.tokens
        end = doc.base + len(tokens)
        for level, n in enumerate(self.anchors):
            head, prev, after = self.heads[level], doc.prev[level], doc.next[level]
            for offset in range(n, len(tokens)):
                older, newer = prev[offset], after[offset]
                if newer < 0:
                    key = hash(tuple(tokens[offset - n : offset]))
                    if older < 0:
                        del head[key]
                    else:
                        head[key] = older
                else:
                    holder = doc if newer < end else self.document_at(newer)
                    holder.prev[level][newer - holder.base] = older
                if older >= 0:
                    holder = doc if older >= doc.base else self.document_at(older)
                    holder.next[level][older - holder.base] = newer
        index = bisect_right(self.bases, doc.base) - 1
        del self.bases[index]
        del self.documents[index]

    def occurrences(self, level: int, key: int, limit: int) -> list[tuple[Document, int]]:
        found: list[tuple[Document, int]] = []
        position = self.heads[level].get(key, -1)
        doc: Document | None = None
        while position >= 0 and len(found) < limit:
            if doc is None or position < doc.base:  # chains run from newer to older
                doc = self.document_at(position)
            offset = position - doc.base
            found.append((doc, offset))
            position = doc.prev[level][offset]
        return found


@dataclass(frozen=True)
class CorpusStats:
    """What a metrics collector reads: live documents and tokens, partitions, and the
    running totals of evicted documents, lookups and hits (lookups whose proposal drew
    on the corpus)."""

    documents: int
    tokens: int
    partitions: int
    evictions: int
    lookups: int
    hits: int


class SharedCorpus:
    """Finished requests' tokens, per scope, bounded in tokens with LRU eviction."""

    def __init__(
        self, max_tokens: int, scope_mode: str = "user", anchors: Sequence[int] = (2, 6)
    ) -> None:
        if max_tokens < 0:
            raise InvalidRequest(f"corpus_tokens must be >= 0, got {max_tokens}")
        if scope_mode not in SCOPE_MODES:
            raise InvalidRequest(
                f"corpus_scope must be one of {', '.join(SCOPE_MODES)}; got {scope_mode!r}"
            )
        if not anchors or min(anchors) < 1:
            raise InvalidRequest(f"corpus anchors must be positive lengths, got {anchors!r}")
        self.max_tokens = max_tokens
        self.scope_mode = scope_mode
        self.anchors = tuple(anchors)
        self._partitions: dict[str, _Partition] = {}
        self._recent: OrderedDict[int, Document] = OrderedDict()
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self.tokens = 0
        self.evictions = 0
        self.lookups = 0
        self.hits = 0

    @property
    def documents(self) -> int:
        return len(self._recent)

    def partition_of(self, scope: str) -> str:
        """The partition a request of ``scope`` reads and writes."""
        return scope if self.scope_mode == "user" else ""

    def view(self, scope: str) -> CorpusView | None:
        """The corpus as a request of ``scope`` sees it (None when the corpus is off)."""
        if self.max_tokens == 0:
            return None
        return CorpusView(self, self.partition_of(scope))

    def add(self, partition: str, tokens: Sequence[int]) -> None:
        """Add one document (its last ``max_tokens`` tokens) and evict the least
        recently used documents until the corpus fits again."""
        if self.max_tokens == 0 or not tokens:
            return
        stored = array("i", tokens[-self.max_tokens :])
        with self._lock:
            part = self._partitions.get(partition)
            if part is None:
                part = self._partitions[partition] = _Partition(self.anchors)
            doc = Document(next(self._ids), partition, part.next_base, stored, len(self.anchors))
            part.next_base += len(stored)
            part.link(doc)
            self._recent[doc.doc_id] = doc
            self.tokens += len(stored)
            while self.tokens > self.max_tokens:
                self._evict_oldest()

    def _evict_oldest(self) -> None:
        _, doc = self._recent.popitem(last=False)
        part = self._partitions[doc.partition]
        part.unlink(doc)
        if not part.documents:
            del self._partitions[doc.partition]
        self.tokens -= len(doc.tokens)
        self.evictions += 1

    def occurrences(
        self, partition: str, level: int, key: int, limit: int
    ) -> list[tuple[Document, int]]:
        """Up to ``limit`` ``(document, offset)`` pairs, newest first, whose anchor of
        level ``level`` (an index into ``anchors``) has ``key``: ``offset`` is the
        position in the document of the token that followed it."""
        with self._lock:
            part = self._partitions.get(partition)
            return part.occurrences(level, key, limit) if part is not None else []

    def record_lookup(self, used: Sequence[Document]) -> None:
        """Count one lookup; the documents a proposal drew on become most recent."""
        with self._lock:
            self.lookups += 1
            if used:
                self.hits += 1
            for doc in used:
                if doc.doc_id in self._recent:
                    self._recent.move_to_end(doc.doc_id)

    def stats(self) -> CorpusStats:
        with self._lock:
            return CorpusStats(
                documents=len(self._recent),
                tokens=self.tokens,
                partitions=len(self._partitions),
                evictions=self.evictions,
                lookups=self.lookups,
                hits=self.hits,
            )


@dataclass(frozen=True)
class CorpusView:
    """One partition of a shared corpus: what a request's drafter reads and adds to."""

    corpus: SharedCorpus
    partition: str

    @property
    def anchors(self) -> tuple[int, ...]:
        return self.corpus.anchors

    def add(self, tokens: Sequence[int]) -> None:
        self.corpus.add(self.partition, tokens)

    def occurrences(self, level: int, key: int, limit: int) -> list[tuple[Document, int]]:
        return self.corpus.occurrences(self.partition, level, key, limit)

    def record_lookup(self, used: Sequence[Document]) -> None:
        self.corpus.record_lookup(used)
