"""N-gram drafting: lookup rules, incremental index vs brute force, memory, composite."""

from __future__ import annotations

import random

import pytest

from mesh.errors import Fatal, InvalidRequest
from mesh.speculative import (
    CompositeDrafter,
    Drafter,
    MemoryNgramDrafter,
    NgramDrafter,
    NgramIndex,
)


def brute_force(tokens: list[int], k: int, ngram_min: int, ngram_max: int) -> list[int]:
    """Longest suffix (n in [min, max]) with an earlier occurrence; most recent one."""
    length = len(tokens)
    for n in range(min(ngram_max, length), ngram_min - 1, -1):
        suffix = tokens[length - n :]
        for start in range(length - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                seq = list(tokens)
                follow = start + n
                for i in range(k):
                    seq.append(seq[follow + i])
                return seq[length:]
    return []


def started(tokens: list[int], cls=NgramDrafter, **kwargs) -> NgramDrafter:
    drafter = cls(**kwargs)
    drafter.begin(tokens)
    return drafter


def test_most_recent_occurrence_of_suffix() -> None:
    drafter = started([1, 2, 3, 4, 9, 1, 2, 3, 5, 7, 1, 2, 3])
    assert drafter.propose(3) == [5, 7, 1]


def test_longest_suffix_wins_over_more_recent_shorter_match() -> None:
    # [5, 2, 3] occurred at the start (followed by 8); [2, 3] more recently (followed by 9).
    drafter = started([5, 2, 3, 8, 1, 2, 3, 9, 5, 2, 3])
    assert drafter.propose(2) == [8, 1]
    assert drafter.last_pattern == (5, 2, 3)


def test_no_match_and_ngram_min() -> None:
    assert started([1, 2, 3, 4, 5]).propose(4) == []
    # Only a 1-token suffix repeats; ngram_min=2 ignores it, ngram_min=1 uses it.
    assert started([4, 1, 6, 2, 1]).propose(2) == []
    assert started([4, 1, 6, 2, 1], ngram_min=1).propose(2) == [6, 2]
    assert started([1, 2, 1, 2]).propose(0) == []


def test_run_into_the_end_continues_periodically() -> None:
    assert started([3, 7, 7, 7]).propose(5) == [7, 7, 7, 7, 7]
    assert started([9, 1, 2, 1, 2]).propose(5) == [1, 2, 1, 2, 1]


def test_accept_commits_accepted_prefix_and_next_token() -> None:
    drafter = started([1, 2, 3, 4, 1, 2])
    assert drafter.propose(3) == [3, 4, 1]
    drafter.accept(2, 8)
    assert drafter.committed == [1, 2, 3, 4, 1, 2, 3, 4, 8]
    drafter.accept(0, 5)  # a plain decode round: no proposal outstanding
    assert drafter.committed[-1] == 5
    with pytest.raises(Fatal, match="accepted_count"):
        drafter.accept(1, 6)


def test_rollback_restores_earlier_lookups() -> None:
    drafter = started([1, 2, 3, 1, 2])
    assert drafter.propose(1) == [3]
    drafter.accept(0, 9)  # committed ... 1 2 9
    drafter.extend([1, 2])
    assert drafter.propose(1) == [9]
    drafter.rollback(5)
    assert drafter.committed == [1, 2, 3, 1, 2]
    assert drafter.propose(1) == [3]
    with pytest.raises(Fatal):
        drafter.rollback(6)


@pytest.mark.parametrize("seed", range(6))
def test_incremental_index_matches_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    ngram_min, ngram_max = rng.choice([(1, 3), (2, 6), (3, 4)])
    drafter = NgramDrafter(ngram_min, ngram_max)
    tokens = [rng.randrange(4) for _ in range(rng.randrange(0, 20))]
    drafter.begin(tokens)
    for _ in range(300):
        k = rng.randrange(1, 7)
        proposal = drafter.propose(k)
        assert proposal == brute_force(tokens, k, ngram_min, ngram_max)
        action = rng.random()
        if action < 0.7:
            accepted = rng.randrange(len(proposal) + 1)
            nxt = rng.randrange(4)
            drafter.accept(accepted, nxt)
            tokens += proposal[:accepted] + [nxt]
        elif action < 0.85:
            extra = [rng.randrange(4) for _ in range(rng.randrange(1, 4))]
            drafter.extend(extra)
            tokens += extra
        else:
            length = rng.randrange(len(tokens) + 1)
            drafter.rollback(length)
            del tokens[length:]
        assert drafter.committed == tokens


def test_index_rejects_bad_bounds() -> None:
    with pytest.raises(InvalidRequest):
        NgramIndex(3, 2)
    with pytest.raises(InvalidRequest):
        NgramIndex(0, 2)


def test_memory_limits_by_last_acceptance_plus_one() -> None:
    base = [1, 2, 3, 4, 5, 6, 9, 1, 2]
    drafter = started(base, cls=MemoryNgramDrafter)
    assert drafter.propose(5) == [3, 4, 5, 6, 9]
    drafter.accept(1, 7)  # pattern (9, 1, 2) kept one token
    drafter.rollback(len(base))
    assert drafter.propose(5) == [3, 4]  # last time 1 accepted: propose at most 2
    drafter.accept(2, 8)  # fully accepted: may grow by one next time
    drafter.rollback(len(base))
    assert drafter.propose(5) == [3, 4, 5]
    plain = started(base)
    assert plain.propose(5) == [3, 4, 5, 6, 9]


class ScriptedDrafter(Drafter):
    """Proposes a fixed continuation; stands in for a draft model."""

    name = "scripted"

    def __init__(self, continuation: list[int]) -> None:
        super().__init__()
        self.continuation = continuation
        self.accept_calls: list[int] = []

    def _propose(self, k: int) -> list[int]:
        return self.continuation[:k]

    def _on_accept(self, accepted_count: int, proposal: list[int]) -> None:
        self.accept_calls.append(accepted_count)


def test_composite_prefers_ngram_then_draft_and_keeps_both_in_sync() -> None:
    draft = ScriptedDrafter([40, 41, 42])
    composite = CompositeDrafter(NgramDrafter(), draft)
    composite.begin([1, 2, 3, 4])
    assert composite.propose(3) == [40, 41, 42]
    assert composite.last_source is draft
    composite.accept(1, 1)  # committed: 1 2 3 4 40 1
    assert draft.accept_calls == [1]
    composite.extend([2])  # now the suffix (1, 2) repeats
    assert composite.propose(2) == [3, 4]
    assert composite.last_source is composite.ngram
    composite.accept(2, 40)
    assert draft.accept_calls == [1]  # the draft only saw plain commits
    expected = [1, 2, 3, 4, 40, 1, 2, 3, 4, 40]
    assert composite.committed == composite.ngram.committed == draft.committed == expected
    composite.rollback(6)
    assert composite.ngram.committed == draft.committed == expected[:6]


def test_cost_per_token_is_measured() -> None:
    drafter = started([1, 2, 1, 2])
    assert drafter.cost_per_token_s == NgramDrafter.prior_cost_per_token_s
    drafter.propose(4)
    assert 0.0 < drafter.cost_per_token_s < 0.01
