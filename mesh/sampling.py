"""Seeded, position-keyed token sampling.

The random draw for the token at absolute position ``p`` depends only on the
request's seed and ``p``. So the plain decode loop and speculative verification
draw exactly the same token at every position, which makes speculation lossless
for any temperature and makes outputs reproducible per seed.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from mesh.types import SamplingParams

_MIX = 0x9E3779B97F4A7C15
_MASK = (1 << 63) - 1
# top-p first looks for its tokens among those at least this fraction of the likeliest
# token's probability (then a smaller one), sorting only them; it sorts the whole
# vocabulary only when their mass falls short of top_p (a flat distribution).
NUCLEUS_FLOORS = (2.0**-10, 2.0**-20)
# Below this many tokens top-p sorts the whole vocabulary (as fast there).
NUCLEUS_SORT_BELOW = 4096
# The candidates' mass must pass top_p by this much: the exclusive prefix sums of the
# whole sorted vocabulary (which decide what is kept) then pass it too, whatever
# their rounding beyond the candidates.
NUCLEUS_MARGIN = 1e-6


def first_maxima(logits: torch.Tensor) -> list[int]:
    """The index of the first maximum of each row of ``logits`` (``[rows, V]``; a 1-D
    vector gives one), as ``torch.argmax`` chooses (a NaN counts as the maximum). On
    a CPU through numpy, whose vectorised argmax takes 16 us where torch's takes 450
    us over 4 rows of a 49,152-token vocabulary (one thread, this project's 2-core
    test VM): it runs for every token served."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64):
        found = logits.detach().numpy().argmax(axis=-1)
        return [int(found)] if logits.dim() == 1 else [int(i) for i in found]
    found = torch.argmax(logits, dim=-1)
    return [int(found)] if logits.dim() == 1 else found.tolist()


