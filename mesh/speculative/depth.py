"""How many verify windows of one request to keep in flight: a pure rule over what
stage 0 measures (docs/speculation.md, "Pipelined windows").

A window of ``k`` drafts emits on average ``E = (1 - a^(k+1)) / (1 - a)`` tokens
(``a``: the request's acceptance per draft token). A window drafted ahead assumes
that the window before it is accepted whole *and* that its first token guesses the
token the window before emits last, so it survives with probability about
``q = a^(k+1)`` when tokens are accepted independently. Edits are not like that:
long runs of copied text are accepted whole and the misses come together, so stage
0 measures ``q`` per request instead (the recent share of windows accepted whole,
times the recent share of guessed bonus tokens) and uses ``a^(k+1)`` only before it
has seen any. Windows are verified one round trip ``R`` after they are sent; with
``D`` windows in flight they leave stage 0 every ``max(T, R / D)`` (``T``: the time
the slowest stage spends on one frame, which bounds how fast frames can follow
each other). A chain of windows runs until the first one that does not survive;
the next window then starts from the verdict, one round trip later. Counting
tokens and time over such chains gives

    rate(D) = E / (R * (1 - q) + max(T, R / D) * q)

which is ``E / R`` for ``D = 1`` (serial windows) and grows with ``D`` until
``R / D`` reaches ``T``. A deeper window is chosen only when its predicted rate
beats the shallower one by ``margin``: windows that do not survive cost stage time
that other requests could use, and acceptance measured on serial windows
overstates what survives deep.
"""

from __future__ import annotations

from dataclasses import dataclass

from mesh.speculative.policy import expected_tokens


@dataclass(frozen=True)
class DepthInputs:
    """``acceptance``: per draft token; ``window``: drafts per window; ``round_s``:
    send to verdict of one window; ``step_s``: the slowest stage's time per frame;
    ``survival``: the measured chance that a window drafted ahead survives (None:
    derive it from ``acceptance`` as if tokens were accepted independently)."""

    acceptance: float
    window: int
    round_s: float
    step_s: float
    survival: float | None = None


def survival(acceptance: float, window: int) -> float:
    """Chance that a window drafted ahead of one with ``window`` drafts survives: all
    of that window's drafts kept and its last token guessed."""
    return min(max(acceptance, 0.0), 1.0) ** (window + 1)


def pipelined_rate(inputs: DepthInputs, depth: int) -> float:
    """Predicted committed tokens per second with ``depth`` windows in flight."""
    rate_tokens = expected_tokens(min(max(inputs.acceptance, 0.0), 1.0), inputs.window)
    if depth <= 1 or inputs.round_s <= 0.0:
        return rate_tokens / inputs.round_s if inputs.round_s > 0.0 else 0.0
    q = inputs.survival
    if q is None:
        q = survival(inputs.acceptance, inputs.window)
    spacing = max(inputs.step_s, inputs.round_s / depth)
    return rate_tokens / (inputs.round_s * (1.0 - q) + spacing * q)


def choose_depth(inputs: DepthInputs, max_depth: int, margin: float = 0.05) -> int:
    """The depth (1 .. ``max_depth``) with the best predicted rate, going deeper only
    while each step deeper beats the last by ``margin``; 1 until a round trip has
    been measured."""
    if max_depth <= 1 or inputs.round_s <= 0.0 or inputs.window < 0:
        return 1
    depth, best = 1, pipelined_rate(inputs, 1)
    for candidate in range(2, max_depth + 1):
        rate = pipelined_rate(inputs, candidate)
        if rate <= best * (1.0 + margin):
            break
        depth, best = candidate, rate
    return depth


@dataclass(frozen=True)
class Plan:
    """Drafts per window and windows in flight for a request's next window."""

    window: int
    depth: int


@dataclass(frozen=True)
class Measured:
    """What stage 0 measured of one request and of the pipeline, for ``choose_plan``.

    ``acceptance``: per draft token; ``whole``: recent share of its windows accepted
    whole (None: none seen), at ``measured_window`` drafts per window on average;
    ``guess``: recent share of bonus tokens a window ahead guessed (negative: none
    seen; the per-token acceptance stands in); ``round_s``: its
    send-to-verdict time; ``step_s``: the slowest stage's time per frame;
    ``step_model``: ``(fixed_s, per_row_s)``, the fitted cost of a frame on the
    slowest stage by its rows (None until fitted); ``stages``: pipeline length."""

    acceptance: float
    whole: float | None
    measured_window: float
    guess: float
    round_s: float
    step_s: float
    step_model: tuple[float, float] | None
    stages: int


def choose_plan(measured: Measured, window: int, max_depth: int, margin: float = 0.05) -> Plan:
    """The window (at most the policy's ``window``) and depth with the best predicted
    rate. Depth 1 keeps the policy's window (serial windows, as without this rule),
    and anything deeper must beat it by ``margin``. Smaller windows survive more
    often and leave the stages sooner, so with a fitted step cost every window up to
    the policy's is weighed at every depth; without one only the depth is chosen.

    Acceptance is taken per token from the measured share of whole windows
    (``whole ** (1 / measured_window)``) when there is one, else ``acceptance``."""
    per_token = measured.acceptance
    if measured.whole is not None and measured.measured_window > 0.0:
        per_token = max(measured.whole, 1e-6) ** (1.0 / measured.measured_window)

    guess = measured.guess if measured.guess >= 0.0 else per_token

    def inputs_for(k: int, round_s: float, step_s: float) -> DepthInputs:
        return DepthInputs(per_token, k, round_s, step_s, per_token**k * guess)

    serial = inputs_for(window, measured.round_s, measured.step_s)
    if max_depth <= 1 or measured.round_s <= 0.0 or window < 0:
        return Plan(window, 1)
    best_rate, plan = pipelined_rate(serial, 1) * (1.0 + margin), Plan(window, 1)
    candidates = [(window, serial)]
    model = measured.step_model
    if model is not None and measured.measured_window > 0.0:
        fixed_s, per_row_s = model
        measured_step = fixed_s + per_row_s * (measured.measured_window + 1.0)
        hops_s = max(0.0, measured.round_s - measured.stages * measured_step)
        for k in range(0, window):
            step_s = fixed_s + per_row_s * (k + 1)
            candidates.append((k, inputs_for(k, hops_s + measured.stages * step_s, step_s)))
    for k, inputs in candidates:
        for depth in range(2, max_depth + 1):
            rate = pipelined_rate(inputs, depth)
            if rate > best_rate:
                best_rate, plan = rate, Plan(k, depth)
    return plan
