"""Suffix drafting: matching and proposal lengths, exact rollback, the shared corpus
(scopes, LRU bound in tokens, what finish adds), and the strategy's wiring."""

from __future__ import annotations

import argparse
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mesh.config import (
    SpeculationConfig,
    add_speculation_arguments,
    cli_speculation_args,
    resolve_speculation,
)
from mesh.errors import InvalidRequest
from mesh.speculative import (
    AutoNgramDrafter,
    SharedCorpus,
    SuffixDrafter,
    build_drafter,
)
from mesh.speculative.corpus import anchor_key
from mesh.speculative.suffix import match_bound, match_length


def started(tokens: list[int], corpus: SharedCorpus | None = None, scope: str = "", **kwargs):
    view = corpus.view(scope) if corpus is not None else None
    drafter = SuffixDrafter(corpus=view, **kwargs)
    drafter.begin(tokens)
    return drafter


def finished(corpus: SharedCorpus, scope: str, tokens: list[int]) -> None:
    drafter = started(tokens, corpus, scope)
    drafter.finish()


RUN = list(range(100, 140))  # 40 distinct tokens


# ---- matching and proposal lengths -------------------------------------------------


def test_long_repeat_gives_a_long_proposal_capped_by_k() -> None:
    # The last 20 tokens repeat the start: a 20-token match.
    drafter = started(RUN + [7, 8] + RUN[:20])
    assert drafter.propose(16) == RUN[20:36]
    assert drafter.last_match == 20
    assert drafter.propose(4) == RUN[20:24]


def test_proposal_length_follows_the_match_length() -> None:
    # Only the last 3 tokens occurred before: at most 3 tokens are proposed.
    drafter = started(RUN[:10] + [1, 2, 3, 4, 5] + RUN[5:8])
    assert drafter.propose(8) == [*RUN[8:10], 1]
    assert drafter.last_match == 3


def test_no_match_proposes_nothing() -> None:
    assert started(RUN).propose(8) == []
    assert started([5, 1, 6, 2, 1]).propose(4) == []  # a 1-token match is below ngram_min
    assert started([5, 1, 6, 2, 1], ngram_min=1).propose(4) == [6]
    assert started(RUN[:3] + RUN[:3]).propose(0) == []


def test_ambiguous_short_match_proposes_nothing() -> None:
    # [1, 2] was followed by 7, 8 and 9: no continuation has half the votes.
    drafter = started([1, 2, 7, 40, 1, 2, 8, 41, 1, 2, 9, 42, 1, 2])
    assert drafter.propose(4) == []
    assert drafter.last_match == 2


def test_proposal_stops_where_the_continuations_disagree() -> None:
    anchor = [10, 11, 12, 13, 14, 15]
    tokens = [50, *anchor, 7, 8, 9, 20, 51, *anchor, 7, 8, 9, 21, 52, *anchor, 7, 8, 30, 31]
    drafter = started([*tokens, 53, *anchor])
    # 7, 8: all three agree; 9: two of three (0.67); then 20 / 21 halves it (0.33).
    assert drafter.propose(8) == [7, 8, 9]


def test_the_most_recent_occurrence_wins_a_two_way_tie() -> None:
    anchor = [10, 11, 12, 13, 14, 15]
    drafter = started([50, *anchor, 1, 2, 51, *anchor, 3, 4, 52, *anchor])
    assert drafter.propose(2) == [3, 4]


def test_the_longest_match_outvotes_shorter_ones() -> None:
    # Three recent 6-token matches followed by 9, one older 30-token match by 5: the
    # short ones are under half the longest and do not vote.
    anchor = [10, 11, 12, 13, 14, 15]
    context = list(range(60, 84)) + anchor
    tokens = [*context, 5, 6, 99]
    for separator in (90, 91, 92):
        tokens += [separator, *anchor, 9, 9]
    drafter = started([*tokens, *context])
    assert drafter.propose(4) == [5, 6, 99, 90]
    assert drafter.last_match == 30


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 2), min_size=1, max_size=80),
    st.lists(st.integers(0, 2), min_size=1, max_size=64),
    st.data(),
)
def test_match_bound_is_exact_above_best_and_a_lower_bound_below(
    seq: list[int], suffix: list[int], data: st.DataObject
) -> None:
    """Above ``best`` the exact match; from ``floor`` to ``best`` at least ``floor``
    and at most the match; nothing below ``floor``."""
    end = data.draw(st.integers(0, len(seq)))
    best = data.draw(st.integers(1, 64))
    floor = data.draw(st.integers(1, best))
    exact = match_length(seq, end, suffix, 1)
    bound = match_bound(seq, end, suffix, floor, best)
    if exact < floor:
        assert bound == 0
    elif exact > best:
        assert bound == exact
    else:
        assert floor <= bound <= exact


