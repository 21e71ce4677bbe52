"""build_drafter: the drafter each config yields, and the warning + n-gram fallback for
drafts that cannot be loaded or do not match the target's vocabulary."""

from __future__ import annotations

import logging
import shutil

import pytest

from mesh.config import DraftRef, SpeculationConfig, WindowPolicySpec
from mesh.speculative import (
    AdaptiveWindow,
    AutoNgramDrafter,
    CompositeDrafter,
    CostAwareWindow,
    DraftModelDrafter,
    MemoryNgramDrafter,
    NgramDrafter,
    build_drafter,
)


@pytest.fixture(scope="module")
def draft_dir(tiny_model_factory):
    return tiny_model_factory("llama", layers=2, seed=5)


@pytest.fixture(scope="module")
def target_tokenizer(draft_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(draft_dir)


def draft_config(path, type_="draft-model", **kwargs) -> SpeculationConfig:
    return SpeculationConfig(type=type_, draft_model=DraftRef(str(path), None, True), **kwargs)


def test_none_disables() -> None:
    assert build_drafter(SpeculationConfig(type="none"), None) is None


def test_ngram_variants() -> None:
    factory = build_drafter(SpeculationConfig(type="ngram"), None)
    drafter = factory.new_drafter()
    assert isinstance(drafter, AutoNgramDrafter)
    assert isinstance(drafter.inner, MemoryNgramDrafter)
    assert isinstance(factory.new_policy(), CostAwareWindow)
    plain = build_drafter(
        SpeculationConfig(
            type="ngram",
            auto=False,
            ngram_memory=False,
            window_policy=WindowPolicySpec("adaptive", 4, 1, 8),
        ),
        None,
    )
    drafter = plain.new_drafter()
    assert type(drafter) is NgramDrafter
    assert isinstance(plain.new_policy(), AdaptiveWindow)
    assert plain.new_drafter() is not drafter  # one drafter per request


def test_missing_draft_warns_and_falls_back(tmp_path, target_tokenizer, caplog) -> None:
    missing = tmp_path / "no-such-draft"
    with caplog.at_level(logging.WARNING, logger="mesh.speculative.factory"):
        factory = build_drafter(draft_config(missing), target_tokenizer)
    assert factory.name == "ngram"
    assert str(missing) in factory.fallback_reason
    assert isinstance(factory.new_drafter(), AutoNgramDrafter)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(missing) in warnings[0].getMessage()


def test_mismatched_vocab_warns_and_falls_back(
    draft_dir, target_tokenizer, tmp_path, caplog
) -> None:
    from transformers import AutoTokenizer

    other = tmp_path / "other-vocab"
    shutil.copytree(draft_dir, other)
    tokenizer = AutoTokenizer.from_pretrained(other)
    tokenizer.add_tokens(["<tool>", "</tool>"])
    tokenizer.save_pretrained(other)
    with caplog.at_level(logging.WARNING, logger="mesh.speculative.factory"):
        factory = build_drafter(draft_config(other, "composite"), target_tokenizer)
    assert factory.name == "ngram"
    assert "vocabulary sizes differ" in factory.fallback_reason
    assert any("does not match the target tokenizer" in r.getMessage() for r in caplog.records)


def test_loader_failures_of_any_kind_fall_back(target_tokenizer, caplog) -> None:
    def broken_loader(ref, device, dtype):
        raise ImportError("gguf support is not installed")

    with caplog.at_level(logging.WARNING, logger="mesh.speculative.factory"):
        factory = build_drafter(draft_config("/x"), target_tokenizer, loader=broken_loader)
    assert factory.name == "ngram"
    assert "gguf support is not installed" in caplog.text


def test_compatible_draft_and_composite(draft_dir, target_tokenizer) -> None:
    factory = build_drafter(draft_config(draft_dir, p_min=0.0), target_tokenizer)
    assert factory.name == "draft-model" and factory.fallback_reason is None
    first, second = factory.new_drafter(), factory.new_drafter()
    assert isinstance(first, DraftModelDrafter)
    assert first.model is second.model  # weights shared, caches per request
    assert first.vocab_limit == len(target_tokenizer)
    first.begin([1, 2, 3])
    assert len(first.propose(2)) == 2 and second.cached_length == 0

    composite = build_drafter(draft_config(draft_dir, "composite"), target_tokenizer)
    drafter = composite.new_drafter()
    assert isinstance(drafter, CompositeDrafter)
    assert isinstance(drafter.draft, DraftModelDrafter)
    drafter.begin([5, 6, 7, 8])  # no repeat: the draft model proposes
    assert len(drafter.propose(3)) == 3 and drafter.last_source is drafter.draft
