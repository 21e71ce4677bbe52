"""llama.cpp's samplers (mesh/sampling.py): DRY against a direct search for repeats,
typical sampling, top-n-sigma, XTC and dynamic temperature against their
definitions; each keyed only by its inputs, so verify windows choose what plain
decoding chooses (tests/unit/test_sampling_penalties.py)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mesh.sampling import (
    adjust_logits,
    dry_repeats,
    exclude_top_choices,
    sample_token,
    token_probs,
    typical,
)
from mesh.types import SamplingParams


def repeats_by_search(
    history: list[int], allowed: int, breakers: tuple[int, ...], window: int
) -> dict[int, int]:
    """DRY's repeats found the slow way: for every earlier place, how many tokens
    before it equal the text's last ones (never across a breaker)."""
    seq = history[-window:] if window else list(history)
    found: dict[int, int] = {}
    if len(seq) < 2 or seq[-1] in breakers:
        return found
    for follow in range(1, len(seq)):
        length = 0
        while (
            length < follow
            and length < len(seq) - 1
            and length < 64
            and seq[follow - 1 - length] == seq[-1 - length]
            and seq[-1 - length] not in breakers
        ):
            length += 1
        if length >= max(1, allowed):
            token = seq[follow]
            found[token] = max(found.get(token, 0), length)
    return found


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 3), min_size=0, max_size=60),
    st.integers(0, 4),
    st.sets(st.integers(0, 3), max_size=2),
    st.sampled_from([0, 5, 20]),
)
def test_dry_finds_the_repeats_a_direct_search_finds(
    history: list[int], allowed: int, breakers: set[int], window: int
) -> None:
    params = SamplingParams(
        dry_multiplier=1.0,
        dry_allowed_length=allowed,
        dry_breakers=tuple(sorted(breakers)),
        dry_penalty_last_n=window,
    )
    want = repeats_by_search(history, allowed, tuple(breakers), window)
    assert dry_repeats(history, params) == want


def test_dry_penalises_the_token_that_would_extend_a_repeat() -> None:
    """``A B C D A B``: C would make ``A B`` a repeat of 3, so it loses multiplier *
    base ** (2 - allowed); a breaker (B) in the way stops it."""
    a, b, c, d = 10, 11, 12, 13
    history = [a, b, c, d, a, b]
    logits = torch.zeros(20)
    logits[c] = 1.0
    params = SamplingParams(dry_multiplier=0.8, dry_base=1.75, dry_allowed_length=1)
    adjusted = adjust_logits(logits, params, history)
    assert adjusted[c] == pytest.approx(1.0 - 0.8 * 1.75 ** (2 - 1))
    assert adjusted[d] == 0.0  # "B D" never occurred
    assert sample_token(logits, SamplingParams(), 6, history) == c
    assert sample_token(logits, params, 6, history) != c  # greedy requests too
    broken = SamplingParams(dry_multiplier=0.8, dry_allowed_length=1, dry_breakers=(b,))
    assert torch.equal(adjust_logits(logits, broken, history), logits)
    # Shorter than the allowed length: no penalty.
    long_allowed = SamplingParams(dry_multiplier=0.8, dry_allowed_length=3)
    assert adjust_logits(logits, long_allowed, history)[c] == 1.0


def test_the_penalty_window_counts_only_the_last_tokens() -> None:
    logits = torch.full((8,), 2.0)
    params = SamplingParams(repetition_penalty=2.0, penalty_last_n=2)
    adjusted = adjust_logits(logits, params, [1, 2, 3, 4])
    assert adjusted.tolist() == [2.0, 2.0, 2.0, 1.0, 1.0, 2.0, 2.0, 2.0]


def test_typical_keeps_the_tokens_nearest_the_entropy() -> None:
    probs = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    entropy = -(probs * probs.log()).sum()
    distance = (-probs.log() - entropy).abs()
    order = torch.argsort(distance).tolist()
    kept = typical(probs, 0.5)
    mass, want = 0.0, []
    for token in order:
        if mass >= 0.5:
            break
        want.append(token)
        mass += float(probs[token])
    assert sorted(torch.nonzero(kept).flatten().tolist()) == sorted(want)
    assert float(kept.sum()) == pytest.approx(1.0)
    assert torch.count_nonzero(typical(probs, 1e-6)) == 1


