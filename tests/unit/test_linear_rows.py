"""Quantised linears on CPU: many-row calls dequantise and run a float32 GEMM, and
give what torch's weight-only kernels give, to bfloat16 rounding."""

from __future__ import annotations

import pytest
import torch

from mesh import quant
from mesh.runtime import linear as linear_module
from mesh.runtime import qkernels
from mesh.runtime.linear import (
    GEMM_ROWS,
    INT4_ACTIVATION_DTYPE,
    Int4Linear,
    Int8Linear,
    LinearSpec,
    build_linear,
    cpu_int4_block,
)

CPU = torch.device("cpu")
OUT, IN, GROUP = 128, 64, 32
# Both paths accumulate in float32 and round to bfloat16; they may differ by a unit in
# the last place of the output, or of the output's scale where a bias cancels it.
EPS = torch.finfo(torch.bfloat16).eps


@pytest.fixture(autouse=True)
def quantised_gemm_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests exercise the many-row path, which serving turns on with
    ``mesh-stage join --quantised-gemm``, on torch's weight-only kernels."""
    monkeypatch.setattr(linear_module, "QUANTISED_GEMM", True)
    monkeypatch.setattr(qkernels, "MODE", "torch")


def weight(rows: int = OUT, cols: int = IN, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.05


def activations(rows: int, cols: int = IN, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    column_scale = 1 + 3 * torch.rand(cols, generator=generator)  # uneven channels
    return torch.randn(rows, cols, generator=generator) * column_scale


def int4_linear(bias: bool, rows: int = OUT, dtype: torch.dtype = torch.bfloat16) -> Int4Linear:
    parts = quant.quantize_int4(weight(rows), GROUP)
    spec = LinearSpec(rows, IN, "int4", parts=parts, bias=weight(1, rows, 2)[0] if bias else None)
    linear = build_linear(spec, CPU, dtype)
    assert isinstance(linear, Int4Linear)
    return linear


def int8_linear(bias: bool, dtype: torch.dtype = torch.bfloat16) -> Int8Linear:
    parts = quant.quantize_int8(weight())
    spec = LinearSpec(OUT, IN, "int8", parts=parts, bias=weight(1, OUT, 2)[0] if bias else None)
    linear = build_linear(spec, CPU, dtype)
    assert isinstance(linear, Int8Linear)
    return linear


def assert_bfloat16_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    scale = float(expected.abs().max())
    torch.testing.assert_close(got.float(), expected.float(), rtol=2 * EPS, atol=2 * EPS * scale)


def kernel_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every row count on torch's kernel: what the linears computed before."""
    monkeypatch.setattr(linear_module, "GEMM_ROWS", 1 << 30)


def test_the_cpu_int4_layout_is_read_back_as_the_weight_the_kernel_multiplies() -> None:
    linear = int4_linear(bias=False)
    assert linear._block in (32, 64)
    parts = quant.quantize_int4(weight(), GROUP)
    codes = quant.unpack_int4(parts["qweight"]).to(torch.float32)
    scales = linear.scales_zeros[..., 0].t().float().repeat_interleave(GROUP, dim=1)
    zeros = linear.scales_zeros[..., 1].t().float().repeat_interleave(GROUP, dim=1)
    expected = (codes - 8) * scales + zeros
    torch.testing.assert_close(linear.dequantized_t().t(), expected, rtol=1e-6, atol=1e-7)
    # One identity row per input column reads the weight back out of the kernel too.
    eye = torch.eye(IN, dtype=INT4_ACTIVATION_DTYPE)
    by_kernel = linear._mm(eye, linear.packed, linear.group, linear.scales_zeros)
    assert_bfloat16_close(linear.dequantized_t(), by_kernel)


def test_an_unrecognised_int4_layout_keeps_every_row_count_on_the_kernel() -> None:
    codes = torch.randint(0, 16, (OUT, IN), dtype=torch.int32)
    assert cpu_int4_block(torch.zeros(OUT, IN // 2, dtype=torch.uint8), codes) == 0
    # 48 outputs: torch packs a partial block, which dequantized_t does not read.
    linear = int4_linear(bias=True, rows=48)
    assert linear._block == 0
    x = activations(GEMM_ROWS + 3)
    assert linear(x).shape == (GEMM_ROWS + 3, 48)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_many_rows_match_the_weight_only_kernel(
    kind: str, dtype: torch.dtype, bias: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    linear = int4_linear(bias, dtype=dtype) if kind == "int4" else int8_linear(bias, dtype)
    threshold = GEMM_ROWS
    counts = [1, 3, threshold - 1, threshold, threshold + 5, 2 * threshold]
    x = activations(max(counts)).to(dtype)
    got = {rows: linear(x[:rows]) for rows in counts}
    kernel_only(monkeypatch)
    for rows in counts:
        expected = linear(x[:rows])
        assert got[rows].dtype == dtype and got[rows].shape == (rows, OUT)
        if rows < threshold:
            assert torch.equal(got[rows], expected)
        else:
            assert_bfloat16_close(got[rows], expected)


def test_many_rows_take_the_tiled_float32_gemm_path(monkeypatch: pytest.MonkeyPatch) -> None:
    # Tiles of 32 outputs: the 128 outputs take four, each dequantised on its own.
    monkeypatch.setattr(linear_module, "GEMM_TILE_BYTES", 4 * IN * 32)
    linear = int4_linear(bias=False)
    x = activations(GEMM_ROWS).to(INT4_ACTIVATION_DTYPE)
    whole = torch.mm(x.float(), linear.dequantized_t()).to(INT4_ACTIVATION_DTYPE)
    assert_bfloat16_close(linear(x), whole)
    assert torch.equal(linear(x), linear.gemm(x))
    int8 = int8_linear(bias=False)
    x = activations(GEMM_ROWS).to(torch.bfloat16)
    scales = int8.scales
    whole = (torch.nn.functional.linear(x.float(), int8.qweight.float()) * scales).to(x.dtype)
    assert_bfloat16_close(int8(x), whole)
    assert torch.equal(int8(x), int8.gemm(x, scales))


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_the_row_count_picks_the_path(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    linear_type = Int4Linear if kind == "int4" else Int8Linear
    calls: list[int] = []
    real_gemm = linear_type.gemm

    def counted(self: object, flat: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        calls.append(flat.shape[0])
        return real_gemm(self, flat, *rest)  # type: ignore[arg-type]

    monkeypatch.setattr(linear_type, "gemm", counted)
    linear = int4_linear(bias=True) if kind == "int4" else int8_linear(bias=True)
    for rows in (1, 8, GEMM_ROWS - 1, GEMM_ROWS, 3 * GEMM_ROWS):
        linear(activations(rows).to(torch.bfloat16))
    assert calls == [GEMM_ROWS, 3 * GEMM_ROWS]


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_below_the_threshold_a_row_does_not_depend_on_the_other_rows(kind: str) -> None:
    linear = int4_linear(bias=True) if kind == "int4" else int8_linear(bias=True)
    threshold = GEMM_ROWS
    x = activations(threshold - 1).to(torch.bfloat16)
    batched = linear(x)
    for i in (0, 1, 5, threshold - 2):
        assert torch.equal(batched[i : i + 1], linear(x[i : i + 1]))


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_three_dimensional_inputs_take_the_path_of_their_row_count(kind: str) -> None:
    linear = int4_linear(bias=True) if kind == "int4" else int8_linear(bias=True)
    threshold = GEMM_ROWS
    x = activations(2 * threshold).to(torch.bfloat16)
    flat = linear(x)
    assert torch.equal(linear(x.reshape(2, threshold, IN)), flat.reshape(2, threshold, OUT))


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_by_default_every_row_count_runs_the_kernel(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(linear_module, "QUANTISED_GEMM", False)
    linear = int4_linear(bias=True) if kind == "int4" else int8_linear(bias=True)
    calls: list[int] = []
    monkeypatch.setattr(type(linear), "gemm", lambda self, *a: calls.append(1))
    x = activations(3 * GEMM_ROWS).to(torch.bfloat16)
    assert linear(x).shape == (3 * GEMM_ROWS, OUT) and calls == []
    # Each row is what it is alone: the kernel is batch-invariant.
    assert torch.equal(linear(x)[:1], linear(x[:1]))
