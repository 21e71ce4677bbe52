"""The stage-0 speculation loop over a toy target: drafter + policy + verifier give
exactly the tokens of plain decoding (greedy and sampled), EOS and max_tokens
included. This is also the reference for how a caller drives the components."""

from __future__ import annotations

import time

import pytest
import torch

from mesh.config import SpeculationConfig, WindowPolicySpec
from mesh.sampling import sample_token
from mesh.speculative import (
    RoundContext,
    Telemetry,
    build_drafter,
    plan_window,
    truncate_at_stop,
    verify_window,
)
from mesh.types import SamplingParams

V = 16
EOS = 15


def toy_table(seed: int) -> torch.Tensor:
    """Next-token logits given the previous token: mostly a cycle, with some noise."""
    table = torch.randn(V, V, generator=torch.Generator().manual_seed(seed))
    for token in range(V):
        table[token, (token + 1) % (V - 1)] += 4.0
    table[:, EOS] -= 2.0
    return table


def plain_decode(table, prompt, params, max_tokens):
    out = []
    while len(out) < max_tokens:
        token = sample_token(table[(prompt + out)[-1]], params, position=len(prompt) + len(out))
        out.append(token)
        if token == EOS:
            break
    return out


def speculative_decode(table, prompt, params, max_tokens, config, factory=None):
    factory = factory or build_drafter(config, target_tokenizer=None)
    drafter, policy, telemetry = factory.new_drafter(), factory.new_policy(), Telemetry()
    drafter.begin(prompt, "```\ncode\n```")
    # Prefill: the last stage samples the first token at position len(prompt).
    first = sample_token(table[prompt[-1]], params, position=len(prompt))
    out, reason = truncate_at_stop([first], {EOS}, max_tokens)
    drafter.accept(0, first)
    while reason is None:
        state = RoundContext(
            tokens_left=max_tokens - len(out), draft_cost_per_token_s=drafter.cost_per_token_s
        )
        started = time.perf_counter()
        drafts = drafter.propose(plan_window(policy, state))
        draft_time_s = time.perf_counter() - started
        window = [drafter.last_token, *drafts]
        pos_start = drafter.committed_length - 1  # position of the current token
        started = time.perf_counter()
        logits = table[torch.tensor(window)]  # what the last stage computes
        result = verify_window(logits, window, params, pos_first=pos_start + 1)
        round_time_s = time.perf_counter() - started
        tokens, reason = truncate_at_stop(result.emitted, {EOS}, max_tokens - len(out))
        drafter.accept(result.accepted_count, result.emitted[-1])
        policy.observe(len(drafts), result.accepted_count, round_time_s, draft_time_s)
        telemetry.record_round(len(drafts), result.accepted_count, len(tokens))
        out += tokens
    drafter.finish()
    return out, telemetry


CONFIGS = [
    SpeculationConfig(auto=False, window_policy=WindowPolicySpec("fixed", 6, 1, 6)),
    SpeculationConfig(window_policy=WindowPolicySpec("adaptive", 4, 1, 16)),
    SpeculationConfig(ngram_memory=False, ngram_min=1, ngram_max=3),
    SpeculationConfig(type="suffix", auto=False, window_policy=WindowPolicySpec("fixed", 6, 1, 6)),
    SpeculationConfig(type="suffix", window_policy=WindowPolicySpec("adaptive", 4, 1, 16)),
]
IDS = ["fixed", "adaptive", "cost", "suffix-fixed", "suffix-adaptive"]


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_speculative_loop_equals_plain_decoding(config, temperature) -> None:
    accepted = 0
    for seed in range(8):
        table = toy_table(seed)
        prompt = [3, 4, 5, 6, 7, 8, 9, 3, 4]
        params = SamplingParams(temperature=temperature, seed=seed)
        max_tokens = 40 + seed
        spec, telemetry = speculative_decode(table, prompt, params, max_tokens, config)
        assert spec == plain_decode(table, prompt, params, max_tokens)
        assert telemetry.emitted == len(spec) - 1  # the first token came from the prefill
        accepted += telemetry.accepted
    assert accepted > 0, "no draft was ever accepted; the loop test proves nothing"


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_suffix_corpus_carries_one_request_to_the_next(temperature) -> None:
    """A second request whose prompt ends like the first one's drafts from the first
    one's answer through the corpus: more accepted drafts, the same tokens."""
    config = SpeculationConfig(
        type="suffix", auto=False, window_policy=WindowPolicySpec("fixed", 8, 1, 8)
    )
    for seed in range(4):
        table = toy_table(seed)
        params = SamplingParams(temperature=temperature, seed=seed)
        first_prompt = [1, 2, 3, 9, 4, 5, 6, 7, 8]
        second_prompt = [12, 13, 10, 9, 4, 5, 6, 7, 8]  # same length: same positions
        shared = build_drafter(config, target_tokenizer=None)
        speculative_decode(table, first_prompt, params, 40, config, shared)
        second, helped = speculative_decode(table, second_prompt, params, 40, config, shared)
        alone, unhelped = speculative_decode(table, second_prompt, params, 40, config)
        assert second == alone == plain_decode(table, second_prompt, params, 40)
        assert helped.accepted > unhelped.accepted
        assert shared.corpus.stats().hits > 0