def test_top_n_sigma_keeps_logits_near_the_largest() -> None:
    logits = torch.tensor([5.0, 4.5, 1.0, 0.0, -1.0, -3.0])
    sigma = float(logits.std(unbiased=False))
    probs = token_probs(logits, SamplingParams(temperature=1.0, top_n_sigma=0.5))
    kept = set(torch.nonzero(probs).flatten().tolist())
    assert kept == {i for i, v in enumerate(logits.tolist()) if v >= 5.0 - 0.5 * sigma}
    # The same tokens at any temperature (the scale divides out).
    hot = token_probs(logits, SamplingParams(temperature=1.7, top_n_sigma=0.5))
    assert set(torch.nonzero(hot).flatten().tolist()) == kept


def test_xtc_drops_the_top_choices_but_the_least_likely_of_them() -> None:
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    always = SamplingParams(temperature=1.0, xtc_probability=1.0, xtc_threshold=0.15)
    dropped = exclude_top_choices(probs, always, position=3)
    assert torch.allclose(dropped, torch.tensor([0.0, 0.0, 2 / 3, 1 / 3]))
    # A threshold of 0 counts only the tokens still possible (the others stay out).
    zero = SamplingParams(temperature=1.0, xtc_probability=1.0, xtc_threshold=0.0)
    filtered = torch.tensor([0.5, 0.0, 0.3, 0.2, 0.0])
    assert torch.equal(exclude_top_choices(filtered, zero, 1), torch.tensor([0.0, 0, 0, 1, 0]))
    # One token above the threshold: nothing to exclude.
    single = SamplingParams(temperature=1.0, xtc_probability=1.0, xtc_threshold=0.35)
    assert torch.equal(exclude_top_choices(probs, single, 3), probs)
    # The draw is the position's: some positions exclude at probability 0.5, the same
    # ones every time.
    half = SamplingParams(temperature=1.0, seed=5, xtc_probability=0.5, xtc_threshold=0.15)
    hits = [not torch.equal(exclude_top_choices(probs, half, p), probs) for p in range(64)]
    again = [not torch.equal(exclude_top_choices(probs, half, p), probs) for p in range(64)]
    assert hits == again and 16 < sum(hits) < 48


def test_dynamic_temperature_follows_the_entropy() -> None:
    """A flat distribution gets the top of the range, a peaked one nearly the bottom."""
    params = SamplingParams(temperature=1.0, dynatemp_range=0.5)
    flat = torch.zeros(10)
    # At the top temperature (1.5) a flat distribution stays flat.
    assert torch.allclose(token_probs(flat, params), torch.full((10,), 0.1))
    peaked = torch.tensor([12.0] + [0.0] * 9)
    got = token_probs(peaked, params)
    share_entropy = token_probs(peaked, SamplingParams(temperature=1.0))
    entropy = float(-(share_entropy * share_entropy.clamp_min(1e-30).log()).sum())
    temperature = 0.5 + 1.0 * entropy / math.log(10)
    want = torch.softmax(peaked / temperature, dim=-1)
    assert torch.allclose(got, want, atol=1e-6)


def test_each_sampler_changes_sampled_tokens_and_stays_reproducible() -> None:
    torch.manual_seed(0)
    logits = torch.randn(64) * 2
    base = dict(temperature=1.0, seed=21)
    plain = [sample_token(logits, SamplingParams(**base), p) for p in range(200)]
    for extra in (
        {"typical_p": 0.3},
        {"top_n_sigma": 0.5},
        {"xtc_probability": 1.0, "xtc_threshold": 0.05},
        {"dynatemp_range": 0.9},
    ):
        params = SamplingParams(**base, **extra)
        drawn = [sample_token(logits, params, p) for p in range(200)]
        assert drawn != plain, extra
        assert drawn == [sample_token(logits, params, p) for p in range(200)]


def test_breakers_are_the_tokens_whose_text_holds_one(smollm2_tokenizer) -> None:
    from stage.frontend.dry import breaker_ids, token_texts

    texts = token_texts(smollm2_tokenizer)
    ids = breaker_ids(smollm2_tokenizer, ("\n", ":"))
    assert ids and all("\n" in texts[i] or ":" in texts[i] for i in ids)
    newline = smollm2_tokenizer.encode("\n", add_special_tokens=False)
    assert set(newline) <= set(ids)
    others = set(range(len(texts))) - set(ids)
    assert not any("\n" in texts[i] or ":" in texts[i] for i in others)
    assert breaker_ids(smollm2_tokenizer, ("\n", ":")) is ids  # kept


