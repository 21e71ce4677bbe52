"""The fast paths of token choice give the choices of the plain ones: the first
maximum through numpy, and top-p from the tokens above a floor."""

from __future__ import annotations

import pytest
import torch

from mesh.sampling import first_maxima, nucleus, sample_token
from mesh.types import SamplingParams


def sorted_nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Top-p by sorting the whole vocabulary (the definition)."""
    values, order = torch.sort(probs, descending=True)
    before = torch.cumsum(values, dim=-1) - values
    values = values.masked_fill(before >= top_p, 0.0)
    kept = torch.zeros_like(probs).scatter(0, order, values)
    return kept / kept.sum()


def tie_at_the_boundary(probs: torch.Tensor, kept: torch.Tensor) -> bool:
    """Whether a token left out has the probability of the least likely token kept
    (then which of those equal tokens is kept is the sort's choice)."""
    least = probs[kept > 0].min()
    return bool(((probs == least) & (kept == 0)).any())


def assert_same_nucleus(probs: torch.Tensor, top_p: float) -> None:
    fast, plain = nucleus(probs, top_p), sorted_nucleus(probs, top_p)
    if not tie_at_the_boundary(probs, plain):
        assert torch.equal(fast, plain)
        return
    # Equal tokens at the boundary: as many kept, the same mass (the sum's order may
    # differ by where they sit).
    assert int((fast > 0).sum()) == int((plain > 0).sum())
    assert torch.allclose(fast.sort().values, plain.sort().values, rtol=1e-6, atol=0)


@pytest.mark.parametrize("vocab", [2, 9, 1000, 49152])
@pytest.mark.parametrize("scale", [0.1, 1.0, 4.0, 12.0, 40.0])
def test_top_p_keeps_what_sorting_everything_keeps(vocab: int, scale: float) -> None:
    generator = torch.Generator().manual_seed(vocab)
    for _ in range(3):
        probs = torch.softmax(torch.randn(vocab, generator=generator) * scale, dim=-1)
        for top_p in (1e-3, 0.3, 0.9, 0.95, 0.999, 1 - 1e-7):
            assert_same_nucleus(probs, top_p)


def test_top_p_with_tokens_ruled_out_and_equal_probabilities() -> None:
    """Tokens of probability 0 (a logit of -inf) and many exact ties."""
    generator = torch.Generator().manual_seed(5)
    for _ in range(200):
        logits = torch.randint(0, 6, (500,), generator=generator).float()
        logits[torch.randint(0, 500, (100,), generator=generator)] = float("-inf")
        probs = torch.softmax(logits, dim=-1)
        for top_p in (0.2, 0.9):
            assert_same_nucleus(probs, top_p)


def test_top_p_of_a_vector_with_nan_falls_back_to_the_sort() -> None:
    probs = torch.tensor([float("nan"), 0.5, 0.5])
    assert torch.equal(nucleus(probs, 0.9).isnan(), sorted_nucleus(probs, 0.9).isnan())


def test_first_maxima_is_torch_argmax() -> None:
    generator = torch.Generator().manual_seed(1)
    rows = torch.randn(5, 49152, generator=generator)
    assert first_maxima(rows) == torch.argmax(rows, dim=-1).tolist()
    assert first_maxima(rows[2]) == [int(torch.argmax(rows[2]))]
    # The first of equal maxima, a NaN as the maximum, a row of -inf, other dtypes.
    assert first_maxima(torch.tensor([[1.0, 3.0, 3.0], [2.0, float("nan"), 5.0]])) == [1, 1]
    assert first_maxima(torch.full((4,), float("-inf"))) == [0]
    assert first_maxima(torch.tensor([1.0, 7.0, 7.0], dtype=torch.bfloat16)) == [1]
    assert first_maxima(torch.tensor([1.0, 7.0, 2.0], dtype=torch.float64)) == [1]


def test_sampled_tokens_do_not_depend_on_the_path() -> None:
    """sample_token with top-p over distinct probabilities draws what the plain
    definition draws, at every position and seed."""
    logits = torch.randn(3000, generator=torch.Generator().manual_seed(2)) * 6
    for top_p in (0.5, 0.95):
        params = SamplingParams(temperature=0.8, top_p=top_p, seed=11)
        probs = sorted_nucleus(torch.softmax(logits / 0.8, dim=-1), top_p)
        for position in range(40):
            token = sample_token(logits, params, position)
            assert probs[token] > 0
        # And the same draw twice.
        assert [sample_token(logits, params, p) for p in range(20)] == [
            sample_token(logits, params, p) for p in range(20)
        ]
