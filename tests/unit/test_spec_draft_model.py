"""Draft-model drafting with a tiny random Llama: greedy proposals, cache cropping
after rejections (no re-prefill), p_min, limits, loading and tokenizer checks."""

from __future__ import annotations

import pytest
import torch

from mesh.config import DraftRef
from mesh.errors import PackageError
from mesh.speculative import DraftModelDrafter, check_draft_compatible, load_draft_model
from mesh.speculative.draft_model import _pick_gguf

PROMPT = [1, 400, 2001, 17, 9000, 311, 42, 42, 1234, 77]


@pytest.fixture(scope="module")
def loaded(tiny_model_factory):
    path = tiny_model_factory("llama", layers=2, seed=5)
    return load_draft_model(DraftRef(str(path), None, True))


def reference(model, tokens: list[int], k: int, vocab_limit: int | None = None) -> list[int]:
    """Greedy continuation by full forwards without a cache."""
    seq = list(tokens)
    with torch.no_grad():
        for _ in range(k):
            logits = model(input_ids=torch.tensor([seq])).logits[0, -1]
            seq.append(int(torch.argmax(logits[:vocab_limit] if vocab_limit else logits)))
    return seq[len(tokens) :]


def test_proposals_are_the_greedy_continuation(loaded) -> None:
    drafter = DraftModelDrafter(loaded.model)
    drafter.begin(PROMPT)
    assert drafter.propose(5) == reference(loaded.model, PROMPT, 5)
    assert drafter.cached_length == len(PROMPT) + 4
    assert drafter.cost_per_token_s > 0.0


def test_rejection_crops_the_cache_and_never_reprefills(loaded) -> None:
    drafter = DraftModelDrafter(loaded.model)
    drafter.begin(PROMPT)
    proposal = drafter.propose(4)
    wrong = (proposal[1] + 1) % 1000
    drafter.accept(1, wrong)  # d1 kept, d2 rejected: the target said `wrong`
    assert drafter.cached_length == len(PROMPT) + 1  # prompt + d1 survive
    fed = drafter.fed_tokens
    committed = [*PROMPT, proposal[0], wrong]
    assert drafter.propose(4) == reference(loaded.model, committed, 4)
    assert drafter.fed_tokens - fed == 1 + 3  # only `wrong`, then one token per draft step


def test_full_acceptance_feeds_the_last_draft_and_the_bonus(loaded) -> None:
    drafter = DraftModelDrafter(loaded.model)
    drafter.begin(PROMPT)
    proposal = drafter.propose(3)
    drafter.accept(3, 5)
    fed = drafter.fed_tokens
    committed = [*PROMPT, *proposal, 5]
    assert drafter.propose(1) == reference(loaded.model, committed, 1)
    assert drafter.fed_tokens - fed == 2


def test_rollback_and_catch_up(loaded) -> None:
    drafter = DraftModelDrafter(loaded.model)
    drafter.begin(PROMPT)
    drafter.propose(3)
    drafter.rollback(6)
    assert drafter.cached_length == 6
    assert drafter.propose(2) == reference(loaded.model, PROMPT[:6], 2)
    # Rounds decoded without proposals: the cache catches up with only the new tokens.
    drafter.extend([10, 11, 12])
    fed = drafter.fed_tokens
    assert drafter.propose(1) == reference(loaded.model, [*PROMPT[:6], 10, 11, 12], 1)
    assert drafter.fed_tokens - fed == 3  # the stale draft slot is cropped, 3 fed


def test_p_min_stops_uncertain_drafts(loaded) -> None:
    drafter = DraftModelDrafter(loaded.model, p_min=0.99)
    drafter.begin(PROMPT)
    assert drafter.propose(4) == []  # a random model is never that sure
    drafter = DraftModelDrafter(loaded.model, p_min=1e-9)
    drafter.begin(PROMPT)
    assert drafter.propose(3) == reference(loaded.model, PROMPT, 3)


def test_vocab_limit_and_position_limit(loaded) -> None:
    drafter = DraftModelDrafter(loaded.model, vocab_limit=100)
    drafter.begin(PROMPT)
    proposal = drafter.propose(3)
    assert all(t < 100 for t in proposal)
    assert proposal == reference(loaded.model, PROMPT, 3, vocab_limit=100)
    long_prompt = [5] * (loaded.model.config.max_position_embeddings - 2)
    drafter = DraftModelDrafter(loaded.model)
    drafter.begin(long_prompt)
    assert len(drafter.propose(5)) == 2


def test_compatible_tokenizers(loaded) -> None:
    assert check_draft_compatible(loaded.tokenizer, loaded.tokenizer) == []


def test_added_tokens_are_reported(loaded, tmp_path) -> None:
    from transformers import AutoTokenizer

    loaded.tokenizer.save_pretrained(tmp_path)
    other = AutoTokenizer.from_pretrained(tmp_path)
    other.add_tokens(["<extra_a>", "<extra_b>"])
    problems = check_draft_compatible(loaded.tokenizer, other)
    assert any("vocabulary sizes differ" in p for p in problems)
    assert any("2 token(s) have different ids" in p for p in problems)


def test_special_tokens_and_small_embedding_are_reported(loaded, tmp_path) -> None:
    from transformers import AutoTokenizer

    loaded.tokenizer.save_pretrained(tmp_path)
    other = AutoTokenizer.from_pretrained(tmp_path)
    other.eos_token = other.convert_ids_to_tokens(5)
    problems = check_draft_compatible(loaded.tokenizer, other, draft_vocab_size=1000)
    assert any(p.startswith("eos_token differs") for p in problems)
    assert any("embeds 1000 tokens" in p for p in problems)


def test_load_errors_are_package_errors(tmp_path) -> None:
    with pytest.raises(PackageError, match="does not exist"):
        load_draft_model(DraftRef(str(tmp_path / "missing"), None, True))
    with pytest.raises(PackageError, match="expected one .gguf"):
        load_draft_model(DraftRef(str(tmp_path), None, True))


def test_pick_gguf_by_quant() -> None:
    names = ["README.md", "m-Q8_0.gguf", "m-Q4_K_M.gguf", "sub/m-f16.gguf"]
    assert _pick_gguf(names, "q4_k_m", "org/m") == "m-Q4_K_M.gguf"
    assert _pick_gguf(["a.gguf"], None, "dir") == "a.gguf"
    with pytest.raises(PackageError, match="for quant Q2_K"):
        _pick_gguf(names, "Q2_K", "org/m")
    with pytest.raises(PackageError, match="expected one"):
        _pick_gguf(names, None, "org/m")
