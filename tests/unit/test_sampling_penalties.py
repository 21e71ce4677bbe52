"""Penalties, logit_bias and min_p in the position-keyed sampler, and speculation
with them: a verify window chooses each row exactly as plain decoding would."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from mesh.codec import sampling_from_proto, sampling_to_proto, segment_problem
from mesh.errors import InvalidRequest
from mesh.proto.v1 import data_pb2
from mesh.sampling import adjust_logits, sample_token, token_probs
from mesh.speculative.verify import verify_window
from mesh.types import SamplingParams


def test_adjustments_follow_the_documented_order() -> None:
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0])
    params = SamplingParams(
        repetition_penalty=2.0,
        frequency_penalty=0.5,
        presence_penalty=0.25,
        logit_bias=((1, 5.0), (4, -100.0)),
        prompt_tokens=2,
    )
    # Prompt [0, 4]; output [2, 2, 3].
    got = adjust_logits(logits, params, [0, 4, 2, 2, 3])
    # repetition: 0 -> 1.0, 4 -> -4.0, 2 -> 0.25, 3 -> 1.5 (seen anywhere);
    # frequency and presence on the output only: 2 -> 0.25 - 1.0 - 0.25, 3 -> 1.5 - 0.5 - 0.25;
    # bias: 1 -> -1 + 5, 4 -> -4 - 100.
    assert got.tolist() == pytest.approx([1.0, 4.0, -1.0, 0.75, -104.0])
    assert logits.tolist() == [2.0, -1.0, 0.5, 3.0, -2.0]  # the input is not changed
    plain = SamplingParams()
    assert adjust_logits(logits, plain, [0, 1]) is logits


def test_penalties_change_greedy_choices() -> None:
    logits = torch.tensor([0.0, 3.0, 2.9])
    assert sample_token(logits, SamplingParams(), 5) == 1
    repeated = SamplingParams(frequency_penalty=0.2, prompt_tokens=1)
    assert sample_token(logits, repeated, 5, history=[0, 1]) == 2
    # A prompt token is not an output token for frequency and presence.
    assert (
        sample_token(logits, SamplingParams(presence_penalty=2.0, prompt_tokens=2), 5, [0, 1]) == 1
    )
    assert sample_token(logits, SamplingParams(logit_bias=((0, 10.0),)), 5) == 0


def test_min_p_drops_unlikely_tokens() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    probs = token_probs(logits, SamplingParams(temperature=1.0, min_p=0.25))
    # Tokens below 0.25 * 0.5 are dropped, the rest renormalised.
    assert probs.tolist() == pytest.approx([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0])


def plain_decode(
    logits: torch.Tensor, history: list[int], params: SamplingParams, pos_first: int
) -> list[int]:
    """Row by row as plain decoding: each row's token chosen after everything before."""
    seen = list(history)
    out = []
    for row in range(logits.shape[0]):
        token = sample_token(logits[row], params, pos_first + row, seen)
        out.append(token)
        seen.append(token)
    return out


PARAMS = [
    SamplingParams(frequency_penalty=1.5, prompt_tokens=4),
    SamplingParams(presence_penalty=-1.0, repetition_penalty=1.3, prompt_tokens=4),
    SamplingParams(temperature=0.9, seed=11, frequency_penalty=0.7, min_p=0.05, prompt_tokens=4),
    SamplingParams(temperature=1.2, seed=3, top_k=5, repetition_penalty=0.8, prompt_tokens=4),
    SamplingParams(logit_bias=((3, 2.0), (7, -3.0))),
    SamplingParams(temperature=0.7, seed=5, logit_bias=((1, 1.5),), presence_penalty=0.4),
    # min_tokens: the held-back tokens are ruled out for the output's first 3 tokens
    # (row by row in a window: the window's earlier tokens count as output).
    SamplingParams(min_tokens=3, hold_back=(0, 1, 2, 3), prompt_tokens=4),
    SamplingParams(temperature=0.8, seed=2, min_tokens=2, hold_back=(5,), prompt_tokens=6),
    # llama.cpp's samplers: DRY on the history (greedy and sampled, with breakers and a
    # window), the penalties' window, and the distribution filters when sampling.
    SamplingParams(dry_multiplier=2.0, dry_allowed_length=1, prompt_tokens=4),
    SamplingParams(
        temperature=0.9, seed=4, dry_multiplier=0.8, dry_breakers=(3,), dry_penalty_last_n=6
    ),
    SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5, penalty_last_n=3),
    SamplingParams(temperature=1.1, seed=8, typical_p=0.6, top_n_sigma=1.0),
    SamplingParams(temperature=1.0, seed=9, xtc_probability=0.7, xtc_threshold=0.05),
    SamplingParams(temperature=0.8, seed=10, dynatemp_range=0.6, dynatemp_exponent=2.0),
]


