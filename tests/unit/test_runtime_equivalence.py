"""Chains of stage runtimes reproduce the unsplit HF model, for every supported family."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import tiny_config
from runtime_support import (
    FAMILIES,
    LAYERS,
    SPLITS,
    full_logits,
    load_chain,
    max_diff,
    package_of,
    reference_model,
    run_chain,
)
from transformers import AutoModelForCausalLM

from mesh.runtime import StateDictWeights, build_stage_runtime
from mesh.types import LayerRange

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def tiny(
    tiny_model_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], tuple]:
    """(reference HF model, package directory) per family, built once per module."""
    cache: dict[str, tuple] = {}

    def get(family: str) -> tuple:
        if family not in cache:
            model_dir = tiny_model_factory(family, layers=LAYERS)
            package = package_of(model_dir, tmp_path_factory.mktemp(f"pkg-{family}") / "pkg")
            cache[family] = (reference_model(model_dir), package)
        return cache[family]

    return get


def random_tokens(count: int, seed: int, vocab: int = 49152) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (count,), generator=generator)


@pytest.mark.parametrize("stage_count", sorted(SPLITS))
@pytest.mark.parametrize("family", FAMILIES)
def test_split_matches_unsplit_through_decode_verify_and_rewind(
    tiny: Callable[[str], tuple], family: str, stage_count: int
) -> None:
    model, package = tiny(family)
    stages = load_chain(package, SPLITS[stage_count])
    assert stages[0].is_first and stages[-1].is_last
    assert [s.is_last for s in stages[:-1]] == [False] * (stage_count - 1)

    sequence = random_tokens(17, seed=1)
    want = full_logits(model, sequence)

    prefill = run_chain(stages, "s", 0, sequence[:10])
    assert prefill.dtype == torch.float32 and prefill.shape == (10, model.config.vocab_size)
    assert max_diff(prefill, want[:10]) <= TOLERANCE
    for pos in range(10, 13):
        step = run_chain(stages, "s", pos, sequence[pos : pos + 1])
        assert max_diff(step, want[pos : pos + 1]) <= TOLERANCE

    verify = run_chain(stages, "s", 13, sequence[13:17])
    assert max_diff(verify, want[13:17]) <= TOLERANCE
    assert [s.session_length("s") for s in stages] == [17] * stage_count

    # Rewind: a frame at 14 drops positions 14..16 everywhere and replaces them.
    other = torch.cat([sequence[:14], random_tokens(3, seed=2), random_tokens(1, seed=3)])
    want_other = full_logits(model, other)
    replaced = run_chain(stages, "s", 14, other[14:17])
    assert max_diff(replaced, want_other[14:17]) <= TOLERANCE
    after = run_chain(stages, "s", 17, other[17:18])
    assert max_diff(after, want_other[17:18]) <= TOLERANCE
    assert [s.session_length("s") for s in stages] == [18] * stage_count


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_interleaved_sessions_do_not_disturb_each_other(
    tiny: Callable[[str], tuple], family: str
) -> None:
    model, _ = tiny(family)
    weights = StateDictWeights(model.state_dict(), tied=model.config.tie_word_embeddings)
    stages = [build_stage_runtime(model.config, weights, layer_range) for layer_range in SPLITS[2]]
    first, second = random_tokens(12, seed=4), random_tokens(12, seed=5)
    want = {"a": full_logits(model, first), "b": full_logits(model, second)}
    tokens = {"a": first, "b": second}

    got = {sid: [run_chain(stages, sid, 0, tokens[sid][:6])] for sid in ("a", "b")}
    for pos in range(6, 12):
        for sid in ("b", "a") if pos % 2 else ("a", "b"):
            got[sid].append(run_chain(stages, sid, pos, tokens[sid][pos : pos + 1]))
    # Rolling one session back leaves the other one intact.
    got["a"][-1] = run_chain(stages, "a", 11, tokens["a"][11:12])
    for sid in ("a", "b"):
        assert max_diff(torch.cat(got[sid]), want[sid]) <= TOLERANCE
    assert sorted(stages[0].sessions()) == ["a", "b"]
    assert stages[1].session_length("b") == 12


def test_cache_growth_keeps_earlier_positions(tiny: Callable[[str], tuple]) -> None:
    """A session outgrowing its first KV allocation still matches the unsplit model."""
    model, package = tiny("qwen3")
    stages = load_chain(package, SPLITS[2])
    sequence = random_tokens(300, seed=6)
    want = full_logits(model, sequence)
    head = run_chain(stages, "long", 0, sequence[:200])
    tail = run_chain(stages, "long", 200, sequence[200:])
    assert max_diff(torch.cat([head, tail]), want) <= TOLERANCE
    assert stages[1].kv_bytes() > 0


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_param_bytes_count_only_what_each_stage_holds(
    tiny: Callable[[str], tuple], family: str
) -> None:
    model, package = tiny(family)
    state = model.state_dict()

    def nbytes(names: list[str]) -> int:
        return sum(state[name].numel() * state[name].element_size() for name in names)

    def layer_names(layer_range: LayerRange) -> list[str]:
        prefixes = tuple(f"model.layers.{i}." for i in layer_range)
        return [name for name in state if name.startswith(prefixes)]

    ranges = SPLITS[3]
    stages = load_chain(package, ranges)
    embed = nbytes(["model.embed_tokens.weight"])
    head = nbytes(["model.norm.weight"]) + embed  # tied or not, the head matrix has this size
    assert stages[0].param_bytes == embed + nbytes(layer_names(ranges[0]))
    assert stages[1].param_bytes == nbytes(layer_names(ranges[1]))
    assert stages[2].param_bytes == nbytes(layer_names(ranges[2])) + head
    whole = load_chain(package, SPLITS[1])[0]
    shared_head = model.config.tie_word_embeddings
    total = embed + nbytes(layer_names(LayerRange(0, LAYERS))) + head
    assert whole.param_bytes == total - (embed if shared_head else 0)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_stages_follow_the_hf_model(
    tiny: Callable[[str], tuple], tiny_model_factory: Callable[..., Path], dtype: str
) -> None:
    _, package = tiny("llama")
    torch_dtype = getattr(torch, dtype)
    model = reference_model(tiny_model_factory("llama", layers=LAYERS), dtype=torch_dtype)
    stages = load_chain(package, SPLITS[2], dtype=dtype)
    assert stages[0].dtype == dtype and stages[0].torch_dtype == torch_dtype
    sequence = random_tokens(9, seed=7)
    hidden = stages[0].forward("h", 0, sequence[:8])
    assert hidden.dtype == torch_dtype and hidden.shape == (8, model.config.hidden_size)
    logits = stages[1].forward("h", 0, hidden)
    logits = torch.cat([logits, run_chain(stages, "h", 8, sequence[8:9])])
    assert logits.dtype == torch.float32
    want = full_logits(model, sequence)
    assert max_diff(logits, want) <= 0.05 * want.abs().max().item()
    assert torch.equal(logits.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_sliding_window_layers_match_the_unsplit_model(family: str) -> None:
    """Windowed attention (all layers for Mistral, the upper half for Qwen2)."""
    base = tiny_config(family, layers=LAYERS, vocab_size=512).to_dict()
    windowed = {"sliding_window": 5, "use_sliding_window": True, "max_window_layers": 3}
    windowed["layer_types"] = None
    unwindowed = {"sliding_window": None, "use_sliding_window": False, "layer_types": None}
    config_class = type(tiny_config(family, layers=1))
    torch.manual_seed(11)
    model = AutoModelForCausalLM.from_config(config_class(**{**base, **windowed})).eval()
    model.config.architectures = [type(model).__name__]
    if family == "qwen2":
        assert model.config.layer_types[:3] == ["full_attention"] * 3
        assert model.config.layer_types[3:] == ["sliding_attention"] * 3
    weights = StateDictWeights(model.state_dict(), tied=model.config.tie_word_embeddings)
    stages = [build_stage_runtime(model.config, weights, r) for r in SPLITS[2]]
    sequence = random_tokens(16, seed=12, vocab=512)
    want = full_logits(model, sequence)
    got = [run_chain(stages, "w", 0, sequence[:7])]
    got += [run_chain(stages, "w", pos, sequence[pos : pos + 1]) for pos in range(7, 12)]
    got.append(run_chain(stages, "w", 12, sequence[12:16]))
    assert max_diff(torch.cat(got), want) <= TOLERANCE
    # The window matters: the same weights attending to everything give other logits.
    plain = AutoModelForCausalLM.from_config(config_class(**{**base, **unwindowed})).eval()
    plain.load_state_dict(model.state_dict())
    assert max_diff(full_logits(plain, sequence)[12:], want[12:]) > 1e-3
