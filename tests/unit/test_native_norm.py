"""RMSNorm on the stage's own kernel (kernels/norm.c) against transformers' formula."""

from __future__ import annotations

import pytest
import torch

from mesh.runtime import native, native_norm, qkernels
from mesh.runtime.block import rms_norm

pytestmark = pytest.mark.skipif(
    native.library() is None,
    reason="the stage's CPU kernels cannot be built or loaded on this machine",
)


@pytest.fixture(autouse=True)
def native_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(qkernels, "MODE", "auto")


def reference(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm, in float64 for the statistics."""
    wide = hidden.to(torch.float64)
    normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(hidden.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [576, 100, 16, 7, 2048])
def test_matches_the_formula(dtype: torch.dtype, dim: int) -> None:
    generator = torch.Generator().manual_seed(dim)
    hidden = (torch.randn(9, dim, generator=generator) * 4).to(dtype)
    weight = (torch.randn(dim, generator=generator) + 1).to(dtype)
    assert native_norm.usable(hidden, weight)
    out = native_norm.rms_norm(hidden, weight, 1e-5)
    assert out.dtype == dtype and out.shape == hidden.shape
    expected = reference(hidden, weight, 1e-5)
    # float32: summation order only; bfloat16: at most one rounding step apart.
    tolerance = 2e-6 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(out.float(), expected.float(), rtol=tolerance, atol=1e-6)
    if dtype == torch.bfloat16:  # and almost always the very value torch gives
        torch_path = rms_norm(hidden, weight, 1e-5)
        assert (out != torch_path).float().mean().item() < 0.01


def test_a_row_is_the_same_whatever_rows_share_the_call() -> None:
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(40, 576, generator=generator).to(torch.bfloat16)
    weight = torch.randn(576, generator=generator).to(torch.bfloat16)
    together = native_norm.rms_norm(hidden, weight, 1e-6)
    for start, stop in ((0, 1), (5, 6), (3, 20), (39, 40)):
        alone = native_norm.rms_norm(hidden[start:stop].contiguous(), weight, 1e-6)
        assert torch.equal(alone, together[start:stop])


def test_three_dimensional_rows_and_no_rows() -> None:
    hidden = torch.randn(2, 3, 64)
    weight = torch.randn(64)
    out = native_norm.rms_norm(hidden, weight, 1e-5)
    torch.testing.assert_close(out, reference(hidden, weight, 1e-5), rtol=2e-6, atol=1e-6)
    empty = torch.empty(0, 64)
    assert native_norm.rms_norm(empty, weight, 1e-5).shape == (0, 64)


def test_what_it_declines_goes_to_torch() -> None:
    weight = torch.randn(64)
    strided = torch.randn(4, 128)[:, :64]
    assert not native_norm.usable(strided, weight)
    assert not native_norm.usable(torch.randn(4, 64).half(), weight.half())
    assert not native_norm.usable(torch.randn(4, 64), weight.bfloat16())
    assert not native_norm.usable(torch.randn(4, 32), weight)
    # rms_norm with native=True still answers them, through torch.
    torch.testing.assert_close(
        rms_norm(strided, weight, 1e-5, native=True), rms_norm(strided, weight, 1e-5)
    )


def test_torch_mode_keeps_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(qkernels, "MODE", "torch")
    assert not native_norm.usable(torch.randn(2, 64), torch.randn(64))
