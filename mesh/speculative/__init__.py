"""Speculative decoding: drafters, window policies, the verifier and telemetry.

Plain torch: nothing here imports grpc, fastapi, ``stage`` or ``coordinator``.
See docs/speculation.md for how stage 0 drives these per verify round.
"""

from mesh.speculative.auto import AutoNgramDrafter, prompt_signals
from mesh.speculative.corpus import CorpusStats, CorpusView, SharedCorpus
from mesh.speculative.draft_model import (
    DraftModelDrafter,
    LoadedDraft,
    check_draft_compatible,
    load_draft_model,
)
from mesh.speculative.drafter import CompositeDrafter, Drafter
from mesh.speculative.factory import DrafterFactory, build_drafter
from mesh.speculative.ngram import MemoryNgramDrafter, NgramDrafter, NgramIndex
from mesh.speculative.policy import (
    AdaptiveWindow,
    CostAwareWindow,
    FixedWindow,
    RoundContext,
    WindowPolicy,
    best_window,
    expected_tokens,
    make_policy,
    plan_window,
)
from mesh.speculative.suffix import SuffixDrafter
from mesh.speculative.telemetry import Telemetry
from mesh.speculative.verify import VerifyResult, truncate_at_stop, verify_window

__all__ = [
    "AdaptiveWindow",
    "AutoNgramDrafter",
    "CompositeDrafter",
    "CorpusStats",
    "CorpusView",
    "CostAwareWindow",
    "DraftModelDrafter",
    "Drafter",
    "DrafterFactory",
    "FixedWindow",
    "LoadedDraft",
    "MemoryNgramDrafter",
    "NgramDrafter",
    "NgramIndex",
    "RoundContext",
    "SharedCorpus",
    "SuffixDrafter",
    "Telemetry",
    "VerifyResult",
    "WindowPolicy",
    "best_window",
    "build_drafter",
    "check_draft_compatible",
    "expected_tokens",
    "load_draft_model",
    "make_policy",
    "plan_window",
    "prompt_signals",
    "truncate_at_stop",
    "verify_window",
]
