"""Seeds and ties in the sampler (mesh/sampling.py): every bit of a seed counts, and
at exactly equal logits the token greedy decoding picks (the lowest id) is the one
top-k 1 and top-p 0 keep and the first ``top_logprobs`` lists. Quantised heads give
exact ties often (log-probabilities in steps of 1/16 on the int4 SmolLM2 package)."""

from __future__ import annotations

import statistics

import torch

from mesh.sampling import (
    first_maxima,
    likeliest,
    sample_token,
    token_logprob,
    uniform_draw,
)
from mesh.types import SamplingParams


def test_every_bit_of_the_seed_changes_the_draws() -> None:
    """A torch generator keeps only its seed's low 32 bits: seeds 2^63 apart (or 2^32
    apart in the mixed value) used to draw alike."""
    for seed in (0, 5, 2**40 + 3):
        for other in (seed + 2**63, seed + 2**32, seed ^ 1, seed + 2**62):
            draws = [uniform_draw(seed, p) for p in range(8)]
            assert draws != [uniform_draw(other % 2**64, p) for p in range(8)]
    # A negative seed is its 64-bit two's complement.
    assert uniform_draw(-1, 7) == uniform_draw(2**64 - 1, 7)
    # Positions and nearby seeds give unrelated draws in [0, 1).
    draws = [uniform_draw(seed, position) for seed in range(50) for position in range(200)]
    assert all(0.0 <= d < 1.0 for d in draws)
    assert abs(statistics.fmean(draws) - 0.5) < 0.02
    assert len(set(draws)) == len(draws)


def test_ties_go_to_the_lowest_id_everywhere() -> None:
    logits = torch.full((64,), -5.0)
    logits[[9, 41, 17]] = 2.0  # a three-way tie at the top
    logits[30] = 1.0
    assert first_maxima(logits) == [9]
    assert likeliest(logits, 1) == [9]
    assert likeliest(logits, 4) == [9, 17, 41, 30]
    greedy = sample_token(logits, SamplingParams(temperature=0.0), 3)
    for params in (SamplingParams(temperature=1.0, seed=seed, top_k=1) for seed in range(20)):
        assert sample_token(logits, params, 3) == greedy
    for params in (SamplingParams(temperature=1.0, seed=seed, top_p=1e-9) for seed in range(20)):
        assert sample_token(logits, params, 3) == greedy
    # Unconstrained sampling does draw among the tied tokens.
    drawn = {sample_token(logits, SamplingParams(temperature=1.0, seed=s), 3) for s in range(60)}
    assert {9, 17, 41} <= drawn
    logprob, top = token_logprob(logits, SamplingParams(top_logprobs=3), 9)
    assert [index for index, _ in top] == [9, 17, 41] and top[0][1] == logprob


def test_top_logprobs_leave_out_what_a_grammar_forbids() -> None:
    logits = torch.full((32,), float("-inf"))
    logits[4] = 0.5  # the one token the grammar allows here
    logprob, top = token_logprob(logits, SamplingParams(top_logprobs=5), 4)
    assert logprob == 0.0 and top == ((4, 0.0),)
