"""The stage's own quantised CPU kernels (mesh/runtime/kernels/qmatmul.c): exact
against a torch model of their arithmetic, row- and thread-invariant, and chosen by
``build_linear`` as ``--quantised-kernel`` says."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mesh import quant
from mesh.runtime import linear as linear_module
from mesh.runtime import native, qkernels
from mesh.runtime.linear import Int4Linear, Int8Linear, LinearSpec, build_linear
from mesh.runtime.qkernels import NativeInt4Linear, NativeInt8Linear

CPU = torch.device("cpu")

pytestmark = pytest.mark.skipif(
    native.library() is None,
    reason="the quantised CPU kernels need x86-64 with AVX-512 VNNI and a C compiler",
)


@pytest.fixture(autouse=True)
def native_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(qkernels, "MODE", "auto")
    monkeypatch.setattr(linear_module, "QUANTISED_GEMM", False)


def weight(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.05


def activations(rows: int, cols: int, seed: int = 1) -> torch.Tensor:
    """Uneven channels and an outlier column, as hidden states have."""
    generator = torch.Generator().manual_seed(seed)
    scale = 1 + 3 * torch.rand(cols, generator=generator)
    scale[cols // 3] = 40.0
    return torch.randn(rows, cols, generator=generator) * scale


def quantised_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' activation rounding: codes hi + lo / 254 (each int8) and a scale
    per block of 32."""
    blocks = x.reshape(x.shape[0], -1, 32)
    top = blocks.abs().amax(dim=-1, keepdim=True)
    inverse = torch.where(top > 0, 127.0 / top, torch.zeros_like(top))
    scaled = blocks * inverse
    coarse = torch.round(scaled)
    fine = torch.round((scaled - coarse) * 254)
    assert coarse.abs().max() <= 127 and fine.abs().max() <= 127
    return coarse.double() + fine.double() / 254, (top / 127.0).squeeze(-1)