def position_seed(seed: int, position: int) -> int:
    """A 63-bit generator seed from (request seed, absolute position)."""
    value = (seed * _MIX + (position + 1) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    value ^= value >> 31
    return value & _MASK


def adjust_logits(
    logits: torch.Tensor, params: SamplingParams, history: Sequence[int] = ()
) -> torch.Tensor:
    """The logits after penalties and biases (float32, CPU), for the token that
    follows ``history`` (every token id before it: the prompt's first
    ``params.prompt_tokens``, then the output). In this order: ``repetition_penalty``
    divides a positive logit (multiplies a negative one) of every token seen in
    ``history``; ``frequency_penalty`` times the token's count in the output and
    ``presence_penalty`` for a token the output holds are subtracted; ``logit_bias``
    is added; while the output holds fewer than ``min_tokens`` tokens, the
    ``hold_back`` tokens are ruled out, unless no other token is left (``logits``
    already masked to the end of a grammar). Returns ``logits`` itself when nothing
    applies."""
    if not params.adjusts_logits:
        return logits
    scores = logits.detach().to(device="cpu", dtype=torch.float32).clone()
    vocab = scores.numel()
    if params.uses_history and history:
        ids = torch.tensor(history, dtype=torch.long).clamp_(0, vocab - 1)
        if params.repetition_penalty != 1.0:
            seen = torch.unique(ids)
            values = scores[seen]
            penalty = params.repetition_penalty
            scores[seen] = torch.where(values > 0, values / penalty, values * penalty)
        output = ids[params.prompt_tokens :]
        if output.numel() and (params.frequency_penalty or params.presence_penalty):
            counts = torch.bincount(output, minlength=vocab).to(torch.float32)
            scores -= params.frequency_penalty * counts
            scores -= params.presence_penalty * (counts > 0).to(torch.float32)
    for token, bias in params.logit_bias:
        if token < vocab:
            scores[token] += bias
    if params.holds_back and len(history) - params.prompt_tokens < params.min_tokens:
        held = [token for token in params.hold_back if token < vocab]
        kept = scores[held].clone()
        scores[held] = float("-inf")
        if not bool(torch.isfinite(scores).any()):
            # Nothing else may come (a grammar that is complete allows only its end):
            # the end comes before min_tokens.
            scores[held] = kept
    return scores


def token_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities over the vocabulary after temperature, top-k, min-p and top-p
    (float32, CPU)."""
    scores = logits.detach().to(device="cpu", dtype=torch.float32) / params.temperature
    if params.top_k > 0 and params.top_k < scores.numel():
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
        probs = probs / probs.sum()
    if params.top_p < 1.0:
        probs = nucleus(probs, params.top_p)
    return probs


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """``probs`` (1-D) kept to its likeliest tokens: in descending order, a token is
    kept while the mass before it is below ``top_p``; renormalised. Exactly the
    result of sorting the whole vocabulary (its prefix sums are the same numbers),
    found by sorting only the tokens above a floor when their mass passes ``top_p``
    (``_likeliest``; a 49,152-token torch sort takes 4.7 ms on one core of the test
    VM, longer than a small model's decode step on a GPU). Which of several tokens
    of exactly equal probability at the boundary is kept follows the sort's order
    (deterministic: numpy's here, torch's before, so such a tie may now keep another
    of the equal tokens)."""
    ordered = _likeliest(probs, top_p)
    if ordered is None:
        values, order = torch.sort(probs, descending=True)
        total = torch.cumsum(values, dim=-1)
    else:
        values, order, total = ordered
    values = values.masked_fill(total - values >= top_p, 0.0)
    kept = torch.zeros_like(probs).scatter(0, order, values)
    return kept / kept.sum()


def _likeliest(
    probs: torch.Tensor, top_p: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The tokens above a floor of ``probs`` (a CPU float32 vector) in descending
    order (values, indices, running sums) when their mass passes ``top_p``: every
    token top-p keeps is among them. None when no floor gives that (or the vector is
    not on a CPU), for the caller to sort everything. Sorted by numpy (its argsort
    takes 0.75 ms over a 49,152-token vocabulary where torch's sort takes 4.7 ms)."""
    if probs.device.type != "cpu" or probs.dtype != torch.float32:
        return None
    if probs.numel() < NUCLEUS_SORT_BELOW:
        return None
    array = probs.detach().numpy()
    top = float(array.max())
    for floor in NUCLEUS_FLOORS:
        index = np.flatnonzero(array >= top * floor)
        if index.size == 0:
            return None  # NaN
        index = index[np.argsort(-array[index], kind="quicksort")]
        order = torch.from_numpy(index)
        values = probs[order]
        total = torch.cumsum(values, dim=-1)
        if float(total[-1]) >= top_p + NUCLEUS_MARGIN:
            return values, order, total
    return None


def sample_token(
    logits: torch.Tensor, params: SamplingParams, position: int, history: Sequence[int] = ()
) -> int:
    """Pick the token for absolute ``position`` from a 1-D logits vector; ``history``
    is every token id before that position (used by penalties only)."""
    logits = adjust_logits(logits, params, history)
    if params.greedy:
        return first_maxima(logits)[0]
    return draw_token(token_probs(logits, params), params.seed, position)


def draw_token(probs: torch.Tensor, seed: int, position: int) -> int:
    """The token drawn from ``probs`` (1-D, CPU) for absolute ``position`` with the
    request's ``seed``: the same draw for the same (seed, position), never a token of
    probability 0."""
    generator = torch.Generator().manual_seed(position_seed(seed, position))
    draw = torch.rand((), generator=generator, dtype=torch.float64).item()
    cdf = torch.cumsum(probs.to(torch.float64), dim=-1)
    index = int(torch.searchsorted(cdf, torch.tensor([draw * float(cdf[-1])])).item())
    index = min(index, probs.numel() - 1)
    while probs[index] == 0.0 and index > 0:
        index -= 1
    return index


def token_logprob(
    logits: torch.Tensor, params: SamplingParams, token: int, history: Sequence[int] = ()
) -> tuple[float, tuple[tuple[int, float], ...]]:
    """``token``'s log-probability under the distribution it was chosen from
    (penalties and biases applied, before temperature and filtering, as OpenAI
    reports them) and the ``params.top_logprobs`` likeliest tokens, best first."""
    scores = adjust_logits(logits, params, history).detach().to("cpu", torch.float32)
    logprobs = torch.log_softmax(scores, dim=-1)
    top: tuple[tuple[int, float], ...] = ()
    if params.top_logprobs > 0:
        values, indices = torch.topk(logprobs, min(params.top_logprobs, logprobs.numel()))
        top = tuple(zip(indices.tolist(), values.tolist(), strict=True))
    return float(logprobs[token]), top
