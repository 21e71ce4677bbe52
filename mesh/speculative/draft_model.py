"""Drafting with a small causal LM that shares the target's tokenizer.

The draft model runs on stage 0 with its own KV cache per request. After a rejected
window the cache is cropped back to the committed prefix (never re-prefilled), and
the next proposal feeds only the tokens the cache lacks (typically one or two).
Proposals are greedy; with ``p_min > 0`` drafting stops early when the draft's top
probability falls below it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mesh.config import DraftRef
from mesh.errors import PackageError, Unavailable
from mesh.sampling import first_maxima
from mesh.speculative.drafter import Drafter

logger = logging.getLogger(__name__)

_SPECIAL_ATTRS = ("bos_token", "eos_token", "pad_token", "unk_token")


@dataclass(frozen=True)
class LoadedDraft:
    """A loaded draft model, its tokenizer, and where they came from."""

    model: Any
    tokenizer: Any
    source: str


def _pick_gguf(names: list[str], quant: str | None, where: str) -> str:
    ggufs = sorted(n for n in names if n.lower().endswith(".gguf"))
    if quant:
        ggufs = [n for n in ggufs if quant.lower() in Path(n).name.lower()]
    if len(ggufs) == 1 or (quant and ggufs):
        return ggufs[0]
    wanted = f" for quant {quant}" if quant else ""
    raise PackageError(
        f"draft model {where}: expected one .gguf file{wanted}, found "
        f"{', '.join(ggufs) or 'none'}; name the quant as repo:QUANT or point at the file"
    )


def local_draft_location(path: Path, quant: str | None = None) -> tuple[str, dict[str, Any]]:
    """Where ``from_pretrained`` reads a local draft (a directory with config.json, a
    ``.gguf`` file, or a directory holding one, ``quant`` picking among several) and
    its keyword arguments. Raises PackageError when there is nothing to load."""
    path = Path(path).expanduser()
    if not path.exists():
        raise PackageError(f"draft model path {path} does not exist")
    if path.is_file():
        return str(path.parent), {"gguf_file": path.name}
    if (path / "config.json").is_file():
        return str(path), {}
    return str(path), {"gguf_file": _pick_gguf([p.name for p in path.iterdir()], quant, str(path))}


def load_draft_model(
    ref: DraftRef, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> LoadedDraft:
    """Load a draft model and tokenizer from a local directory, a local ``.gguf``, an HF
    repo, or one quant of an HF repo's GGUF files. Raises PackageError (bad reference
    or files) or Unavailable (the hub could not be reached)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict[str, Any] = {}
    if ref.is_local:
        location, kwargs = local_draft_location(Path(ref.repo_or_path))
    else:
        location = ref.repo_or_path
        if ref.quant:
            try:
                from huggingface_hub import HfApi

                names = HfApi().list_repo_files(ref.repo_or_path)
            except Exception as error:  # hub errors have no common base class
                raise Unavailable(
                    f"cannot list the files of draft repo {ref.repo_or_path}: {error}"
                ) from error
            kwargs["gguf_file"] = _pick_gguf(names, ref.quant, str(ref))
    try:
        tokenizer = AutoTokenizer.from_pretrained(location, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(location, **kwargs)
    except (OSError, ValueError, KeyError, RuntimeError) as error:
        raise PackageError(f"cannot load draft model {ref}: {error}") from error
    model = model.to(device=device, dtype=dtype) if dtype is not None else model.to(device)
    model.eval()
    return LoadedDraft(model=model, tokenizer=tokenizer, source=str(ref))


def check_draft_compatible(
    target_tokenizer: Any, draft_tokenizer: Any, *, draft_vocab_size: int | None = None
) -> list[str]:
    """Reasons the draft cannot propose tokens for the target (empty when it can):
    vocabulary size or contents differ, special tokens differ, or the draft model's
    embedding (``draft_vocab_size``) is too small for the target's token ids."""
    problems: list[str] = []
    target_size, draft_size = len(target_tokenizer), len(draft_tokenizer)
    if target_size != draft_size:
        problems.append(f"vocabulary sizes differ: target {target_size}, draft {draft_size}")
    target_vocab, draft_vocab = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if target_vocab != draft_vocab:
        differing = sorted(
            token
            for token in target_vocab.keys() | draft_vocab.keys()
            if target_vocab.get(token) != draft_vocab.get(token)
        )
        examples = ", ".join(repr(t) for t in differing[:3])
        problems.append(f"{len(differing)} token(s) have different ids, e.g. {examples}")
    for attr in _SPECIAL_ATTRS:
        target_value = getattr(target_tokenizer, attr, None)
        draft_value = getattr(draft_tokenizer, attr, None)
        target_id = getattr(target_tokenizer, f"{attr}_id", None)
        draft_id = getattr(draft_tokenizer, f"{attr}_id", None)
        if (target_value, target_id) != (draft_value, draft_id):
            problems.append(
                f"{attr} differs: target {target_value!r} (id {target_id}), "
                f"draft {draft_value!r} (id {draft_id})"
            )
    target_special = set(getattr(target_tokenizer, "all_special_tokens", []))
    draft_special = set(getattr(draft_tokenizer, "all_special_tokens", []))
    if target_special != draft_special:
        changed = sorted(target_special ^ draft_special)
        problems.append(f"special tokens differ: {', '.join(repr(t) for t in changed[:5])}")
    if draft_vocab_size is not None and draft_vocab_size < target_size:
        problems.append(
            f"draft model embeds {draft_vocab_size} tokens, fewer than the target's {target_size}"
        )
    return problems


class DraftModelDrafter(Drafter):
    """Greedy proposals from a small causal LM with a croppable per-request KV cache.

    ``model`` is shared between requests (one drafter per request; each has its own
    cache). ``vocab_limit`` restricts proposals to ids the target knows.
    """

    name = "draft-model"

    def __init__(self, model: Any, p_min: float = 0.0, vocab_limit: int | None = None) -> None:
        super().__init__()
        self.model = model
        self.p_min = p_min
        self.vocab_limit = vocab_limit
        self.device = next(model.parameters()).device
        self.max_positions: int | None = getattr(model.config, "max_position_embeddings", None)
        self.fed_tokens = 0
        self.forward_calls = 0
        self._cache: Any = None
        self._cache_tokens: list[int] = []

    @property
    def cached_length(self) -> int:
        """Tokens whose keys and values the draft cache holds."""
        return len(self._cache_tokens)

    def _on_begin(self, prompt_text: str | None) -> None:
        from transformers import DynamicCache

        self._cache = DynamicCache()
        self._cache_tokens = []

    def _crop(self, length: int) -> None:
        remove = len(self._cache_tokens) - length
        if remove > 0:
            # A negative argument removes tokens in every transformers release.
            self._cache.crop(-remove)
            del self._cache_tokens[length:]

    def _forward(self, tokens: list[int]) -> torch.Tensor:
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        with torch.no_grad():
            out = self.model(
                input_ids=ids, past_key_values=self._cache, use_cache=True, logits_to_keep=1
            )
        self._cache = out.past_key_values
        self._cache_tokens.extend(tokens)
        self.fed_tokens += len(tokens)
        self.forward_calls += 1
        logits = out.logits[0, -1].float()
        return logits[: self.vocab_limit] if self.vocab_limit else logits

    def _propose(self, k: int) -> list[int]:
        length = len(self._tokens)
        if self.max_positions is not None:
            k = min(k, self.max_positions - length)
        if length == 0 or k <= 0:
            return []
        self._crop(min(len(self._cache_tokens), length - 1))
        logits = self._forward(self._tokens[len(self._cache_tokens) :])
        proposal: list[int] = []
        while True:
            token = first_maxima(logits)[0]
            if self.p_min > 0.0 and float(torch.softmax(logits, -1)[token]) < self.p_min:
                break
            proposal.append(token)
            if len(proposal) == k:
                break
            logits = self._forward([token])
        return proposal

    def _on_commit(self, start: int) -> None:
        # The cache may hold draft tokens past the old committed end: keep the part
        # that matches what was committed, crop the rest.
        limit = min(len(self._cache_tokens), len(self._tokens))
        keep = start
        while keep < limit and self._cache_tokens[keep] == self._tokens[keep]:
            keep += 1
        self._crop(keep)

    def _on_rollback(self, length: int) -> None:
        self._crop(min(len(self._cache_tokens), length))
