"""Row-invariant arithmetic (mesh/runtime/invariant.py): a token's logits are
bit-identical whether it runs alone, in a verify window, in a prefill chunk or in a
batch with other sessions' rows, for every dtype and weight format the runtime
serves, for random row counts, positions and windows."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from runtime_support import SPLITS, load_chain, max_diff, run_chain

from mesh import quant
from mesh.runtime import Span, StageRuntime, invariant
from mesh.runtime.linear import LinearSpec, build_linear

VOCAB = 49152
CPU = torch.device("cpu")


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    """Run under 1 and 2 torch threads (a BLAS may split a reduction across threads)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def row_invariant(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every runtime loaded here is row-invariant, dense packages included."""
    monkeypatch.setattr(invariant, "MODE", "on")


def linear_of(kind: str, out_features: int, in_features: int) -> tuple[Callable, torch.dtype]:
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(3))
    weight /= in_features**0.5
    if kind == "int4":
        spec = LinearSpec(out_features, in_features, "int4", parts=quant.quantize_int4(weight, 32))
        return build_linear(spec, CPU, torch.bfloat16, tiled=True), torch.bfloat16
    if kind.startswith("int8"):
        dtype = torch.float32 if kind.endswith("float32") else torch.bfloat16
        spec = LinearSpec(out_features, in_features, "int8", parts=quant.quantize_int8(weight))
        return build_linear(spec, CPU, dtype, tiled=True), dtype
    dtype = getattr(torch, kind)
    spec = LinearSpec(out_features, in_features, weight=weight)
    return build_linear(spec, CPU, dtype, tiled=True), dtype


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int4", "int8-bfloat16", "int8-float32"])
@pytest.mark.parametrize("shape", [(1536, 576), (576, 1536), (8192, 576)])
def test_linear_rows_do_not_depend_on_their_neighbours(
    kind: str, shape: tuple[int, int], threads: int
) -> None:
    """Any number of rows at any offset: each row equals that row run alone (the
    SmolLM2 shapes; 8192 wide is the packed LM head's case)."""
    linear, dtype = linear_of(kind, *shape)
    rng = random.Random(f"{kind}-{shape}-{threads}")
    for trial in range(4):
        scale = [0.1, 1.0, 8.0, 1.0][trial]
        inputs = (torch.randn(150, shape[1], generator=torch.Generator().manual_seed(trial))).mul(
            scale
        )
        inputs = inputs.to(dtype)
        alone = torch.cat([linear(inputs[i : i + 1]) for i in range(150)])
        for count in rng.sample(range(2, 150), 10):
            first = rng.randint(0, 150 - count)
            got = linear(inputs[first : first + count])
            assert torch.equal(got, alone[first : first + count]), (count, first)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("window", [None, 100])
def test_attention_rows_do_not_depend_on_the_window(
    dtype: torch.dtype, groups: int, window: int | None, threads: int
) -> None:
    """A query's attention output is the same for any number of queries before and
    after it in its segment, at positions across key blocks and value chunks."""
    kv_heads, dim, capacity = 2, 64, 1280
    gen = torch.Generator().manual_seed(groups)
    keys = torch.randn(kv_heads, capacity, dim, generator=gen).to(dtype)
    values = torch.randn(kv_heads, capacity, dim, generator=gen).to(dtype)
    queries = torch.randn(capacity, kv_heads * groups, dim, generator=gen).to(dtype)
    rng = random.Random(f"{dtype}-{groups}-{window}-{threads}")

    def run(first: int, count: int) -> torch.Tensor:
        return invariant.attention(
            queries[first : first + count], keys, values, first, 0.125, groups, window
        )

    for _ in range(12):
        count = rng.choice([1, 2, 3, 5, 8, 16, 17, 40, 64, 100])
        first = rng.randint(0, capacity - count)
        got = run(first, count)
        for row in rng.sample(range(count), min(count, 6)):
            assert torch.equal(got[row : row + 1], run(first + row, 1)), (first, count, row)


FORMATS = {
    "float32": {"dtype": "float32"},
    "bfloat16": {"dtype": "bfloat16"},
    "float16": {"dtype": "float16"},
    "int8": {"dtype": "bfloat16", "quant": "int8"},
    "int4": {"dtype": "bfloat16", "quant": "int4", "group_size": 32},
}


def alone_logits(stages: list[StageRuntime], session: str, tokens: torch.Tensor) -> torch.Tensor:
    """The session decoded one token at a time from position 0: ``[T, vocab]``."""
    return torch.cat(
        [run_chain(stages, session, pos, tokens[pos : pos + 1]) for pos in range(len(tokens))]
    )


@pytest.mark.parametrize("stage_count", [1, 2])
@pytest.mark.parametrize(
    "family",
    ["llama", "qwen3", "qwen3_moe", "qwen2_moe", "gemma2", "gemma3", "glm4", "glm4_moe"],
)
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_a_token_gets_the_same_logits_in_any_frame(
    tiny_package_factory: Callable[..., Path], fmt: str, family: str, stage_count: int
) -> None:
    """Rounds of mixed prefill chunks, decode steps, verify windows and crops from 5
    sessions in random order: every row's logits are bit-identical to the same token
    decoded alone, one token per frame."""
    package = tiny_package_factory(family, **FORMATS[fmt])
    batched = load_chain(package, SPLITS[stage_count])
    alone = load_chain(package, SPLITS[stage_count])
    rng = random.Random(f"{fmt}-{family}-{stage_count}")
    sessions = [f"s{i}" for i in range(5)]
    tokens = {
        s: torch.randint(0, VOCAB, (90,), generator=torch.Generator().manual_seed(i))
        for i, s in enumerate(sessions)
    }
    want = {s: alone_logits(alone, s, tokens[s]) for s in sessions}
    lengths = dict.fromkeys(sessions, 0)
    for _ in range(8):
        plan = []
        for session in rng.sample(sessions, k=rng.randint(1, len(sessions))):
            held = lengths[session]
            start = rng.randint(max(0, held - 4), held) if held else 0
            count = min(rng.choice([1, 1, 2, 5, 9, 17]), len(tokens[session]) - start)
            if count > 0:
                plan.append((session, start, count))
        spans = [Span(s, start, count) for s, start, count in plan]
        ids = torch.cat([tokens[s][start : start + count] for s, start, count in plan])
        activations: torch.Tensor = ids
        for stage in batched:
            out = stage.forward_batch(spans, activations)
            assert not out.errors
            activations = out.rows
        for index, (session, start, count) in enumerate(plan):
            got, expected = out.of(index), want[session][start : start + count]
            differ = (got != expected).any(dim=-1).nonzero().flatten().tolist()
            assert not differ, (session, start, count, plan, differ, max_diff(got, expected))
            lengths[session] = start + count


@pytest.mark.parametrize(
    ("mode", "fmt", "expected"),
    [
        ("auto", "int4", True),
        ("auto", "int8", True),
        ("auto", "float32", False),
        ("auto", "bfloat16", False),
        ("on", "float32", True),
        ("off", "int4", False),
    ],
)
def test_the_mode_picks_row_invariance_per_package(
    tiny_package_factory: Callable[..., Path],
    monkeypatch: pytest.MonkeyPatch,
    mode: str,
    fmt: str,
    expected: bool,
) -> None:
    """auto: on where the linears are quantised (the cheap case), off for dense ones."""
    monkeypatch.setattr(invariant, "MODE", mode)
    stage = load_chain(tiny_package_factory("llama", **FORMATS[fmt]), SPLITS[1])[0]
    assert stage.row_invariant is expected
    assert all(block.row_invariant is expected for block in stage._modules.blocks)
