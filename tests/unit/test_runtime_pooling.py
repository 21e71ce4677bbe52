"""Pooled rows on the last stage (embeddings): a span with ``pooling`` gets its rows
of the final-normed hidden state, summed or the last one, equal to the unsplit
model's own final hidden state, whatever the split, the chunking and the other
sessions in the frame."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from runtime_support import LAYERS, SPLITS, load_chain, package_of, reference_model

from mesh.runtime import Span, StageRuntime

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def packages(
    tiny_model_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], tuple[Path, Path]]:
    cache: dict[str, tuple[Path, Path]] = {}

    def get(family: str) -> tuple[Path, Path]:
        if family not in cache:
            model_dir = tiny_model_factory(family, layers=LAYERS)
            package = package_of(model_dir, tmp_path_factory.mktemp(f"pool-{family}") / "pkg")
            cache[family] = (model_dir, package)
        return cache[family]

    return get


def final_hidden(model_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    """The unsplit model's final hidden state (after its last norm) ``[T, hidden]``."""
    model = reference_model(model_dir)
    with torch.inference_mode():
        return model.model(ids.unsqueeze(0), use_cache=False).last_hidden_state[0].float()


def through(stages: list[StageRuntime], spans: list[Span], ids: torch.Tensor):
    activations = ids
    for stage in stages:
        out = stage.forward_batch(spans, activations)
        assert not out.errors, out.errors
        activations = out.rows
    return out


@pytest.mark.parametrize("stage_count", [1, 2])
@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe", "gemma3"])
def test_pooled_rows_equal_the_models_final_hidden_state(
    packages: Callable[[str], tuple[Path, Path]], family: str, stage_count: int
) -> None:
    model_dir, package = packages(family)
    gen = torch.Generator().manual_seed(7)
    embed = torch.randint(0, 1000, (19,), generator=gen)
    other = torch.randint(0, 1000, (6,), generator=gen)
    want = final_hidden(model_dir, embed)
    stages = load_chain(package, SPLITS[stage_count])
    # Two chunks of the embedded prompt (mean: sums), each beside another session's
    # rows; the last chunk asks for one row of logits too, as a final chunk does.
    total = torch.zeros(want.shape[1])
    for step, (start, count, logits) in enumerate(((0, 11, 0), (11, 8, 1))):
        spans = [
            Span("other", step * 3, 3, logit_rows=1),
            Span("e", start, count, logit_rows=logits, pooling="mean"),
        ]
        ids = torch.cat([other[step * 3 : step * 3 + 3], embed[start : start + count]])
        out = through(stages, spans, ids)
        assert set(out.pooled) == {1}
        total += out.pooled[1]
        assert out.of(1).shape[0] == logits
    assert (total / 19 - want.mean(dim=0)).abs().max().item() < TOLERANCE
    # Last pooling: the final row alone, with a single-span frame.
    last = load_chain(package, SPLITS[stage_count])
    out = through(last, [Span("e", 0, 19, logit_rows=1, pooling="last")], embed)
    assert (out.pooled[0] - want[-1]).abs().max().item() < TOLERANCE


def test_only_the_last_stage_pools(packages: Callable[[str], tuple[Path, Path]]) -> None:
    _, package = packages("llama")
    first, last = load_chain(package, SPLITS[2])
    ids = torch.arange(5)
    out = first.forward_batch([Span("e", 0, 5, logit_rows=0, pooling="mean")], ids)
    assert out.pooled == {} and out.rows.shape[0] == 5
    out = last.forward_batch([Span("e", 0, 5, logit_rows=0, pooling="mean")], out.rows)
    assert out.pooled[0].shape == (last.hidden_size,) and out.pooled[0].dtype == torch.float32