def int4_model(x: torch.Tensor, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """sum over groups of scale * sum_blocks(d * exact int dot) + min * sum(x), float64."""
    codes, d = quantised_activations(x)
    q = quant.unpack_int4(parts["qweight"]).to(torch.float64)  # [N, K]
    n, k = q.shape
    groups = parts["scales"].shape[1]
    dots = torch.einsum("mbi,nbi->mnb", codes.double(), q.reshape(n, k // 32, 32))
    per_block = dots * d.double().unsqueeze(1)  # [M, N, K/32]
    per_group = per_block.reshape(x.shape[0], n, groups, -1).sum(-1)
    sums = x.double().reshape(x.shape[0], groups, -1).sum(-1)  # [M, G]
    scales, mins = parts["scales"].double(), parts["mins"].double()
    return (per_group * scales).sum(-1) + sums @ mins.t()


@pytest.mark.parametrize(
    ("out_features", "in_features", "group"), [(48, 64, 32), (40, 256, 64), (130, 128, 128)]
)
def test_int4_matches_its_arithmetic(out_features: int, in_features: int, group: int) -> None:
    parts = quant.quantize_int4(weight(out_features, in_features), group)
    linear = build_linear(
        LinearSpec(out_features, in_features, "int4", parts=parts), CPU, torch.float32
    )
    assert isinstance(linear, NativeInt4Linear)
    x = activations(7, in_features)
    expected = int4_model(x, parts)
    torch.testing.assert_close(linear(x).double(), expected, rtol=1e-5, atol=1e-5)
    dequantised = x @ quant.dequantize_int4(parts, torch.float32).t()
    error = (linear(x) - dequantised).norm() / dequantised.norm()
    assert error < 2e-4  # activation rounding only: about 16 bits per value


@pytest.mark.parametrize(("out_features", "in_features"), [(48, 64), (33, 96)])
def test_int8_matches_its_arithmetic(out_features: int, in_features: int) -> None:
    parts = quant.quantize_int8(weight(out_features, in_features))
    linear = build_linear(
        LinearSpec(out_features, in_features, "int8", parts=parts), CPU, torch.float32
    )
    assert isinstance(linear, NativeInt8Linear)
    x = activations(5, in_features)
    codes, d = quantised_activations(x)
    w = parts["qweight"].double().reshape(out_features, -1, 32)
    dots = torch.einsum("mbi,nbi->mnb", codes.double(), w) * d.double().unsqueeze(1)
    expected = dots.sum(-1) * parts["scales"].double()
    torch.testing.assert_close(linear(x).double(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["int4", "int8"])
@pytest.mark.parametrize("threads", [1, 2])
def test_rows_and_threads_do_not_change_a_row(kind: str, threads: int) -> None:
    """Each row alone, in any batch and with any thread count, bit for bit; the
    large shape passes the size from which a call is split over threads."""
    out_features, in_features = 4096, 1024
    w = weight(out_features, in_features)
    parts = quant.quantize_int4(w, 32) if kind == "int4" else quant.quantize_int8(w)
    linear = build_linear(
        LinearSpec(out_features, in_features, kind, parts=parts), CPU, torch.float32
    )
    x = activations(9, in_features)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([linear(x[i : i + 1]) for i in range(x.shape[0])])
        torch.set_num_threads(threads)
        for rows in (1, 2, 5, 9):
            assert torch.equal(linear(x[:rows]), alone[:rows])
        assert torch.equal(linear(x[3:8]), alone[3:8])
    finally:
        torch.set_num_threads(previous)


def test_bias_dtype_and_shape_follow_the_input() -> None:
    parts = quant.quantize_int4(weight(32, 64), 32)
    bias = weight(1, 32, 3)[0]
    linear = build_linear(LinearSpec(32, 64, "int4", parts=parts, bias=bias), CPU, torch.bfloat16)
    x = activations(6, 64).to(torch.bfloat16).reshape(2, 3, 64)
    out = linear(x)
    assert out.shape == (2, 3, 32) and out.dtype == torch.bfloat16
    plain = build_linear(LinearSpec(32, 64, "int4", parts=parts), CPU, torch.bfloat16)
    torch.testing.assert_close(out, plain(x) + bias.to(torch.bfloat16))
    assert linear(torch.empty(0, 64, dtype=torch.bfloat16)).shape == (0, 32)


def test_mode_chooses_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    parts4 = quant.quantize_int4(weight(32, 64), 32)
    parts8 = quant.quantize_int8(weight(32, 64))
    spec4 = LinearSpec(32, 64, "int4", parts=parts4)
    spec8 = LinearSpec(32, 64, "int8", parts=parts8)
    monkeypatch.setattr(qkernels, "MODE", "torch")
    assert isinstance(build_linear(spec4, CPU, torch.bfloat16), Int4Linear)
    assert isinstance(build_linear(spec8, CPU, torch.bfloat16), Int8Linear)
    monkeypatch.setattr(qkernels, "MODE", "native")
    assert isinstance(build_linear(spec4, CPU, torch.bfloat16), NativeInt4Linear)
    # Inputs not in blocks of 32: auto falls back, native says why.
    odd = LinearSpec(32, 48, "int8", parts=quant.quantize_int8(weight(32, 48)))
    with pytest.raises(ValueError, match="multiples of 32"):
        build_linear(odd, CPU, torch.bfloat16)
    monkeypatch.setattr(qkernels, "MODE", "auto")
    assert isinstance(build_linear(odd, CPU, torch.bfloat16), Int8Linear)


def test_the_build_is_cached_by_source_and_compiler(tmp_path: Path) -> None:
    first = native.build(tmp_path)
    assert first.exists() and native.build(tmp_path) == first
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporaries left


def test_cpu_flags_are_read_from_cpuinfo() -> None:
    flags = "flags\t\t: fpu avx512f avx512bw avx512vl avx512dq avx512_vnni\n"
    assert native.missing_cpu_flags("processor : 0\n" + flags) == []
    assert native.missing_cpu_flags("flags : fpu avx2 avx512f\n") == [
        "avx512bw",
        "avx512vl",
        "avx512dq",
        "avx512_vnni",
    ]
    assert native.missing_cpu_flags("") == list(native.CPU_FLAGS)


@pytest.mark.skipif(not native.amx(), reason="AMX tiles are not granted on this CPU")
@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_amx_tiles_give_the_vnni_loops_results_bit_for_bit(kind: str) -> None:
    """Calls switch between AMX and VNNI by row count, so both must agree exactly."""
    w = weight(200, 128)
    parts = quant.quantize_int4(w, 64) if kind == "int4" else quant.quantize_int8(w)
    linear = build_linear(LinearSpec(200, 128, kind, parts=parts), CPU, torch.float32)
    try:
        # Tiles of every height a call can get (1-16 rows), and calls past 16 rows.
        for rows in (1, 2, 3, 5, 7, 8, 12, 15, 16, 21, 40):
            x = activations(rows, 128, seed=rows)
            native.set_amx_rows(0, 0)
            vnni = linear(x)
            native.set_amx_rows(1, 1)
            assert torch.equal(linear(x), vnni), rows
    finally:
        native.set_amx_rows()


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_prefetch_hints_change_no_result(kind: str) -> None:
    """The weight prefetch distance is a hint only: any distance, including none and
    one far past the end of the weight, gives the same bits (VNNI and AMX calls)."""
    w = weight(96, 256)
    parts = quant.quantize_int4(w, 32) if kind == "int4" else quant.quantize_int8(w)
    linear = build_linear(LinearSpec(96, 256, kind, parts=parts), CPU, torch.float32)
    lib = native.library()
    try:
        for rows in (1, 3, 16):
            x = activations(rows, 256, seed=rows)
            lib.mesh_set_fetch_ahead(0)
            plain = linear(x)
            for distance in (64, native.FETCH_AHEAD_BYTES, 1 << 20):
                lib.mesh_set_fetch_ahead(distance)
                assert torch.equal(linear(x), plain), (rows, distance)
    finally:
        lib.mesh_set_fetch_ahead(native.FETCH_AHEAD_BYTES)


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_bfloat16_in_and_out_equal_the_float32_call_rounded(kind: str) -> None:
    """bfloat16 activations are read and results written by the kernel itself: the
    same bits as a float32 call rounded to nearest even by torch."""
    w = weight(80, 96)
    parts = quant.quantize_int4(w, 32) if kind == "int4" else quant.quantize_int8(w)
    linear = build_linear(LinearSpec(80, 96, kind, parts=parts), CPU, torch.bfloat16)
    x = activations(11, 96).to(torch.bfloat16)
    got = linear(x)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, linear(x.to(torch.float32)).to(torch.bfloat16))
    half = linear(x.to(torch.float16))  # other dtypes go through float32
    assert half.dtype == torch.float16
