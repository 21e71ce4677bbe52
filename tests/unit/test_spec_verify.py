"""Verifier: greedy rules, stop handling, and a chi-square test that speculative
sampling preserves the target distribution (and that a wrong rule fails it)."""

from __future__ import annotations

import functools
import random

import pytest
import torch

from mesh.errors import Fatal
from mesh.sampling import sample_token, token_probs
from mesh.speculative import VerifyResult, truncate_at_stop, verify_window
from mesh.types import SamplingParams

V = 6
TEMP = 0.8
POS_FIRST = 10
SAMPLES = 8000
# A 2-step toy model: logits of the first token, then of the next token given the previous.
L0 = torch.tensor([0.9, 0.2, -0.4, 0.5, 0.0, -0.8])
L1 = torch.tensor(
    [
        [0.5, -0.2, 0.1, 0.8, -0.6, 0.0],
        [-0.3, 0.7, 0.2, -0.1, 0.4, 0.1],
        [0.0, 0.3, 0.9, -0.5, 0.2, -0.2],
        [0.6, 0.1, -0.4, 0.3, 0.0, 0.5],
        [-0.7, 0.2, 0.4, 0.1, 0.8, -0.1],
        [0.2, -0.5, 0.0, 0.6, 0.3, 0.7],
    ]
)
# Chi-square critical value for 35 degrees of freedom (36 cells) at p = 0.001.
CRITICAL_DF35_P001 = 66.619


def critical_value(df: int) -> float:
    try:
        from scipy.stats import chi2
    except ImportError:
        assert df == 35
        return CRITICAL_DF35_P001
    return float(chi2.ppf(0.999, df))


def params(seed: int) -> SamplingParams:
    return SamplingParams(temperature=TEMP, seed=seed)


def analytic_joint() -> torch.Tensor:
    p0 = token_probs(L0, params(0)).double()
    p1 = torch.stack([token_probs(L1[a], params(0)).double() for a in range(V)])
    return p0[:, None] * p1


@functools.cache
def plain_pairs() -> list[tuple[int, int]]:
    return [plain_pair(seed) for seed in range(SAMPLES)]


def plain_pair(seed: int) -> tuple[int, int]:
    first = sample_token(L0, params(seed), POS_FIRST)
    return first, sample_token(L1[first], params(seed), POS_FIRST + 1)


def random_guess(rng: random.Random) -> list[int]:
    return [rng.randrange(V), rng.randrange(V)]


def mode_guess(rng: random.Random) -> list[int]:
    first = int(torch.argmax(L0))
    return [first, int(torch.argmax(L1[first]))]


def fixed_guess(rng: random.Random) -> list[int]:
    return [2, 4]


def speculative_pair(seed: int, drafts: list[int], rule=verify_window) -> tuple[tuple, int]:
    """Run verify rounds over the toy model until two tokens are emitted."""
    window = [0, *drafts]
    logits = torch.stack([L0, L1[drafts[0]], L1[drafts[1]]])
    result = rule(logits, window, params(seed), POS_FIRST)
    emitted = list(result.emitted)
    if len(emitted) < 2:
        follow = rule(torch.stack([L1[emitted[0]]]), [emitted[0]], params(seed), POS_FIRST + 1)
        emitted.append(follow.emitted[0])
    return (emitted[0], emitted[1]), result.accepted_count


def chi_square(pairs: list[tuple[int, int]]) -> float:
    counts = torch.zeros(V, V, dtype=torch.float64)
    for a, b in pairs:
        counts[a, b] += 1
    expected = analytic_joint() * len(pairs)
    assert float(expected.min()) >= 5.0, "toy tables leave a cell too small for chi-square"
    return float(((counts - expected) ** 2 / expected).sum())


def always_accept(logits, window, sampling, pos_first) -> VerifyResult:
    bonus = sample_token(logits[-1], sampling, pos_first + len(window) - 1)
    return VerifyResult(emitted=[*window[1:], bonus], accepted_count=len(window) - 1)


def accept_with_draft_probability(logits, window, sampling, pos_first) -> VerifyResult:
    """Keep d with probability p(d), else emit an ordinary draw (no residual)."""
    emitted = []
    for row, draft in enumerate(window[1:]):
        u = random.Random(sampling.seed * 1000 + pos_first + row).random()
        if u < float(token_probs(logits[row], sampling)[draft]):
            emitted.append(draft)
            continue
        emitted.append(sample_token(logits[row], sampling, pos_first + row))
        return VerifyResult(emitted=emitted, accepted_count=len(emitted) - 1)
    emitted.append(sample_token(logits[-1], sampling, pos_first + len(window) - 1))
    return VerifyResult(emitted=emitted, accepted_count=len(emitted) - 1)


