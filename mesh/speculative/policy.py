"""Window policies: how many draft tokens a request sends in its next verify round.

One policy object per request. Per round the caller asks ``plan_window(policy,
RoundContext(...))`` (the policy's choice, capped by the request's share of the
step's draft budget and by its remaining token budget), proposes that many tokens, sends the window,
and reports back with ``policy.observe(proposed, accepted, round_time_s,
draft_time_s)``. ``round_time_s`` is the verify round alone (send to tokens back,
the pipeline round trip included); ``draft_time_s`` is the time spent proposing.

- ``FixedWindow(W)``: always W.
- ``AdaptiveWindow(initial, min, max)``: grows by half after a fully accepted
  window, drops to ``accepted + 1`` after a rejection.
- ``CostAwareWindow(initial, min, max)``: picks the k in {0} + [min, max] that
  maximises expected committed tokens per second (see ``best_window``); k = 0 means
  plain decoding. While off it re-probes with ``initial`` tokens now and then.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from mesh.config import WindowPolicySpec
from mesh.errors import InvalidRequest


@dataclass(frozen=True)
class RoundContext:
    """What the caller knows before a round.

    ``tokens_left``: tokens the request may still emit (min of max_tokens left and
    context left); None = unbounded. ``draft_share``: draft tokens this request may
    add to the step it goes into (stage 0's engine core shares a per-step draft
    budget among the requests decoding in that step); None = no cap.
    ``draft_cost_per_token_s``: the drafter's ``cost_per_token_s``.
    """

    tokens_left: int | None = None
    draft_share: int | None = None
    draft_cost_per_token_s: float | None = None


def _check_bounds(initial: int, min_window: int, max_window: int) -> None:
    if not 0 <= min_window <= initial <= max_window or max_window < 1:
        raise InvalidRequest(
            f"window sizes must satisfy 0 <= min_window ({min_window}) <= initial_window "
            f"({initial}) <= max_window ({max_window}) and max_window >= 1"
        )


class WindowPolicy(ABC):
    """Decides the draft window of a request's next round from what it observed."""

    name = "policy"

    def __init__(self, initial: int, min_window: int, max_window: int) -> None:
        _check_bounds(initial, min_window, max_window)
        self.initial = initial
        self.min_window = min_window
        self.max_window = max_window

    @abstractmethod
    def next_window(self, state: RoundContext) -> int:
        """Draft tokens to propose for the next round (0 = plain decoding)."""

    def observe(
        self, proposed: int, accepted: int, round_time_s: float, draft_time_s: float
    ) -> None:
        """Report a finished round: draft tokens sent, kept, and what it cost."""
        return None


def plan_window(policy: WindowPolicy, state: RoundContext) -> int:
    """The policy's window, capped by the step's draft share and by ``tokens_left - 1``
    (a round emits at most window + 1 tokens)."""
    window = policy.next_window(state)
    if state.draft_share is not None:
        window = min(window, state.draft_share)
    if state.tokens_left is not None:
        window = min(window, state.tokens_left - 1)
    return max(0, window)


class FixedWindow(WindowPolicy):
    name = "fixed"

    def __init__(self, window: int) -> None:
        super().__init__(window, window, window)

    def next_window(self, state: RoundContext) -> int:
        return self.initial