def test_llama_cpp_windows_and_off_values_map_to_the_wire() -> None:
    from stage.frontend.prepare import _sampling
    from stage.frontend.schemas import CompletionBody

    def sampling(**fields):
        body = CompletionBody(prompt="x", seed=1, **fields)
        return _sampling(body, 3, 100, breakers=(7,))

    off = sampling(repetition_penalty=1.3, presence_penalty=0.5, repeat_last_n=0)
    assert off.repetition_penalty == 1.0 and off.presence_penalty == 0.0
    assert sampling(repetition_penalty=1.3, repeat_last_n=-1).penalty_last_n == 0
    assert sampling(repetition_penalty=1.3, repeat_last_n=32).penalty_last_n == 32
    assert sampling(dry_multiplier=0.8, dry_penalty_last_n=0).dry_multiplier == 0.0
    dry = sampling(dry_multiplier=0.8, dry_penalty_last_n=-1)
    assert dry.dry_multiplier == 0.8 and dry.dry_penalty_last_n == 0 and dry.dry_breakers == (7,)
    assert sampling(top_n_sigma=-1.0).top_n_sigma == 0.0
    assert sampling().dry_breakers == () and sampling().xtc_threshold == 0.1


@settings(max_examples=400, deadline=None)
@given(
    st.lists(st.floats(-20, 20), min_size=2, max_size=24),
    st.lists(st.booleans(), min_size=24, max_size=24),
    st.fixed_dictionaries(
        {
            "temperature": st.floats(0.05, 2.0),
            "top_k": st.integers(0, 5),
            "top_p": st.floats(0.05, 1.0),
            "min_p": st.floats(0.0, 0.9),
            "typical_p": st.floats(0.01, 1.0),
            "top_n_sigma": st.floats(0.0, 3.0),
            "xtc_probability": st.floats(0.0, 1.0),
            "xtc_threshold": st.floats(0.0, 1.0),
            "dynatemp_range": st.floats(0.0, 2.0),
            "dynatemp_exponent": st.floats(0.1, 3.0),
            "dry_multiplier": st.floats(0.0, 100.0),
            "dry_base": st.floats(1.0, 10.0),
            "dry_allowed_length": st.integers(0, 3),
        }
    ),
    st.lists(st.integers(0, 23), max_size=30).map(lambda h: h + h + h),
    st.integers(0, 1000),
)
def test_any_mix_of_samplers_picks_a_possible_token(
    values: list[float], masked: list[bool], fields: dict, history: list[int], position: int
) -> None:
    """Whatever the mix, the token is one whose logit was finite (a grammar's mask
    is respected) and the draw is reproducible."""
    logits = torch.tensor(values)
    mask = torch.tensor(masked[: len(values)])
    mask[int(torch.argmax(logits))] = False  # at least one token stays possible
    logits = logits.masked_fill(mask, float("-inf"))
    params = SamplingParams(seed=3, **fields)
    token = sample_token(logits, params, position, history)
    assert 0 <= token < len(values) and math.isfinite(float(logits[token]))
    assert sample_token(logits, params, position, history) == token


def test_a_dry_penalty_stays_finite_so_the_only_possible_token_stays_possible() -> None:
    """100 * 10 ** 50 overflows float32: the penalty is capped, and a token a grammar
    alone allows is still chosen, greedy or sampled."""
    logits = torch.full((8,), float("-inf"))
    logits[7] = 1.0
    params = dict(dry_multiplier=100.0, dry_base=10.0, dry_allowed_length=0)
    history = [7] * 60
    adjusted = adjust_logits(logits, SamplingParams(**params), history)
    assert math.isfinite(float(adjusted[7])) and float(adjusted[7]) < -1e29
    assert sample_token(logits, SamplingParams(**params), 60, history) == 7
    sampled = SamplingParams(temperature=1.0, seed=1, **params)
    assert sample_token(logits, sampled, 60, history) == 7


@pytest.mark.parametrize("temperature", [1e-38, 1e-45, 1e-320, 1e-7])
def test_a_tiny_positive_temperature_samples_the_likeliest_token(temperature: float) -> None:
    """Logits divided by a temperature under 1e-6 would overflow float32 to infinity
    and the softmax to NaN (garbage tokens): it samples as 1e-6 does."""
    logits = torch.randn(2000, generator=torch.Generator().manual_seed(3)) * 20
    probs = token_probs(logits, SamplingParams(temperature=temperature, seed=1))
    assert torch.isfinite(probs).all()
    assert int(probs.argmax()) == int(logits.argmax()) and float(probs.max()) == 1.0