def test_the_request_fills_the_candidates_before_the_corpus() -> None:
    """At most ``max_candidates`` (8) occurrences vote: the request's own first.
    Seven earlier copies in the request leave room for one of nine corpus documents
    that go on otherwise, and outvote it."""
    context = list(range(300, 340)) + RUN[:20]  # 60 tokens: every match votes
    corpus = SharedCorpus(10_000)
    for _ in range(9):
        finished(corpus, "", context + [1, 1, 1])
    drafter = started((context + [2, 2, 2]) * 7 + context, corpus)
    assert drafter.propose(3) == [2, 2, 2]
    assert drafter.last_match >= 60 and not drafter.last_from_corpus
    # With room left by the request, the corpus's occurrences vote too.
    drafter = started(context + [2, 2, 2] + context, corpus)
    assert drafter.propose(3) == [1, 1, 1]
    assert drafter.last_from_corpus


def test_a_repeat_running_into_the_end_continues_periodically() -> None:
    drafter = started([9, *RUN[:8], *RUN[:8], *RUN[:8]])
    assert drafter.propose(12) == RUN[:8] + RUN[:4]


# ---- rollback is exact --------------------------------------------------------------


OPERATIONS = st.lists(
    st.tuples(
        st.sampled_from(["accept", "extend", "rollback"]),
        st.integers(0, 1000),
        st.lists(st.integers(0, 4), min_size=1, max_size=6),
    ),
    max_size=40,
)


@settings(max_examples=80, deadline=None)
@given(prompt=st.lists(st.integers(0, 4), max_size=30), operations=OPERATIONS)
def test_commits_and_rollbacks_match_a_drafter_built_from_scratch(prompt, operations) -> None:
    corpus = SharedCorpus(10_000)
    rng = random.Random(len(prompt))
    for _ in range(3):
        finished(corpus, "", [rng.randrange(5) for _ in range(40)])
    drafter = started(prompt, corpus)
    tokens = list(prompt)
    for action, number, extra in operations:
        proposal = drafter.propose(1 + number % 8)
        if action == "accept":
            accepted = number % (len(proposal) + 1)
            drafter.accept(accepted, extra[0])
            tokens += proposal[:accepted] + [extra[0]]
        elif action == "extend":
            drafter.extend(extra)
            tokens += extra
        else:
            length = number % (len(tokens) + 1)
            drafter.rollback(length)
            del tokens[length:]
        fresh = started(tokens, corpus)
        assert drafter.committed == tokens
        assert drafter.index.heads == fresh.index.heads
        assert drafter.index.prev == fresh.index.prev
        for k in (1, 3, 8):
            assert drafter.propose(k) == fresh.propose(k)


# ---- the shared corpus --------------------------------------------------------------


def test_finish_adds_the_whole_sequence_once() -> None:
    corpus = SharedCorpus(1000)
    drafter = started(RUN[:10], corpus)
    drafter.accept(0, 7)
    drafter.extend([8, 9])
    drafter.finish()
    drafter.finish()
    stats = corpus.stats()
    assert (stats.documents, stats.tokens) == (1, 13)
    # A later request of the scope continues from it.
    later = started([1, 2, 3, *RUN[:10]], corpus)
    assert later.propose(3) == [7, 8, 9]
    assert later.last_from_corpus
    assert corpus.stats().hits == 1


def test_a_scope_never_sees_another_scopes_text() -> None:
    corpus = SharedCorpus(1000)
    finished(corpus, "alice", RUN)
    prompt = [1, 2, *RUN[:12]]
    assert started(prompt, corpus, "bob").propose(8) == []
    assert started(prompt, corpus, "").propose(8) == []
    assert started(prompt, corpus, "alice").propose(8) == RUN[12:20]
    assert corpus.stats().partitions == 1


def test_global_scope_shares_across_users() -> None:
    corpus = SharedCorpus(1000, scope_mode="global")
    finished(corpus, "alice", RUN)
    assert started([1, 2, *RUN[:12]], corpus, "bob").propose(8) == RUN[12:20]


def test_corpus_off_is_request_local() -> None:
    corpus = SharedCorpus(0)
    assert corpus.view("alice") is None
    corpus.add("alice", RUN)
    assert corpus.stats().documents == 0