# ---- greedy rules ---------------------------------------------------------------------


def one_hot_rows(targets: list[int], vocab: int = 10) -> torch.Tensor:
    logits = torch.full((len(targets), vocab), -5.0)
    for row, token in enumerate(targets):
        logits[row, token] = 5.0
    return logits


GREEDY = SamplingParams(temperature=0.0)


def test_greedy_all_drafts_match_emits_bonus() -> None:
    result = verify_window(one_hot_rows([4, 7, 1, 9]), [3, 4, 7, 1], GREEDY, POS_FIRST)
    assert result == VerifyResult(emitted=[4, 7, 1, 9], accepted_count=3)


def test_greedy_first_mismatch_emits_target_and_stops() -> None:
    result = verify_window(one_hot_rows([4, 7, 1, 9]), [3, 4, 8, 1], GREEDY, POS_FIRST)
    assert result == VerifyResult(emitted=[4, 7], accepted_count=1)
    result = verify_window(one_hot_rows([4, 7, 1, 9]), [3, 5, 7, 1], GREEDY, POS_FIRST)
    assert result == VerifyResult(emitted=[4], accepted_count=0)


def test_window_without_drafts_is_plain_decode() -> None:
    assert verify_window(one_hot_rows([6]), [3], GREEDY, POS_FIRST).emitted == [6]
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(1))
    sampled = verify_window(logits, [3], params(7), 42).emitted
    assert sampled == [sample_token(logits[0], params(7), 42)]


def test_greedy_fast_path_breaks_ties_like_sample_token() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0]])
    expected = [sample_token(row, GREEDY, 0) for row in logits]
    assert verify_window(logits, [0, expected[0]], GREEDY, 1).emitted == expected
    top_k_one = SamplingParams(temperature=0.7, top_k=1, seed=3)
    assert verify_window(logits, [0, 1], top_k_one, 1).emitted == expected


def test_sampled_rows_use_absolute_positions() -> None:
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(2))
    sampling = params(11)
    draws = [sample_token(logits[i], sampling, 100 + i) for i in range(4)]
    result = verify_window(logits, [0, *draws[:3]], sampling, 100)
    assert result == VerifyResult(emitted=draws, accepted_count=3)


def test_mismatched_logits_shape_is_rejected() -> None:
    with pytest.raises(Fatal, match="logits have shape"):
        verify_window(torch.zeros(2, 5), [1, 2, 3], GREEDY, 0)
    with pytest.raises(Fatal):
        verify_window(torch.zeros(0, 5), [], GREEDY, 0)


# ---- stop handling --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("emitted", "left", "expected"),
    [
        ([5, 6, 7], 10, ([5, 6, 7], None)),
        ([5, 2, 7], 10, ([5, 2], "stop")),
        ([5, 6, 7, 8], 2, ([5, 6], "length")),
        ([5, 2, 7], 2, ([5, 2], "stop")),
        ([2], 1, ([2], "stop")),
        ([5, 6], 0, ([], "length")),
        ([5, 6, 99], 10, ([5, 6, 99], "stop")),
    ],
)
def test_truncate_at_stop(emitted, left, expected) -> None:
    assert truncate_at_stop(emitted, eos_ids={2, 99}, max_new_tokens_left=left) == expected


# ---- distribution preservation --------------------------------------------------------


@pytest.mark.parametrize("guess", [random_guess, mode_guess, fixed_guess])
def test_speculation_preserves_joint_distribution(guess) -> None:
    rng = random.Random(1234)
    plain, spec, accepted = plain_pairs(), [], 0
    for seed in range(SAMPLES):
        pair, kept = speculative_pair(seed, guess(rng))
        spec.append(pair)
        accepted += kept
    # Same seed, same positions: speculation reproduces plain sampling token for token.
    assert spec == plain
    assert accepted > SAMPLES // 20, "the drafts were never accepted; the test proves nothing"
    critical = critical_value(V * V - 1)
    assert chi_square(plain) < critical
    assert chi_square(spec) < critical


@pytest.mark.parametrize("rule", [always_accept, accept_with_draft_probability])
def test_wrong_rule_fails_the_same_check(rule) -> None:
    rng = random.Random(1234)
    pairs = [speculative_pair(seed, fixed_guess(rng), rule)[0] for seed in range(SAMPLES)]
    assert chi_square(pairs) > critical_value(V * V - 1)
