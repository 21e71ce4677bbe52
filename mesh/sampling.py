"""Seeded, position-keyed token sampling.

The random draw for the token at absolute position ``p`` depends only on the
request's seed and ``p``. So the plain decode loop and speculative verification
draw exactly the same token at every position, which makes speculation lossless
for any temperature and makes outputs reproducible per seed.

Besides OpenAI's parameters, llama.cpp's samplers, each a function of the logits,
the tokens before the position, the seed and the position (so lossless as the
others):

- DRY ("don't repeat yourself", ``dry_repeats``): a token that would extend a
  repeat of the text's end by at least ``dry_allowed_length`` tokens loses
  ``dry_multiplier * dry_base ** (length - dry_allowed_length)``. A logit penalty,
  applied for greedy requests too.
- When sampling, in this order after temperature (``token_probs``): dynamic
  temperature (the temperature moved within ``+- dynatemp_range`` by the normalised
  entropy of the distribution, to ``dynatemp_exponent``), top-n-sigma (logits more
  than ``n`` standard deviations below the largest dropped), top-k, locally typical
  sampling (``typical_p``), min-p, top-p, then XTC: with probability
  ``xtc_probability`` (a draw of its own per position), every token of probability
  at least ``xtc_threshold`` except the least likely of them is dropped.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from mesh.types import SamplingParams

_GOLDEN = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1
# Mixed into the seed of XTC's draw, so that it is not the token draw's.
_XTC_SALT = 0x58544320
# DRY's penalty grows as base ** length: lengths beyond this are counted as this.
DRY_MAX_LENGTH = 64
# And the penalty is at most this (finite in float32).
DRY_MAX_PENALTY = 1e30
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
# The least temperature logits are divided by: a positive one below it samples as
# this one does (the likeliest token, but for ties within about 1e-5 of it).
MIN_TEMPERATURE = 1e-6


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


def _mix64(value: int) -> int:
    """SplitMix64's finaliser: every bit of ``value`` (64 bits) reaches every bit."""
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def uniform_draw(seed: int, position: int) -> float:
    """The draw in [0, 1) of (request seed, absolute position): every one of the
    seed's 64 bits counts (a negative seed as its two's complement), and nearby
    seeds or positions give unrelated draws. (A torch generator keeps only the low
    32 bits of its seed: seeds that differed above them drew alike.)"""
    value = _mix64((_mix64(seed & _MASK64) + (position + 1) * _GOLDEN) & _MASK64)
    return (value >> 11) * (1.0 / (1 << 53))


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
        # The penalties' window: the last penalty_last_n tokens (0: all).
        first = max(0, len(history) - params.penalty_last_n) if params.penalty_last_n else 0
        if params.repetition_penalty != 1.0:
            seen = torch.unique(ids[first:])
            values = scores[seen]
            penalty = params.repetition_penalty
            scores[seen] = torch.where(values > 0, values / penalty, values * penalty)
        output = ids[max(params.prompt_tokens, first) :]
        if output.numel() and (params.frequency_penalty or params.presence_penalty):
            counts = torch.bincount(output, minlength=vocab).to(torch.float32)
            scores -= params.frequency_penalty * counts
            scores -= params.presence_penalty * (counts > 0).to(torch.float32)
        if params.dry_multiplier:
            for token, length in dry_repeats(history, params).items():
                if token < vocab:
                    exponent = min(length, DRY_MAX_LENGTH) - params.dry_allowed_length
                    penalty = params.dry_multiplier * params.dry_base**exponent
                    # Finite however long: a token the grammar alone allows stays possible.
                    scores[token] -= min(penalty, DRY_MAX_PENALTY)
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