class AdaptiveWindow(WindowPolicy):
    name = "adaptive"

    def __init__(self, initial: int = 4, min_window: int = 1, max_window: int = 16) -> None:
        super().__init__(initial, min_window, max_window)
        self.window = initial

    def next_window(self, state: RoundContext) -> int:
        return self.window

    def observe(
        self, proposed: int, accepted: int, round_time_s: float, draft_time_s: float
    ) -> None:
        if proposed <= 0:
            return
        if accepted >= proposed:
            if proposed >= self.window:
                self.window = min(self.max_window, self.window + max(1, self.window // 2))
        else:
            self.window = min(self.max_window, max(self.min_window, accepted + 1))


def expected_tokens(alpha: float, window: int) -> float:
    """Expected tokens committed by a round of ``window`` drafts when each draft token
    is accepted with probability ``alpha`` (until the first rejection), counting the
    target's own token: ``(1 - alpha**(k+1)) / (1 - alpha)``."""
    if alpha >= 1.0:
        return float(window + 1)
    return (1.0 - alpha ** (window + 1)) / (1.0 - alpha)


def best_window(
    alpha: float,
    base_s: float,
    per_token_s: float,
    draft_cost_per_token_s: float,
    min_window: int,
    max_window: int,
    margin: float = 0.0,
) -> int:
    """The k in {0} + [min_window, max_window] maximising tokens per second
    ``E(k) / (base_s + per_token_s*k + draft_cost_per_token_s*k)``. A k > 0 must beat
    plain decoding (k = 0) by the relative ``margin``, else 0."""
    plain = 1.0 / max(base_s, 1e-9)
    best, best_rate = 0, plain * (1.0 + margin)
    for k in range(max(1, min_window), max_window + 1):
        cost = base_s + (per_token_s + draft_cost_per_token_s) * k
        rate = expected_tokens(alpha, k) / max(cost, 1e-9)
        if rate > best_rate:
            best, best_rate = k, rate
    return best


class CostAwareWindow(WindowPolicy):
    """Chooses the window from the measured acceptance rate and round cost.

    Acceptance: ``alpha`` = decayed accepted draft tokens / (accepted + rejections),
    the estimate of a geometric per-token acceptance (a fully accepted window counts
    no rejection), with a weak prior. Round time: a decayed least-squares fit of
    ``t_round(k) = base + per_token * k`` over measured rounds, regularised towards
    ``per_token = per_token_prior * base`` while k has not varied enough.
    """

    name = "cost"

    def __init__(
        self,
        initial: int = 4,
        min_window: int = 1,
        max_window: int = 16,
        *,
        decay: float = 0.95,
        prior_alpha: float = 0.5,
        prior_weight: float = 1.0,
        per_token_prior: float = 0.05,
        ridge: float = 4.0,
        margin: float = 0.03,
        probe_interval: int = 16,
        max_probe_interval: int = 128,
    ) -> None:
        super().__init__(initial, max(1, min_window), max_window)
        self.decay, self.margin = decay, margin
        self.prior_alpha, self.prior_weight = prior_alpha, prior_weight
        self.per_token_prior, self.ridge = per_token_prior, ridge
        self.probe_interval_min, self.max_probe_interval = probe_interval, max_probe_interval
        self.probe_interval = probe_interval
        self.off_rounds = 0
        self._accepted = 0.0
        self._rejected = 0.0
        self._fit = [0.0] * 5  # decayed sums of 1, k, t, k*k, k*t
        self._draft_time_s = 0.0
        self._draft_tokens = 0.0

    @property
    def alpha(self) -> float:
        """Estimated per-token acceptance probability."""
        prior = self.prior_alpha * self.prior_weight
        return (self._accepted + prior) / (self._accepted + self._rejected + self.prior_weight)

    def round_time_model(self) -> tuple[float, float] | None:
        """Fitted ``(base_s, per_token_s)``, or None before any round was measured."""
        w, sk, st, skk, skt = self._fit
        if w <= 0.0:
            return None
        mean_k, mean_t = sk / w, st / w
        prior = self.per_token_prior * mean_t / (1.0 + self.per_token_prior * mean_k)
        var_k, cov = skk / w - mean_k**2, skt / w - mean_k * mean_t
        slope = max(0.0, (w * cov + self.ridge * prior) / (w * max(var_k, 0.0) + self.ridge))
        return max(mean_t - slope * mean_k, 1e-9), slope

    def draft_cost(self, state: RoundContext) -> float:
        if self._draft_tokens > 0.0:
            return self._draft_time_s / self._draft_tokens
        return state.draft_cost_per_token_s or 0.0

    def next_window(self, state: RoundContext) -> int:
        model = self.round_time_model()
        if model is None:
            return self.initial
        base, per_token = model
        window = best_window(
            self.alpha, base, per_token, self.draft_cost(state),
            self.min_window, self.max_window, self.margin,
        )  # fmt: skip
        if window > 0:
            self.off_rounds = 0
            self.probe_interval = self.probe_interval_min
            return window
        self.off_rounds += 1
        if self.off_rounds >= self.probe_interval:
            self.off_rounds = 0
            self.probe_interval = min(self.max_probe_interval, self.probe_interval * 2)
            return self.initial
        return 0

    def observe(
        self, proposed: int, accepted: int, round_time_s: float, draft_time_s: float
    ) -> None:
        if proposed > 0:
            self._accepted = self.decay * self._accepted + accepted
            self._rejected = self.decay * self._rejected + (1.0 if accepted < proposed else 0.0)
            self._draft_time_s = self.decay * self._draft_time_s + max(draft_time_s, 0.0)
            self._draft_tokens = self.decay * self._draft_tokens + proposed
        if round_time_s > 0.0:
            k, t = float(proposed), float(round_time_s)
            for i, value in enumerate((1.0, k, t, k * k, k * t)):
                self._fit[i] = self.decay * self._fit[i] + value


def make_policy(spec: WindowPolicySpec) -> WindowPolicy:
    """A fresh per-request policy from the resolved config."""
    if spec.default == "fixed":
        return FixedWindow(spec.initial_window)
    if spec.default == "adaptive":
        return AdaptiveWindow(spec.initial_window, spec.min_window, spec.max_window)
    if spec.default == "cost":
        return CostAwareWindow(spec.initial_window, spec.min_window, spec.max_window)
    raise InvalidRequest(
        f"window_policy.default must be fixed, adaptive or cost; got {spec.default!r}"
    )
