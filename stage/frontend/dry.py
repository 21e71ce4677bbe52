"""DRY's sequence breakers as token ids.

A request names its breakers as text (llama.cpp's ``dry_sequence_breakers``, by
default ``"\\n"``, ``":"``, ``'"'`` and ``"*"``); the last stage, which samples,
has no tokenizer, so stage 0 sends the ids of every token whose text holds one of
them (mesh/sampling.py ``dry_repeats``: a repeat never runs across such a token).
Decoding the whole vocabulary takes 0.4 s for SmolLM2's 49,152 tokens on one core
of the test VM: it is done once per tokenizer, off the event loop (``warm``), and
the ids are kept per breaker list.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Sequence
from typing import Any

from stage.frontend.schemas import DRY_DEFAULT_BREAKERS, GenerationBody

# Breaker lists kept per tokenizer (the default and a few of the requests' own).
_LISTS_KEPT = 32
_lock = threading.Lock()
_texts: weakref.WeakKeyDictionary[Any, list[str]] = weakref.WeakKeyDictionary()
_ids: weakref.WeakKeyDictionary[Any, dict[tuple[str, ...], tuple[int, ...]]] = (
    weakref.WeakKeyDictionary()
)


def token_texts(tokenizer: Any) -> list[str]:
    """Each token id's text, decoded alone (kept per tokenizer)."""
    with _lock:
        found = _texts.get(tokenizer)
    if found is not None:
        return found
    texts = tokenizer.batch_decode(
        [[token] for token in range(len(tokenizer))],
        skip_special_tokens=False,
        clean_up_tokenization_spaces=False,
    )
    with _lock:
        _texts[tokenizer] = texts
    return texts


def breakers_of(body: GenerationBody) -> tuple[str, ...]:
    """The request's breakers (llama.cpp's defaults when it names none)."""
    named = body.dry_sequence_breakers
    return DRY_DEFAULT_BREAKERS if named is None else tuple(named)


def breaker_ids(tokenizer: Any, breakers: Sequence[str]) -> tuple[int, ...]:
    """The ids of the tokens whose text holds one of ``breakers``."""
    key = tuple(breakers)
    with _lock:
        kept = _ids.setdefault(tokenizer, {})
        found = kept.get(key)
    if found is not None:
        return found
    ids = tuple(
        token for token, text in enumerate(token_texts(tokenizer)) if any(b in text for b in key)
    )
    with _lock:
        if len(kept) >= _LISTS_KEPT:
            kept.pop(next(iter(kept)))
        kept[key] = ids
    return ids


async def warm(body: GenerationBody, tokenizer: Any) -> None:
    """Decode the vocabulary off the event loop before a DRY request needs it."""
    if body.dry_multiplier:
        await asyncio.to_thread(breaker_ids, tokenizer, breakers_of(body))
