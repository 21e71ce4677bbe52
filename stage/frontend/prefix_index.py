"""Stage 0's index of the prefixes the stages keep (the prefix cache).

When a request ends, its session's positions (prompt and output, as the pipeline
read them) may be kept on every stage under the request's id instead of being
freed; a later prompt that starts with the same tokens then starts its session
from a copy of them and prefills only the rest. This index knows which token
sequences are kept, finds the longest kept prefix of a new prompt, and decides
what to drop: at most ``capacity_tokens`` positions in all, least recently used
first out, and a kept sequence that a newer one extends (the previous turn of a
conversation) is dropped at once. Stages may drop a prefix on their own (their
memory bound, idle expiry, a restart); a session asked to start from it is then
refused there and stage 0 reads the prompt again from position 0. So that the
stages' idle expiry does not cost such a refused first try after every quiet spell,
``expire`` drops what has not been kept or used for a given time (stage 0 asks with
a little less than the stages' idle timeout: it forgets first).

Lookups hash the prompt in blocks of ``BLOCK`` tokens, each block's hash chained
to the one before, so a lookup costs one dict probe per block; the match is then
checked token by token and extended past the last whole block.

Each kept sequence belongs to a partition (the tenant of the request that left it,
by its API key): a lookup finds only its own partition's sequences, so a tenant
cannot learn from its time to first token whether another tenant sent a prompt.
The partition seeds the block hash chain.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

BLOCK = 16


@dataclass(frozen=True)
class PrefixHit:
    """A kept prefix ``name`` whose first ``length`` tokens start the prompt."""

    name: str
    length: int


def _chain(tokens: Sequence[int], partition: str = "") -> Iterator[int]:
    """One hash per whole block of ``tokens``, each covering every token before it
    and the partition."""
    digest = hash(partition)
    for end in range(BLOCK, len(tokens) + 1, BLOCK):
        digest = hash((digest, tuple(tokens[end - BLOCK : end])))
        yield digest


class PrefixIndex:
    """Kept token sequences by name; see the module docstring."""

    def __init__(
        self,
        capacity_tokens: int,
        min_tokens: int = BLOCK,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.capacity_tokens = max(0, capacity_tokens)
        self.min_tokens = max(1, min_tokens)
        self.clock = clock
        # Least recently kept or used first; each with when that was (``clock``).
        self._entries: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._used: dict[str, float] = {}
        self._partitions: dict[str, str] = {}
        self._by_block: dict[int, dict[str, None]] = {}
        self.held_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def add(self, name: str, tokens: Sequence[int], partition: str = "") -> tuple[bool, list[str]]:
        """Keep ``tokens`` as ``name`` in ``partition``. Returns whether it is kept
        (too short or over the whole capacity: not) and the names to drop on the
        stages (the partition's sequences it extends, and the least recently used ones
        over capacity)."""
        tokens = tuple(tokens)
        if len(tokens) < self.min_tokens or len(tokens) > self.capacity_tokens:
            return False, []
        dropped = [old for old in self._extended_by(tokens, partition) if old != name]
        for old in dropped:
            self.remove(old)
        self.remove(name)
        self._entries[name] = tokens
        self._used[name] = self.clock()
        self._partitions[name] = partition
        self.held_tokens += len(tokens)
        for digest in _chain(tokens, partition):
            self._by_block.setdefault(digest, {})[name] = None
        while self.held_tokens > self.capacity_tokens:
            oldest = next(iter(self._entries))
            self.remove(oldest)
            dropped.append(oldest)
        return True, dropped

    def _extended_by(self, tokens: tuple[int, ...], partition: str) -> list[str]:
        """The partition's kept sequences that ``tokens`` starts with (whole blocks of
        them hashed)."""
        found: list[str] = []
        for digest in _chain(tokens, partition):
            names = self._by_block.get(digest)
            if not names:
                break
            for name in names:
                kept = self._entries[name]
                same = self._partitions[name] == partition
                if same and len(kept) <= len(tokens) and tokens[: len(kept)] == kept:
                    found.append(name)
        return list(dict.fromkeys(found))

    def lookup(self, prompt: Sequence[int], partition: str = "") -> PrefixHit | None:
        """The partition's kept prefix sharing the most leading tokens with ``prompt``
        (at least ``min_tokens``, and at most all but the prompt's last token, which
        must be read to sample the first new one); None when there is none."""
        prompt = tuple(prompt)
        best: str | None = None
        blocks = 0
        for count, digest in enumerate(_chain(prompt, partition), start=1):
            names = self._by_block.get(digest)
            if not names:
                break
            best, blocks = next(reversed(names)), count
        if best is None or self._partitions[best] != partition:
            return None
        kept = self._entries[best]
        length = blocks * BLOCK
        if kept[:length] != prompt[:length]:
            return None  # a hash collision
        limit = min(len(kept), len(prompt) - 1)
        length = min(length, limit)
        while length < limit and kept[length] == prompt[length]:
            length += 1
        if length < self.min_tokens:
            return None
        return PrefixHit(best, length)

    def touch(self, name: str) -> None:
        """``name`` was used: last out."""
        if name in self._entries:
            self._entries.move_to_end(name)
            self._used[name] = self.clock()

    def expire(self, idle_s: float) -> list[str]:
        """Drop the sequences neither kept nor used in the last ``idle_s`` seconds
        (none when ``idle_s`` is 0); returns their names."""
        if idle_s <= 0:
            return []
        horizon = self.clock() - idle_s
        expired: list[str] = []
        for name in self._entries:  # least recently used first
            if self._used[name] > horizon:
                break
            expired.append(name)
        for name in expired:
            self.remove(name)
        return expired

    def remove(self, name: str) -> bool:
        tokens = self._entries.pop(name, None)
        if tokens is None:
            return False
        del self._used[name]
        partition = self._partitions.pop(name)
        self.held_tokens -= len(tokens)
        for digest in _chain(tokens, partition):
            names = self._by_block.get(digest)
            if names is not None:
                names.pop(name, None)
                if not names:
                    del self._by_block[digest]
        return True

    def clear(self) -> None:
        self._entries.clear()
        self._used.clear()
        self._partitions.clear()
        self._by_block.clear()
        self.held_tokens = 0