@pytest.mark.parametrize("params", PARAMS)
def test_verify_windows_choose_what_plain_decoding_chooses(params: SamplingParams) -> None:
    """For random logits and drafts that follow plain decoding for a while, the
    window keeps exactly the plain tokens and emits the plain token at the first
    mismatch; each row's penalties include the window's earlier tokens."""
    rng = random.Random(7)
    vocab = 12
    for trial in range(60):
        torch.manual_seed(trial)
        history = [rng.randrange(vocab) for _ in range(rng.randrange(4, 12))]
        rows = rng.randrange(1, 7)
        # Peaked logits so that penalties decide often.
        logits = torch.randn(rows, vocab) * 2
        pos_first = len(history) + 1
        current = history.pop()
        plain = plain_decode(logits, [*history, current], params, pos_first)
        # The drafts follow plain decoding for ``agree`` tokens, then (if the window
        # goes on) one differs and the rest are random.
        agree = rng.randrange(rows)
        drafts = plain[:agree]
        if agree < rows - 1:
            drafts.append((plain[agree] + 1) % vocab)
            drafts += [rng.randrange(vocab) for _ in range(rows - 2 - agree)]
        verdict = verify_window(logits, [current, *drafts], params, pos_first, history)
        kept = verdict.accepted_count
        assert verdict.emitted == plain[: kept + 1], (trial, drafts, plain)
        assert drafts[:kept] == plain[:kept]
        assert kept == len(drafts) or drafts[kept] != plain[kept]


def test_sampling_travels_whole_and_bad_values_fail_their_segment() -> None:
    params = SamplingParams(
        temperature=0.5,
        top_p=0.9,
        top_k=40,
        seed=9,
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        repetition_penalty=1.1,
        min_p=0.05,
        logit_bias=((2, -100.0), (17, 3.5)),
        prompt_tokens=321,
        min_tokens=4,
        hold_back=(0, 2),
        penalty_last_n=64,
        typical_p=0.95,
        top_n_sigma=1.5,
        xtc_probability=0.25,
        xtc_threshold=0.2,
        dry_multiplier=0.8,
        dry_base=2.0,
        dry_allowed_length=3,
        dry_penalty_last_n=128,
        dry_breakers=(5, 9),
        dynatemp_range=0.3,
        dynatemp_exponent=1.5,
    )
    assert sampling_from_proto(sampling_to_proto(params)) == params
    # Values that tune a sampler that is off take their defaults on the way.
    off = SamplingParams(xtc_threshold=0.3, dry_allowed_length=5, dynatemp_exponent=3.0)
    assert sampling_from_proto(sampling_to_proto(off)) == SamplingParams()
    segment = data_pb2.Segment(
        request_id="r",
        session_id="s",
        kind=data_pb2.SEGMENT_KIND_PREFILL,
        token_count=1,
        token_ids=[1],
        sampling=sampling_to_proto(SamplingParams()),
    )
    assert segment_problem(segment) is None
    segment.sampling.frequency_penalty = 7.0
    problem = segment_problem(segment)
    assert problem is not None and "frequency_penalty must be in [-2, 2]" in problem.message
    with pytest.raises(InvalidRequest, match="logit_bias"):
        SamplingParams(logit_bias=((1, 500.0),))


def test_min_tokens_holds_the_stop_tokens_back_until_the_output_is_long_enough() -> None:
    params = SamplingParams(min_tokens=2, hold_back=(3,), prompt_tokens=2)
    logits = torch.tensor([0.0, 1.0, 0.5, 9.0])  # token 3 (the stop token) is likeliest
    assert sample_token(logits, params, 2, [7, 8]) == 1  # no output yet
    assert sample_token(logits, params, 3, [7, 8, 1]) == 1  # one output token
    assert sample_token(logits, params, 4, [7, 8, 1, 1]) == 3  # two: it may stop
    assert adjust_logits(logits, params, [7, 8])[3] == float("-inf")
    # Where nothing but the stop token is left (a grammar that is complete), it comes.
    ended = torch.tensor([float("-inf"), float("-inf"), float("-inf"), 2.0])
    assert sample_token(ended, params, 2, [7, 8]) == 3
    assert sample_token(ended, replace(params, temperature=0.9, seed=4), 2, [7, 8]) == 3
    # Without held-back tokens min_tokens changes nothing.
    assert adjust_logits(logits, SamplingParams(min_tokens=5), [7, 8]) is logits
    with pytest.raises(InvalidRequest, match="min_tokens"):
        SamplingParams(min_tokens=-1)