def dry_repeats(history: Sequence[int], params: SamplingParams) -> dict[int, int]:
    """DRY: for each token that would extend a repeat, the length of the longest
    one (at least ``dry_allowed_length``). A repeat is an earlier place in the last
    ``dry_penalty_last_n`` tokens (0: all) where the tokens before it equal the
    text's last ones; it would be extended by the token that followed it there.
    Matching stops at a ``dry_breakers`` token (the text's last tokens are taken
    after the last breaker; none when the text ends with one)."""
    window = params.dry_penalty_last_n
    seq = np.asarray(history[-window:] if window else history, dtype=np.int64)
    size = seq.size
    if size < 2:
        return {}
    breakers = np.asarray(params.dry_breakers, dtype=np.int64)
    # The suffix that may match: the tokens after the last breaker.
    tail = size
    if breakers.size:
        broken = np.flatnonzero(np.isin(seq, breakers))
        tail = size - 1 - int(broken[-1]) if broken.size else size
    tail = min(tail, size - 1, DRY_MAX_LENGTH)
    if tail < 1:
        return {}
    # Places j (the token at j follows the match) whose previous token equals the
    # last one, extended backwards while they keep matching.
    follows = np.arange(1, size)
    follows = follows[seq[follows - 1] == seq[-1]]
    length = 1
    lengths = np.ones(follows.size, dtype=np.int64)
    alive = np.arange(follows.size)  # indices into follows still matching
    while alive.size and length < tail:
        back = follows[alive] - 1 - length
        ok = back >= 0
        ok[ok] = seq[back[ok]] == seq[size - 1 - length]
        alive = alive[ok]
        length += 1
        lengths[alive] = length
    long_enough = lengths >= max(1, params.dry_allowed_length)
    tokens, lengths = seq[follows[long_enough]], lengths[long_enough]
    if not tokens.size:
        return {}
    # Each token's longest: sorted by token, longest first, the first of each token.
    order = np.lexsort((-lengths, tokens))
    tokens, lengths = tokens[order], lengths[order]
    first = np.ones(tokens.size, dtype=bool)
    first[1:] = tokens[1:] != tokens[:-1]
    return dict(zip(tokens[first].tolist(), lengths[first].tolist(), strict=True))


def likeliest(scores: torch.Tensor, k: int) -> list[int]:
    """The indices of the ``k`` largest of the 1-D ``scores``, largest first; of equal
    values the lowest index first, as greedy decoding picks (``torch.topk`` leaves
    the order of ties, and which of them make the cut, unspecified: at a tie, top-k 1
    could keep another token than greedy's, and ``top_logprobs`` list another first)."""
    k = min(k, scores.numel())
    if k <= 0:
        return []
    kth = torch.topk(scores, k).values[-1]
    above = torch.nonzero(scores > kth).flatten()
    ties = torch.nonzero(scores == kth).flatten()[: k - above.numel()]
    chosen = torch.cat((above, ties))
    order = np.lexsort((chosen.numpy(), -scores[chosen].numpy()))
    return chosen[torch.from_numpy(order)].tolist()


