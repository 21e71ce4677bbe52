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
