"""Window policies on synthetic acceptance traces, the cost model, concurrency."""

from __future__ import annotations

import random

import pytest

from mesh.config import WindowPolicySpec
from mesh.errors import InvalidRequest
from mesh.speculative import (
    AdaptiveWindow,
    CostAwareWindow,
    FixedWindow,
    RoundContext,
    best_window,
    expected_tokens,
    make_policy,
    plan_window,
)

CTX = RoundContext()


def simulate(policy, alpha: float, rounds: int, base_s=0.020, per_token_s=0.001, seed=0):
    """Drive a policy with geometric acceptance and a linear round-time model."""
    rng = random.Random(seed)
    windows = []
    for _ in range(rounds):
        k = plan_window(policy, CTX)
        windows.append(k)
        accepted = 0
        while accepted < k and rng.random() < alpha:
            accepted += 1
        noise = 1.0 + 0.05 * (rng.random() - 0.5)
        policy.observe(k, accepted, (base_s + per_token_s * k) * noise, 1e-6 * k)
    return windows


def test_fixed_window() -> None:
    policy = FixedWindow(5)
    assert simulate(policy, 0.0, 10) == [5] * 10
    assert plan_window(policy, RoundContext(tokens_left=3)) == 2
    assert plan_window(policy, RoundContext(tokens_left=1)) == 0


def test_adaptive_grows_to_max_on_full_acceptance() -> None:
    assert simulate(AdaptiveWindow(2, 1, 12), 1.0, 12)[-1] == 12


def test_adaptive_shrinks_to_min_on_zero_acceptance() -> None:
    assert simulate(AdaptiveWindow(8, 2, 16), 0.0, 5)[1:] == [2, 2, 2, 2]


@pytest.mark.parametrize("run", [1, 3, 6])
def test_adaptive_converges_to_accepted_run_plus_one(run: int) -> None:
    policy = AdaptiveWindow(4, 1, 16)
    for _ in range(30):
        k = policy.next_window(CTX)
        policy.observe(k, min(k, run), 0.01, 0.0)
    assert policy.next_window(CTX) == run + 1


def test_adaptive_ignores_rounds_without_drafts_and_short_full_proposals() -> None:
    policy = AdaptiveWindow(6, 1, 16)
    policy.observe(0, 0, 0.01, 0.0)
    policy.observe(2, 2, 0.01, 0.0)  # the drafter had only 2 tokens: no evidence to grow
    assert policy.next_window(CTX) == 6


def test_expected_tokens_formula() -> None:
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 5) == 6.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def brute_force_best(alpha, base, per, cost, lo, hi, margin):
    rates = {0: 1 / base * (1 + margin)}
    for k in range(lo, hi + 1):
        rates[k] = expected_tokens(alpha, k) / (base + (per + cost) * k)
    return max(rates, key=lambda k: (rates[k], -k))


@pytest.mark.parametrize("alpha", [0.0, 0.2, 0.5, 0.8, 0.95])
@pytest.mark.parametrize(("per", "cost"), [(0.0005, 0.0), (0.002, 0.0), (0.0005, 0.003)])
def test_best_window_maximises_tokens_per_second(alpha, per, cost) -> None:
    got = best_window(alpha, 0.02, per, cost, 1, 16, margin=0.03)
    assert got == brute_force_best(alpha, 0.02, per, cost, 1, 16, 0.03)


def test_best_window_respects_min_window_and_turns_off() -> None:
    assert best_window(0.9, 0.02, 0.0005, 0.0, 6, 8) >= 6
    assert best_window(0.0, 0.02, 0.0005, 0.0, 1, 16) == 0
    # An expensive draft model can make speculation not pay even at good acceptance.
    assert best_window(0.6, 0.02, 0.0005, 0.03, 1, 16) == 0


def test_cost_aware_high_acceptance_gives_large_windows() -> None:
    windows = simulate(CostAwareWindow(4, 1, 16), 0.9, 200)
    assert min(windows[50:]) >= 8


def test_cost_aware_moderate_acceptance_gives_small_windows() -> None:
    windows = simulate(CostAwareWindow(8, 1, 16), 0.5, 200)
    assert 1 <= min(windows[100:]) and max(windows[100:]) <= 5


def test_cost_aware_zero_acceptance_switches_off_and_reprobes() -> None:
    policy = CostAwareWindow(4, 1, 16)
    windows = simulate(policy, 0.0, 300)
    tail = windows[50:]
    assert tail.count(0) >= 0.9 * len(tail)
    assert any(w > 0 for w in tail), "no re-probe while switched off"
    assert policy.probe_interval > 16  # failed probes back off


def test_cost_aware_recovers_when_acceptance_returns() -> None:
    policy = CostAwareWindow(4, 1, 16, max_probe_interval=32)
    assert simulate(policy, 0.0, 100)[-10:].count(0) >= 9
    windows = simulate(policy, 0.95, 200, seed=1)
    assert min(windows[-50:]) >= 8


def test_cost_aware_expensive_draft_turns_off() -> None:
    policy = CostAwareWindow(4, 1, 16)
    rng = random.Random(3)
    windows = []
    for _ in range(200):
        k = plan_window(policy, CTX)
        windows.append(k)
        accepted = 0
        while accepted < k and rng.random() < 0.5:
            accepted += 1
        # Each draft token costs as much as a whole verify round.
        policy.observe(k, accepted, 0.02 + 0.0005 * k, 0.02 * k)
    assert windows[100:].count(0) >= 80


def test_cost_aware_fits_round_time_model() -> None:
    policy = CostAwareWindow(4, 1, 16)
    assert policy.round_time_model() is None
    assert policy.next_window(CTX) == 4
    for k in [0, 2, 4, 8, 16, 1, 3] * 5:
        policy.observe(k, 0, 0.03 + 0.002 * k, 0.0)
    base, per = policy.round_time_model()
    assert base == pytest.approx(0.03, rel=0.05)
    assert per == pytest.approx(0.002, rel=0.1)


def test_cost_aware_uses_drafter_cost_until_measured() -> None:
    policy = CostAwareWindow(4, 1, 16)
    policy.observe(0, 0, 0.02, 0.0)
    assert policy.draft_cost(RoundContext(draft_cost_per_token_s=0.5)) == 0.5
    assert plan_window(policy, RoundContext(draft_cost_per_token_s=0.5)) == 0


@pytest.mark.parametrize(
    ("window", "share", "expected"), [(16, None, 16), (16, 7, 7), (4, 7, 4), (16, 0, 0)]
)
def test_the_step_share_caps_the_window(window, share, expected) -> None:
    assert plan_window(FixedWindow(window), RoundContext(draft_share=share)) == expected
    assert plan_window(FixedWindow(window), RoundContext(draft_share=share, tokens_left=3)) == min(
        expected, 2
    )


def test_make_policy_and_bounds() -> None:
    assert isinstance(make_policy(WindowPolicySpec("fixed", 3, 1, 8)), FixedWindow)
    assert isinstance(make_policy(WindowPolicySpec("adaptive", 3, 1, 8)), AdaptiveWindow)
    assert isinstance(make_policy(WindowPolicySpec()), CostAwareWindow)
    with pytest.raises(InvalidRequest):
        make_policy(WindowPolicySpec("greedy", 3, 1, 8))
    with pytest.raises(InvalidRequest, match="min_window"):
        AdaptiveWindow(2, 4, 8)
