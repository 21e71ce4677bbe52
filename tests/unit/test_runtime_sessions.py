"""Session bookkeeping, limits and refusals of the stage runtime."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from runtime_support import SPLITS, full_logits, max_diff, package_of, reference_model, run_chain
from transformers import GPT2Config, PreTrainedModel

from mesh.errors import (
    CapacityExceeded,
    InvalidRequest,
    NotFound,
    PackageError,
    UnsupportedArchitecture,
)
from mesh.package.manifest import SUPPORTED_ARCHITECTURES, layer_path
from mesh.runtime import StageRuntime, StateDictWeights, build_stage_runtime, load_stage_runtime
from mesh.types import LayerRange


@pytest.fixture(scope="module")
def llama(
    tiny_model_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> tuple[PreTrainedModel, Path]:
    model_dir = tiny_model_factory("llama", layers=6)
    package = package_of(model_dir, tmp_path_factory.mktemp("pkg-llama-sessions") / "pkg")
    return reference_model(model_dir), package


def stages_of(llama: tuple[PreTrainedModel, Path], **limits: int) -> list[StageRuntime]:
    model, _ = llama
    weights = StateDictWeights(model.state_dict(), tied=model.config.tie_word_embeddings)
    return [build_stage_runtime(model.config, weights, r, **limits) for r in SPLITS[2]]


TOKENS = torch.arange(100, 140)


def test_frame_past_the_session_end_is_refused_and_changes_nothing(llama) -> None:
    first, last = stages_of(llama)
    first.forward("s", 0, TOKENS[:10])
    with pytest.raises(InvalidRequest, match="session s holds 10 tokens, frame starts at 12"):
        first.forward("s", 12, TOKENS[12:13])
    with pytest.raises(InvalidRequest, match="session t holds 0 tokens, frame starts at 3"):
        last.forward("t", 3, torch.zeros(1, last.hidden_size))
    assert first.session_length("s") == 10
    assert last.sessions() == []


def test_frame_before_the_session_end_crops_it(llama) -> None:
    model, _ = llama
    stages = stages_of(llama)
    run_chain(stages, "s", 0, TOKENS[:12])
    assert [s.session_length("s") for s in stages] == [12, 12]
    replaced = run_chain(stages, "s", 5, TOKENS[20:22])
    assert [s.session_length("s") for s in stages] == [7, 7]
    want = full_logits(model, torch.cat([TOKENS[:5], TOKENS[20:22]]))
    assert max_diff(replaced, want[5:7]) <= 1e-4


def test_trim_shortens_and_later_frames_continue_from_there(llama) -> None:
    model, _ = llama
    stages = stages_of(llama)
    run_chain(stages, "s", 0, TOKENS[:9])
    for stage in stages:
        stage.trim("s", 4)
        stage.trim("s", 30)  # longer than held: nothing to drop
    assert [s.session_length("s") for s in stages] == [4, 4]
    logits = run_chain(stages, "s", 4, TOKENS[30:33])
    want = full_logits(model, torch.cat([TOKENS[:4], TOKENS[30:33]]))
    assert max_diff(logits, want[4:7]) <= 1e-4
    with pytest.raises(NotFound, match="session nobody"):
        stages[0].trim("nobody", 0)
    with pytest.raises(InvalidRequest):
        stages[0].trim("s", -1)


def test_max_sessions_refuses_new_sessions_until_one_ends(llama) -> None:
    first, _ = stages_of(llama, max_sessions=2)
    first.forward("a", 0, TOKENS[:3])
    first.forward("b", 0, TOKENS[:3])
    with pytest.raises(CapacityExceeded, match="holds 2 sessions"):
        first.forward("c", 0, TOKENS[:3])
    first.forward("a", 3, TOKENS[3:4])  # existing sessions carry on
    assert first.drop_session("a") is True
    assert first.drop_session("a") is False
    first.forward("c", 0, TOKENS[:3])
    assert sorted(first.sessions()) == ["b", "c"]
    assert first.session_length("a") == 0


def test_max_tokens_per_session_is_enforced_before_any_change(llama) -> None:
    first, _ = stages_of(llama, max_tokens_per_session=16)
    assert first.max_tokens_per_session == 16
    first.forward("s", 0, TOKENS[:10])
    with pytest.raises(InvalidRequest, match="would hold 17 tokens.*limit of 16"):
        first.forward("s", 8, TOKENS[8:17])
    assert first.session_length("s") == 10
    first.forward("s", 10, TOKENS[10:16])
    assert first.session_length("s") == 16
    with pytest.raises(InvalidRequest, match="limit of 16"):
        first.forward("fresh", 0, TOKENS[:17])
    assert first.sessions() == ["s"]


def test_token_limit_defaults_to_the_model_context(llama) -> None:
    model, _ = llama
    first, _ = stages_of(llama)
    assert first.max_tokens_per_session == model.config.max_position_embeddings
    capped, _ = stages_of(llama, max_tokens_per_session=10**6)
    assert capped.max_tokens_per_session == model.config.max_position_embeddings


def test_expire_idle_drops_only_sessions_idle_for_longer_than_the_timeout(llama) -> None:
    model, _ = llama
    now = [1000.0]
    weights = StateDictWeights(model.state_dict(), tied=True)
    first = build_stage_runtime(model.config, weights, LayerRange(0, 3), clock=lambda: now[0])
    first.forward("old", 0, TOKENS[:2])
    first.forward("new", 0, TOKENS[:2])
    first.forward("trimmed", 0, TOKENS[:2])
    now[0] = 1030.0
    first.forward("new", 2, TOKENS[2:3])
    first.trim("trimmed", 1)  # a trim counts as use
    assert first.expire_idle(1060.0, idle_timeout_s=60.0) == []
    assert first.expire_idle(1060.5, idle_timeout_s=60.0) == ["old"]
    assert sorted(first.sessions()) == ["new", "trimmed"]
    assert sorted(first.expire_idle(1091.0, idle_timeout_s=60.0)) == ["new", "trimmed"]
    assert first.sessions() == []


def test_inputs_of_the_wrong_kind_are_refused(llama) -> None:
    first, last = stages_of(llama)
    bad_for_first = [
        (torch.zeros(3), "must be integers"),
        (torch.zeros(1, 3, dtype=torch.long), r"shape \[T\]"),
        (torch.zeros(0, dtype=torch.long), r"T >= 1"),
        (torch.tensor([5, first.vocab_size]), "out of range"),
        (torch.tensor([-1]), "out of range"),
    ]
    for inputs, message in bad_for_first:
        with pytest.raises(InvalidRequest, match=message):
            first.forward("s", 0, inputs)
    bad_for_last = [
        (torch.zeros(2, last.hidden_size + 1), r"\[T, 64\]"),
        (torch.zeros(last.hidden_size), r"\[T, 64\]"),
        (torch.zeros(2, last.hidden_size, dtype=torch.long), "floating point"),
    ]
    for inputs, message in bad_for_last:
        with pytest.raises(InvalidRequest, match=message):
            last.forward("s", 0, inputs)
    assert first.sessions() == [] and last.sessions() == []
    # Token ids of any integer dtype are accepted.
    assert first.forward("s", 0, TOKENS[:3].to(torch.int32)).shape == (3, first.hidden_size)


def test_description_properties(llama) -> None:
    model, package = llama
    first = load_stage_runtime(package, LayerRange(0, 2), max_sessions=3)
    last = load_stage_runtime(package, LayerRange(2, 6))
    assert (first.is_first, first.is_last, last.is_first, last.is_last) == (
        True,
        False,
        False,
        True,
    )
    assert first.layer_range == LayerRange(0, 2) and last.layer_range == LayerRange(2, 6)
    assert first.hidden_size == model.config.hidden_size
    assert last.vocab_size == model.config.vocab_size
    assert first.config.num_hidden_layers == 6
    assert first.device == "cpu" and first.dtype == "float32"
    assert first.max_sessions == 3
    assert first.kv_bytes() == 0
    # 2 layers x (K + V) x 2 KV heads x head_dim 16 x 4 bytes
    assert first.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4
    first.forward("s", 0, TOKENS[:3])
    assert first.kv_bytes() >= 3 * first.kv_bytes_per_token


def test_unsupported_architecture_names_the_supported_ones(tmp_path: Path) -> None:
    GPT2Config(n_layer=2, n_embd=32, n_head=2, architectures=["GPT2LMHeadModel"]).save_pretrained(
        tmp_path
    )
    with pytest.raises(UnsupportedArchitecture) as caught:
        load_stage_runtime(tmp_path, LayerRange(0, 1))
    assert "GPT2LMHeadModel" in caught.value.message
    for name in SUPPORTED_ARCHITECTURES:
        assert name in caught.value.message


def test_config_without_architecture_is_refused(llama, tmp_path: Path) -> None:
    model, _ = llama
    config = model.config.to_dict()
    config.pop("architectures", None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitecture, match="no architecture"):
        load_stage_runtime(tmp_path, LayerRange(0, 1))


def test_missing_or_truncated_layer_file_is_a_package_error(llama, tmp_path: Path) -> None:
    _, package = llama
    copy = tmp_path / "pkg"
    copy.mkdir()
    for path in package.rglob("*"):
        if path.is_file():
            target = copy / path.relative_to(package)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(path.read_bytes())
    (copy / layer_path(3)).unlink()
    load_stage_runtime(copy, LayerRange(0, 3))  # a slice without layer 3 loads fine
    with pytest.raises(PackageError, match="00003.safetensors is missing"):
        load_stage_runtime(copy, LayerRange(3, 6))
    data = (copy / layer_path(4)).read_bytes()
    (copy / layer_path(4)).write_bytes(data[: len(data) // 2])
    with pytest.raises(PackageError, match="00004.safetensors holds"):
        load_stage_runtime(copy, LayerRange(4, 6))


def test_bad_load_arguments_are_refused(llama) -> None:
    _, package = llama
    with pytest.raises(InvalidRequest, match=r"outside \[0, 6\)"):
        load_stage_runtime(package, LayerRange(4, 8))
    with pytest.raises(InvalidRequest, match="dtype 'float64'"):
        load_stage_runtime(package, LayerRange(0, 6), dtype="float64")
    with pytest.raises(InvalidRequest, match="max_sessions"):
        load_stage_runtime(package, LayerRange(0, 6), max_sessions=0)
    with pytest.raises(PackageError, match="not found"):
        load_stage_runtime(package / "nowhere", LayerRange(0, 6))
