"""Turn a resolved SpeculationConfig into per-request drafters and policies.

``build_drafter`` runs once at stage-0 start: it loads the draft model (if any) and
returns a factory that makes a fresh drafter per request, sharing the loaded model
(and, for the suffix drafter, one corpus of finished requests per factory).
A draft that cannot be loaded or does not match the target's vocabulary is logged
as a WARNING and replaced by the n-gram drafter; it never fails the start.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mesh.config import DraftRef, SpeculationConfig
from mesh.speculative.auto import AutoNgramDrafter
from mesh.speculative.corpus import SharedCorpus
from mesh.speculative.draft_model import (
    DraftModelDrafter,
    LoadedDraft,
    check_draft_compatible,
    load_draft_model,
)
from mesh.speculative.drafter import CompositeDrafter, Drafter
from mesh.speculative.ngram import MemoryNgramDrafter, NgramDrafter
from mesh.speculative.policy import WindowPolicy, make_policy
from mesh.speculative.suffix import SuffixDrafter

logger = logging.getLogger(__name__)

DraftLoader = Callable[[DraftRef, Any, Any], LoadedDraft]


@dataclass(frozen=True)
class DrafterFactory:
    """Makes one drafter per request (``make(scope)``). ``fallback_reason`` says why a
    configured draft model is not in use (None when everything loaded as configured);
    ``corpus`` is the suffix drafter's shared corpus (None for other strategies)."""

    name: str
    config: SpeculationConfig
    make: Callable[[str], Drafter]
    fallback_reason: str | None = None
    draft: LoadedDraft | None = None
    corpus: SharedCorpus | None = None

    def new_drafter(self, scope: str = "") -> Drafter:
        """A drafter for one request of tenant ``scope`` (``GenerationRequest.scope``)."""
        return self.make(scope)

    def new_policy(self) -> WindowPolicy:
        return make_policy(self.config.window_policy)


def _ngram_maker(config: SpeculationConfig) -> Callable[[str], Drafter]:
    kind = MemoryNgramDrafter if config.ngram_memory else NgramDrafter

    def make(scope: str) -> Drafter:
        drafter = kind(config.ngram_min, config.ngram_max)
        return AutoNgramDrafter(drafter) if config.auto else drafter

    return make


def _suffix_factory(config: SpeculationConfig) -> DrafterFactory:
    anchors = sorted({config.ngram_min, config.ngram_max})
    corpus = SharedCorpus(config.corpus_tokens, config.corpus_scope, anchors)

    def make(scope: str) -> Drafter:
        view = corpus.view(scope)
        drafter = SuffixDrafter(config.ngram_min, config.ngram_max, corpus=view)
        return AutoNgramDrafter(drafter) if config.auto else drafter

    return DrafterFactory(name="suffix", config=config, make=make, corpus=corpus)


def _load_checked(
    config: SpeculationConfig, target_tokenizer: Any, device: Any, dtype: Any, loader: DraftLoader
) -> tuple[LoadedDraft | None, str | None]:
    ref = config.draft_model
    if ref is None:
        return None, "no draft_model configured"
    try:
        loaded = loader(ref, device, dtype)
    except Exception as error:  # third-party loaders raise many types; a draft never fails start
        return None, f"draft model {ref} could not be loaded: {error}"
    vocab = getattr(loaded.model.config, "vocab_size", None)
    problems = check_draft_compatible(target_tokenizer, loaded.tokenizer, draft_vocab_size=vocab)
    if problems:
        return None, f"draft model {ref} does not match the target tokenizer: " + "; ".join(
            problems
        )
    return loaded, None


def build_drafter(
    config: SpeculationConfig,
    target_tokenizer: Any,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    loader: DraftLoader = load_draft_model,
) -> DrafterFactory | None:
    """A per-request drafter factory for ``config``, or None when speculation is off.

    Never raises for a bad draft: it logs a WARNING naming the reason and falls back
    to the n-gram drafter with the same n-gram and auto settings.
    """
    if not config.enabled:
        return None
    ngram = _ngram_maker(config)
    if config.type == "ngram":
        return DrafterFactory(name="ngram", config=config, make=ngram)
    if config.type == "suffix":
        return _suffix_factory(config)
    loaded, reason = _load_checked(config, target_tokenizer, device, dtype, loader)
    if loaded is None:
        logger.warning("speculation: %s; serving with the n-gram drafter instead", reason)
        return DrafterFactory(name="ngram", config=config, make=ngram, fallback_reason=reason)
    vocab_limit = len(target_tokenizer)

    def draft(scope: str = "") -> Drafter:
        return DraftModelDrafter(loaded.model, p_min=config.p_min, vocab_limit=vocab_limit)

    if config.type == "draft-model":
        return DrafterFactory(name="draft-model", config=config, make=draft, draft=loaded)

    def composite(scope: str) -> Drafter:
        return CompositeDrafter(ngram(scope), draft(scope))

    return DrafterFactory(name="composite", config=config, make=composite, draft=loaded)