def token_probs(logits: torch.Tensor, params: SamplingParams, position: int = 0) -> torch.Tensor:
    """Probabilities over the vocabulary after temperature (dynamic where
    ``dynatemp_range`` is set), top-n-sigma, top-k, typical, min-p, top-p and XTC
    (float32, CPU); ``position`` keys XTC's draw."""
    scores = logits.detach().to(device="cpu", dtype=torch.float32)
    scores = scores / _temperature(scores, params)
    if params.top_n_sigma > 0.0:
        finite = scores[torch.isfinite(scores)]
        if finite.numel() > 1:
            floor = finite.max() - params.top_n_sigma * finite.std(unbiased=False)
            scores = scores.masked_fill(scores < floor, float("-inf"))
    if params.top_k > 0 and params.top_k < scores.numel():
        kept = torch.zeros(scores.numel(), dtype=torch.bool)
        kept[likeliest(scores, params.top_k)] = True
        scores = scores.masked_fill(~kept, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.typical_p < 1.0:
        probs = typical(probs, params.typical_p)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
        probs = probs / probs.sum()
    if params.top_p < 1.0:
        probs = nucleus(probs, params.top_p)
    if params.xtc_probability > 0.0:
        probs = exclude_top_choices(probs, params, position)
    return probs


def _temperature(scores: torch.Tensor, params: SamplingParams) -> float:
    """The temperature for these logits: ``temperature``, or with ``dynatemp_range``
    from ``temperature - range`` (at least 0) to ``temperature + range`` by the
    entropy of ``softmax(scores)`` over the largest it could have (all its
    tokens of nonzero probability alike), to the power ``dynatemp_exponent``."""
    if params.dynatemp_range <= 0.0:
        # A positive temperature under MIN_TEMPERATURE would overflow the scaled
        # logits to infinity (and the softmax to NaN) in float32.
        return max(params.temperature, MIN_TEMPERATURE)
    low = max(0.0, params.temperature - params.dynatemp_range)
    high = params.temperature + params.dynatemp_range
    probs = torch.softmax(scores, dim=-1)
    live = probs > 0
    count = int(live.sum())
    if count < 2:
        return max(low, MIN_TEMPERATURE)
    entropy = float(-(probs[live] * probs[live].log()).sum())
    share = min(1.0, max(0.0, entropy / float(np.log(count))))
    return max(low + (high - low) * share**params.dynatemp_exponent, MIN_TEMPERATURE)


def typical(probs: torch.Tensor, mass: float) -> torch.Tensor:
    """Locally typical sampling: the tokens in order of how far their surprise
    (``-log p``) is from the distribution's entropy, kept until their mass reaches
    ``mass`` (at least one); renormalised."""
    live = probs > 0
    logs = torch.where(live, probs.log(), torch.zeros_like(probs))
    entropy = -(probs * logs).sum()
    distance = torch.where(live, (-logs - entropy).abs(), torch.full_like(probs, float("inf")))
    order = torch.argsort(distance, stable=True)
    ranked = probs[order]
    before = torch.cumsum(ranked, dim=-1) - ranked
    ranked = ranked.masked_fill(before >= mass, 0.0)
    kept = torch.zeros_like(probs).scatter(0, order, ranked)
    return kept / kept.sum()


def exclude_top_choices(probs: torch.Tensor, params: SamplingParams, position: int) -> torch.Tensor:
    """XTC: with probability ``xtc_probability`` (a draw keyed by seed and
    ``position``, apart from the token's), drop every token of probability at least
    ``xtc_threshold`` but the least likely of them, when two or more are; else
    ``probs`` unchanged."""
    if uniform_draw(params.seed ^ _XTC_SALT, position) >= params.xtc_probability:
        return probs
    above = torch.nonzero((probs >= params.xtc_threshold) & (probs > 0)).flatten()
    if above.numel() < 2:
        return probs
    kept = above[torch.argmin(probs[above])]
    dropped = probs.clone()
    dropped[above] = 0.0
    dropped[kept] = probs[kept]
    return dropped / dropped.sum()


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """``probs`` (1-D) kept to its likeliest tokens: in descending order, a token is
    kept while the mass before it is below ``top_p``; renormalised. Exactly the
    result of sorting the whole vocabulary (its prefix sums are the same numbers),
    found by sorting only the tokens above a floor when their mass passes ``top_p``
    (``_likeliest``; a 49,152-token torch sort takes 4.7 ms on one core of the test
    VM, longer than a small model's decode step on a GPU). Of several tokens of
    exactly equal probability at the boundary, the lowest index comes first (stable
    sorts), as greedy decoding picks: ``top_p`` 0 keeps greedy's token alone."""
    ordered = _likeliest(probs, top_p)
    if ordered is None:
        values, order = torch.sort(probs, descending=True, stable=True)
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
        index = index[np.argsort(-array[index], kind="stable")]
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
    return draw_token(token_probs(logits, params, position), params.seed, position)


def draw_token(probs: torch.Tensor, seed: int, position: int) -> int:
    """The token drawn from ``probs`` (1-D, CPU) for absolute ``position`` with the
    request's ``seed``: the same draw for the same (seed, position), never a token of
    probability 0."""
    draw = uniform_draw(seed, position)
    cdf = torch.cumsum(probs.to(torch.float64), dim=-1)
    point = torch.tensor([draw * float(cdf[-1])], dtype=torch.float64)
    index = int(torch.searchsorted(cdf, point, right=True).item())
    index = min(index, probs.numel() - 1)
    while probs[index] == 0.0 and index > 0:
        index -= 1
    return index


def token_logprob(
    logits: torch.Tensor, params: SamplingParams, token: int, history: Sequence[int] = ()
) -> tuple[float, tuple[tuple[int, float], ...]]:
    """``token``'s log-probability under the distribution it was chosen from
    (penalties and biases applied, before temperature and filtering, as OpenAI
    reports them) and the ``params.top_logprobs`` likeliest tokens, best first. A
    token a grammar forbids (masked to -inf) is never among them: fewer come back
    where fewer are allowed."""
    scores = adjust_logits(logits, params, history).detach().to("cpu", torch.float32)
    logprobs = torch.log_softmax(scores, dim=-1)
    top: tuple[tuple[int, float], ...] = ()
    if params.top_logprobs > 0:
        top = tuple(
            (index, value)
            for index in likeliest(logprobs, params.top_logprobs)
            if (value := float(logprobs[index])) != float("-inf")
        )
    return float(logprobs[token]), top
