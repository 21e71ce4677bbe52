"""Quantised weight formats, their kernels, and exact conversion of GGUF blocks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mesh import quant
from mesh.errors import InvalidRequest
from mesh.package.gguf_quant import _CONVERTERS, hf_name, rotary_row_order
from mesh.runtime.linear import Embedding, LinearSpec, build_linear, fuse


def random_weight(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=generator) * 0.05


def test_int4_codes_pack_two_per_byte_and_unpack_back() -> None:
    codes = torch.randint(0, 16, (8, 64), generator=torch.Generator().manual_seed(1))
    packed = quant.pack_int4(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (8, 32)
    assert int(packed[0, 0]) == int(codes[0, 0]) * 16 + int(codes[0, 1])
    assert torch.equal(quant.unpack_int4(packed), codes.to(torch.int32))


@pytest.mark.parametrize("group", [32, 64])
def test_int4_rounding_error_is_at_most_half_a_step(group: int) -> None:
    weight = random_weight(48, 128)
    parts = quant.quantize_int4(weight, group)
    assert parts["scales"].shape == (48, 128 // group)
    restored = quant.dequantize_int4(parts, torch.float32)
    step = parts["scales"].float().repeat_interleave(group, dim=1)
    # Half a step of rounding, plus float16 rounding of the stored min.
    slack = 0.5 * step + parts["mins"].float().abs().repeat_interleave(group, dim=1) * 1e-3
    assert bool(((restored - weight).abs() <= slack + 1e-6).all())
    assert float((restored - weight).abs().max()) > 0  # it is a real quantisation


def test_int8_rounding_error_is_at_most_half_a_step() -> None:
    weight = random_weight(40, 96)
    parts = quant.quantize_int8(weight)
    assert parts["qweight"].dtype == torch.int8 and parts["scales"].shape == (40,)
    restored = quant.dequantize_int8(parts, torch.float32)
    assert bool(((restored - weight).abs() <= parts["scales"].unsqueeze(1) / 2 + 1e-7).all())
    grouped = quant.quantize_int8_groups(weight, 32)
    restored = quant.dequantize_int8_groups(grouped, torch.float32)
    step = grouped["scales"].float().repeat_interleave(32, dim=1)
    assert bool(((restored - weight).abs() <= step / 2 + 1e-6).all())


@pytest.mark.parametrize("magnitude", [1.0, 4e-3, 6e-4, 1e-5])
def test_small_groups_keep_their_size(magnitude: float) -> None:
    """Groups whose float16 scale is a subnormal (below 6.1e-5: an int8 group under
    0.0078, an int4 group spanning under 9.2e-4) are coded against the scale that is
    stored, rounded up so that the group's ends fit: before, the codes were chosen
    against a clamped scale and such groups came back shrunk (a group of +-0.004
    restored as +-0.002, relative error 0.48)."""
    weight = torch.randn(8, 64, generator=torch.Generator().manual_seed(3)) * magnitude / 3
    for restored, bound in (
        (quant.dequantize_int8_groups(quant.quantize_int8_groups(weight, 32), torch.float32), 0.01),
        (quant.dequantize_int4(quant.quantize_int4(weight, 32), torch.float32), 0.09),
    ):
        error = float((restored - weight).norm() / weight.norm())
        assert error < bound, (magnitude, error)
        assert float(restored.abs().amax() / weight.abs().amax()) > 0.94
    flat = torch.full((2, 32), 0.25)  # one value per group: a zero scale
    assert torch.equal(quant.dequantize_int4(quant.quantize_int4(flat, 32), torch.float32), flat)


def test_scheme_checks_say_what_to_change() -> None:
    assert quant.make_scheme("int4") == quant.QuantScheme("int4", 32)
    assert quant.make_scheme("int4", 128).group_size == 128
    assert quant.make_scheme("int8") == quant.QuantScheme("int8", 0)
    with pytest.raises(InvalidRequest, match="one of int8, int4"):
        quant.make_scheme("int3")
    with pytest.raises(InvalidRequest, match="group size 48 is not supported"):
        quant.make_scheme("int4", 48)
    with pytest.raises(InvalidRequest, match="drop --group-size"):
        quant.make_scheme("int8", 64)
    assert quant.make_scheme("int4").head == "int8"
    assert quant.make_scheme("int4", None, "int4").head == "int4"
    with pytest.raises(InvalidRequest, match="keeps an int8 head"):
        quant.make_scheme("int8", None, "int4")
    with pytest.raises(InvalidRequest, match="head quant 'fp8'"):
        quant.make_scheme("int4", None, "fp8")
    with pytest.raises(InvalidRequest, match="not a multiple of the group size 64"):
        quant.quantize_int4(random_weight(4, 96), 64)


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_quantised_linear_matches_its_dequantised_weight(kind: str) -> None:
    weight, bias = random_weight(96, 128, seed=2), torch.randn(96) * 0.1
    if kind == "int4":
        parts = quant.quantize_int4(weight, 32)
        restored = quant.dequantize_int4(parts, torch.float32)
    else:
        parts = quant.quantize_int8(weight)
        restored = quant.dequantize_int8(parts, torch.float32)
    linear = build_linear(
        LinearSpec(96, 128, kind, parts=parts, bias=bias), torch.device("cpu"), torch.bfloat16
    )
    inputs = torch.randn(3, 5, 128, generator=torch.Generator().manual_seed(3))
    got = linear(inputs.to(torch.bfloat16)).float()
    want = F.linear(inputs, restored, bias)
    assert got.shape == (3, 5, 96)
    assert float((got - want).abs().max()) < 0.02 * float(want.abs().max())


def test_fused_linear_gives_each_part_its_own_output() -> None:
    specs = []
    for seed, rows in ((4, 64), (5, 32), (6, 32)):
        parts = quant.quantize_int4(random_weight(rows, 64, seed), 32)
        specs.append(LinearSpec(rows, 64, "int4", parts=parts, bias=None))
    device = torch.device("cpu")
    fused = build_linear(fuse(specs), device, torch.bfloat16)
    inputs = torch.randn(2, 64).to(torch.bfloat16)
    pieces = fused(inputs).split([64, 32, 32], dim=-1)
    for spec, piece in zip(specs, pieces, strict=True):
        assert torch.equal(build_linear(spec, device, torch.bfloat16)(inputs), piece)


def test_int8_embedding_gathers_dequantised_rows() -> None:
    table = random_weight(50, 64, seed=7)
    parts = quant.quantize_int8_groups(table, 32)
    embed = Embedding(torch.device("cpu"), torch.float32, parts=parts)
    ids = torch.tensor([[3, 49, 0]])
    got = embed(ids)
    assert got.shape == (1, 3, 64)
    assert torch.equal(got[0], quant.dequantize_int8_groups(parts, torch.float32)[ids[0]])


# ---- GGUF blocks --------------------------------------------------------------------


def random_blocks(type_name: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random GGUF rows of a block type, with sane float16 scales."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    qtype = GGMLQuantizationType[type_name]
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(rows, cols // block_size, type_size), dtype=np.uint8)
    scales = rng.uniform(0.001, 0.05, size=(rows, cols // block_size, 2)).astype(np.float16)
    data[..., 0:4] = scales.view(np.uint8).reshape(rows, cols // block_size, 4)
    if type_name == "Q4_1" or type_name == "Q4_K":
        # The second float16 (min or dmin) may be negative for Q4_1.
        sign = -1 if type_name == "Q4_1" else 1
        second = (sign * scales[..., 1]).astype(np.float16)
        data[..., 2:4] = second.view(np.uint8).reshape(rows, cols // block_size, 2)
    return data.reshape(rows, -1)


@pytest.mark.parametrize(
    ("type_name", "kind"),
    [
        ("Q4_0", "int4"),
        ("Q4_1", "int4"),
        ("Q4_K", "int4"),
        ("Q8_0", "int8g"),
        ("Q4_0", "int8g"),
        ("Q5_0", "int8g"),
    ],
)
def test_gguf_blocks_convert_to_the_same_weights(type_name: str, kind: str) -> None:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    rows, cols = 6, 512
    data = random_blocks(type_name, rows, cols, seed=11)
    reference = dequantize(data, GGMLQuantizationType[type_name]).reshape(rows, cols)
    parts = _CONVERTERS[(type_name, kind)](data)
    if kind == "int4":
        restored = quant.dequantize_int4(parts, torch.float32)
    else:
        restored = quant.dequantize_int8_groups(parts, torch.float32)
    reference_t = torch.from_numpy(reference.astype(np.float32))
    # Q4_K's d * sc products are rounded to float16 once; the others are exact.
    tolerance = 2e-3 * float(reference_t.abs().max()) if type_name == "Q4_K" else 1e-6
    assert float((restored - reference_t).abs().max()) <= tolerance


def test_gguf_rotary_row_order_undoes_llama_permutation() -> None:
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    heads, head_dim, cols = 4, 8, 3
    weight = np.arange(heads * head_dim * cols, dtype=np.float32).reshape(heads * head_dim, cols)
    processor = LlamaTensorProcessor(config={})
    expected = processor._reverse_permute_weights(weight, heads, heads)
    order = rotary_row_order(heads * head_dim, heads)
    assert np.array_equal(weight[order.numpy()], expected)


def test_gguf_names_map_to_hf_names() -> None:
    assert hf_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert hf_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    assert hf_name("blk.1.attn_k.bias") == "model.layers.1.self_attn.k_proj.bias"
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    assert hf_name("output_norm.weight") == "model.norm.weight"
    assert hf_name("rope_freqs.weight") is None


@pytest.mark.parametrize(("in_features", "kernel"), [(1536, True), (576, False)])
def test_cuda_int4_layout_takes_whole_tiles_only(in_features: int, kernel: bool) -> None:
    """Off the CPU, a weight whose K is not a whole number of the packed layout's
    tiles is held dequantised instead (checked on the meta device: no GPU here)."""
    from mesh.runtime.linear import DenseLinear, Int4Linear

    parts = quant.quantize_int4(random_weight(64, in_features), 32)
    spec = LinearSpec(64, in_features, "int4", parts=parts)
    linear = build_linear(spec, torch.device("meta"), torch.bfloat16)
    assert isinstance(linear, Int4Linear if kernel else DenseLinear)


@pytest.mark.parametrize(
    ("dtype", "strides"), [(torch.float32, (1, 48)), (torch.bfloat16, (32, 1))]
)
def test_plain_dense_weights_take_the_layout_their_matmul_reads_fastest(
    dtype: torch.dtype, strides: tuple[int, int]
) -> None:
    from mesh.runtime.linear import dense_weight

    weight = random_weight(48, 32)
    laid_out = dense_weight(weight, torch.device("cpu"), dtype)
    assert laid_out.shape == (48, 32) and laid_out.stride() == strides
    assert torch.equal(laid_out, weight.to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7])
def test_dense_linears_on_cpu(dtype: torch.dtype, rows: int) -> None:
    """bfloat16 runs packed for oneDNN; float32 decoder-shaped weights multiply the
    [K, N] layout (faster at one row and with several, linear._prefers_packed)."""
    from mesh.runtime.linear import DenseLinear, PackedLinear, distinct_bytes

    weight = random_weight(48, 32)
    bias = torch.randn(48, generator=torch.Generator().manual_seed(2))
    spec = LinearSpec(48, 32, weight=weight, bias=bias)
    linear = build_linear(spec, torch.device("cpu"), dtype)
    if dtype == torch.bfloat16:
        assert isinstance(linear, PackedLinear) == torch.backends.mkldnn.is_available()
    else:
        assert isinstance(linear, DenseLinear) and linear.weight.stride() == (1, 48)
    inputs = torch.randn(rows, 32, generator=torch.Generator().manual_seed(1)).to(dtype)
    want = F.linear(inputs.float(), weight.to(dtype).float(), bias.to(dtype).float())
    got = linear(inputs)
    assert got.dtype == dtype and got.shape == (rows, 48)
    assert torch.allclose(got.float(), want, rtol=2e-2, atol=2e-2)
    element = torch.empty((), dtype=dtype).element_size()
    assert distinct_bytes(linear.tensors()) == (48 * 32 + 48) * element


def test_a_wide_float32_head_runs_packed() -> None:
    from mesh.runtime.linear import PackedLinear

    linear = build_linear(
        LinearSpec(512, 32, weight=random_weight(512, 32)), torch.device("cpu"), torch.float32
    )
    assert isinstance(linear, PackedLinear) == torch.backends.mkldnn.is_available()


def test_dense_linears_fall_back_to_f_linear_without_onednn(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    from mesh.runtime import linear as linear_module

    def missing(*_: object) -> None:
        raise AttributeError("no op named _reorder_linear_weight")

    monkeypatch.setattr(linear_module.PackedLinear, "__init__", missing)
    weight = random_weight(48, 32)
    with caplog.at_level(logging.WARNING):
        linear = build_linear(
            LinearSpec(48, 32, weight=weight), torch.device("cpu"), torch.bfloat16
        )
    assert isinstance(linear, linear_module.DenseLinear)
    assert "oneDNN cannot take a torch.bfloat16 weight" in caplog.text
    inputs = torch.randn(2, 32, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    want = F.linear(inputs.float(), weight.to(torch.bfloat16).float())
    assert torch.allclose(linear(inputs).float(), want, rtol=2e-2, atol=2e-2)
