"""Verification of a draft window on the last stage, and stop handling.

A verify window is ``[current, d1..dk]`` at positions ``[pos_start, pos_start + k]``;
the target's logits row ``i`` predicts the token at ``pos_first + i`` where
``pos_first = pos_start + 1``. For each row the target token is drawn with the
request's position-keyed sampler. ``d(i+1)`` is kept while it equals the draw at
row ``i``; the first mismatch emits the draw and stops; when every draft token
matched, the draw of the last row is emitted as a bonus token.

Why this is lossless for every temperature: the draw for position ``p`` depends only
on (seed, p) and on the logits at ``p``. Row ``i`` sees exactly the prefix plain
decoding would have seen (all earlier draft tokens equalled the plain draws), so
every emitted token is the token plain decoding would have produced at that
position: same sequence, not merely the same distribution.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from mesh.errors import Fatal
from mesh.sampling import first_maxima, sample_token
from mesh.types import SamplingParams


@dataclass(frozen=True)
class VerifyResult:
    """Tokens to commit (``accepted_count`` draft tokens, then one target token)."""

    emitted: list[int]
    accepted_count: int


def verify_window(
    logits: torch.Tensor,
    window_tokens: Sequence[int],
    params: SamplingParams,
    pos_first: int,
    history: Sequence[int] = (),
) -> VerifyResult:
    """Verify ``window_tokens = [current, d1..dk]`` against ``logits[k+1, V]``.

    ``pos_first`` is the absolute position of the first emitted token
    (``pos_start + 1`` of the window). ``history`` is every token id before the
    window (penalties use it): row ``i`` is chosen after ``history`` and the
    window's first ``i + 1`` tokens, as plain decoding would have. Emits between 1
    and k+1 tokens.
    """
    rows = len(window_tokens)
    if logits.dim() != 2 or logits.shape[0] != rows or rows == 0:
        raise Fatal(
            f"verify window has {rows} token(s) but logits have shape {tuple(logits.shape)}; "
            "expected [len(window_tokens), vocab]"
        )
    drafts = [int(t) for t in window_tokens[1:]]
    if params.greedy and not params.adjusts_logits:
        # Same choice as sample_token (first maximum), one argmax for all rows.
        draws = first_maxima(logits)
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == draws[accepted]:
            accepted += 1
        return VerifyResult(emitted=drafts[:accepted] + [draws[accepted]], accepted_count=accepted)
    emitted: list[int] = []
    for row in range(rows):
        seen = [*history, *window_tokens[: row + 1]] if params.uses_history else ()
        draw = sample_token(logits[row], params, position=pos_first + row, history=seen)
        emitted.append(draw)
        if row == len(drafts) or drafts[row] != draw:
            break
    return VerifyResult(emitted=emitted, accepted_count=len(emitted) - 1)


def truncate_at_stop(
    emitted: Sequence[int], eos_ids: Iterable[int], max_new_tokens_left: int
) -> tuple[list[int], str | None]:
    """Cut emitted tokens at the first end-of-sequence token (kept) or when the
    request's token budget runs out; nothing past either is returned.

    Returns ``(tokens, finished_reason)`` with reason ``"stop"`` (EOS), ``"length"``
    (budget reached) or None (the request goes on).
    """
    eos = set(eos_ids)
    if max_new_tokens_left <= 0:
        return [], "length"
    kept: list[int] = []
    for token in emitted:
        kept.append(int(token))
        if token in eos:
            return kept, "stop"
        if len(kept) == max_new_tokens_left:
            return kept, "length"
    return kept, None
