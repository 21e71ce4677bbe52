"""Seeded, position-keyed token sampling.

The random draw for the token at absolute position ``p`` depends only on the
request's seed and ``p``. So the plain decode loop and speculative verification
draw exactly the same token at every position, which makes speculation lossless
for any temperature and makes outputs reproducible per seed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mesh.types import SamplingParams

_MIX = 0x9E3779B97F4A7C15
_MASK = (1 << 63) - 1


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
    ``hold_back`` tokens are ruled out. Returns ``logits`` itself when nothing
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
        scores[held] = float("-inf")
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
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
        probs = probs / probs.sum()
    return probs


def sample_token(
    logits: torch.Tensor, params: SamplingParams, position: int, history: Sequence[int] = ()
) -> int:
    """Pick the token for absolute ``position`` from a 1-D logits vector; ``history``
    is every token id before that position (used by penalties only)."""
    logits = adjust_logits(logits, params, history)
    if params.greedy:
        return int(torch.argmax(logits).item())
    probs = token_probs(logits, params)
    generator = torch.Generator().manual_seed(position_seed(params.seed, position))
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