def test_least_recently_used_documents_go_first_within_the_token_bound() -> None:
    corpus = SharedCorpus(100)
    docs = [[d * 1000 + i for i in range(40)] for d in range(4)]
    finished(corpus, "", docs[0])
    finished(corpus, "", docs[1])
    # A proposal drawing on doc 0 makes it the most recently used.
    assert started(docs[0][:10], corpus).propose(4) == docs[0][10:14]
    finished(corpus, "", docs[2])  # 120 tokens > 100: doc 1 goes, not doc 0
    stats = corpus.stats()
    assert (stats.documents, stats.tokens, stats.evictions) == (2, 80, 1)
    assert started(docs[1][:10], corpus).propose(4) == []
    assert started(docs[0][:10], corpus).propose(4) == docs[0][10:14]
    finished(corpus, "", docs[3])  # doc 2 is now the least recently used
    assert started(docs[2][:10], corpus).propose(4) == []
    assert corpus.stats().tokens <= 100
    # A document longer than the whole corpus keeps its last tokens.
    finished(corpus, "", list(range(5000, 5150)))
    assert (corpus.stats().documents, corpus.stats().tokens) == (1, 100)


@pytest.mark.parametrize("seed", range(4))
def test_chains_after_evictions_match_a_scan_of_live_documents(seed: int) -> None:
    rng = random.Random(seed)
    corpus = SharedCorpus(300, anchors=(2, 4))
    for _ in range(40):
        scope = rng.choice(["a", "b"])
        corpus.add(scope, [rng.randrange(4) for _ in range(rng.randrange(1, 80))])
        if rng.random() < 0.3:  # touch a random live document
            live = list(corpus._recent.values())
            corpus.record_lookup([rng.choice(live)])
        for scope in ("a", "b"):
            documents = [d for d in corpus._recent.values() if d.partition == scope]
            documents.sort(key=lambda d: d.base)
            for level, n in enumerate(corpus.anchors):
                for key in {anchor_key(g, len(g), n) for g in _ngrams(4, n)}:
                    expected = [
                        (d.doc_id, offset)
                        for d in reversed(documents)
                        for offset in range(len(d.tokens) - 1, n - 1, -1)
                        if anchor_key(d.tokens, offset, n) == key
                    ]
                    found = corpus.occurrences(scope, level, key, 10_000)
                    assert [(d.doc_id, offset) for d, offset in found] == expected
        assert corpus.tokens == sum(len(d.tokens) for d in corpus._recent.values()) <= 300


def _ngrams(vocab: int, n: int) -> list[list[int]]:
    if n == 0:
        return [[]]
    return [[t, *rest] for t in range(vocab) for rest in _ngrams(vocab, n - 1)]


# ---- wiring -----------------------------------------------------------------------


def test_factory_gives_every_scope_its_view_of_one_corpus() -> None:
    factory = build_drafter(SpeculationConfig(type="suffix", corpus_tokens=500), None)
    assert factory.name == "suffix" and factory.corpus is not None
    drafter = factory.new_drafter("alice")
    assert isinstance(drafter, AutoNgramDrafter) and drafter.name == "suffix-auto"
    assert isinstance(drafter.inner, SuffixDrafter)
    drafter.begin(RUN)
    drafter.finish()  # through the auto wrapper
    assert factory.corpus.stats().documents == 1
    plain = build_drafter(SpeculationConfig(type="suffix", auto=False), None)
    alice = plain.new_drafter("alice")
    assert type(alice) is SuffixDrafter and alice.corpus.partition == "alice"
    assert plain.new_drafter().corpus.partition == ""
    off = build_drafter(SpeculationConfig(type="suffix", auto=False, corpus_tokens=0), None)
    assert off.new_drafter("alice").corpus is None


def test_config_keys_flags_and_errors() -> None:
    parser = argparse.ArgumentParser()
    add_speculation_arguments(parser)
    args = parser.parse_args(
        ["--spec-type", "suffix", "--corpus-tokens", "2000", "--corpus-scope", "global"]
    )
    config = resolve_speculation(cli_speculation_args(args), {}, "m", None)
    assert (config.type, config.corpus_tokens, config.corpus_scope) == ("suffix", 2000, "global")
    assert "corpus=2000/global" in config.describe()
    toml = {"defaults": {"speculative": {"type": "suffix", "corpus_tokens": 0}}}
    assert resolve_speculation({}, toml, "m", None).corpus_tokens == 0
    default = resolve_speculation({}, {}, "m", None)
    assert (default.type, default.corpus_tokens, default.corpus_scope) == (
        "suffix",
        1_000_000,
        "user",
    )
    with pytest.raises(InvalidRequest, match="corpus_tokens"):
        resolve_speculation({"corpus_tokens": -1}, {}, "m", None)
    bad = {"defaults": {"speculative": {"corpus_scope": "tenant"}}}
    with pytest.raises(InvalidRequest, match=r"\[defaults.speculative\]: corpus_scope"):
        resolve_speculation({}, bad, "m", None)
    with pytest.raises(InvalidRequest, match="ngram_max"):
        SuffixDrafter(ngram_min=4, ngram_max=2)
