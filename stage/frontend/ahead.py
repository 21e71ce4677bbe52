"""Verify windows drafted ahead (docs/speculation.md, "Pipelined windows"): the
engine core's rules for a request that keeps more than one window in flight.

While window ``w`` of a request waits for its verdict, the core may send ``w + 1``
assuming ``w`` is accepted whole: its proposer continues from ``w``'s draft
tokens, and its first token is the guess of the token ``w`` emits last (its bonus
token), at the position that token will have. On ``w``'s verdict the next window
either survives (every draft kept, the guess right: it becomes the window in
flight) or every window ahead is void: the request's epoch goes up and its next
window starts from the verdict. The last stage drops void windows unrun (it checks
each against the session's latest verdict); their answers carry the old epoch and
are ignored here. Their KV on the other stages is cropped by the next window's
``pos_start``.
"""

from __future__ import annotations

from dataclasses import dataclass

from mesh.frames import Segment, SegmentKind
from mesh.speculative.depth import DepthInputs, choose_depth
from stage.frontend.engine_types import InFlight, Tracked
from stage.frontend.expectation import Expected
from stage.frontend.step_cost import acceptance

# Weight of the newest measurement in the round-trip and step-time averages.
EWMA = 0.3


@dataclass
class AheadCounters:
    """What the engine core counts of windows drafted ahead (for /metrics)."""

    sent: int = 0
    kept: int = 0
    dropped: int = 0
    # Rows of dropped windows: computed (or about to be) for nothing.
    wasted_tokens: int = 0
    # Answers the last stage sent for windows it dropped unrun.
    dropped_by_last_stage: int = 0


def windows(tracked: Tracked) -> list[InFlight]:
    """The request's windows in flight, oldest (the one next answered) first."""
    return ([tracked.in_flight] if tracked.in_flight is not None else []) + tracked.ahead


def may_draft_ahead(tracked: Tracked) -> bool:
    """True when the request could add a window ahead now (depth not counted): a
    frame holds one segment per session, so not in the step that packed its last
    window."""
    flight = tracked.in_flight
    return (
        flight is not None
        and all(f.frame_id for f in windows(tracked))
        and tracked.run.drafter is not None
        and tracked.recover_by is None
        and not tracked.prefilling
        and flight.segment.kind in (SegmentKind.DECODE, SegmentKind.VERIFY)
    )


def through_stop(tokens: list[int], stops: frozenset[int]) -> list[int]:
    """``tokens`` up to and including the first stop token: rows after it could only
    be drafts of text the request never gets."""
    for index, token in enumerate(tokens):
        if token in stops:
            return tokens[: index + 1]
    return tokens


def assumed_tokens(tracked: Tracked) -> list[int]:
    """The tokens the request's windows in flight would commit if every one were
    accepted whole, short of the last window's bonus token (which the next window's
    first token guesses)."""
    assumed: list[int] = []
    for index, flight in enumerate(windows(tracked)):
        tokens = flight.segment.token_ids
        assumed.extend(tokens[1:] if index == 0 else tokens)
    return assumed


def ahead_segment(tracked: Tracked, term: int, window: int, now: float) -> Segment | None:
    """The next window ahead of the request's windows in flight, with ``window``
    drafts after its guessed first token (None when the drafter has nothing)."""
    run = tracked.run
    assumed = assumed_tokens(tracked)
    stops = run.request.stop_token_ids
    if any(token in stops for token in assumed):
        return None  # the windows in flight end the request if accepted whole
    tokens_left = run.tokens_left() - len(assumed) - 1
    window = min(window, tokens_left - 1)
    if window < 0:
        return None
    started = now
    proposal = run.drafter.propose_ahead(assumed, window + 1)  # type: ignore[union-attr]
    proposal = through_stop(proposal, stops)
    if not proposal or proposal[0] in stops:
        return None
    last = windows(tracked)[-1].segment
    segment = Segment(
        request_id=run.request.request_id,
        session_id=run.request.request_id,
        kind=SegmentKind.VERIFY if len(proposal) > 1 else SegmentKind.DECODE,
        pos_start=last.pos_start + last.token_count,
        token_ids=tuple(proposal),
        epoch=tracked.epoch,
        ahead=True,
    )
    flight = InFlight(segment, Expected.for_segment(segment, term), 0, started)
    flight.drafts = list(proposal[1:])
    tracked.ahead.append(flight)
    return segment


def settle(tracked: Tracked, answered: InFlight, accepted: int, counters: AheadCounters) -> None:
    """After the verdict of ``answered`` was committed: the next window ahead becomes
    the one in flight when it survives, else every window ahead is void."""
    if not tracked.ahead:
        return
    run = tracked.run
    following = tracked.ahead[0]
    whole = accepted == len(answered.drafts)
    guessed = following.segment.token_ids[0] == run.tokens[-1]
    if whole:
        tracked.p_guess = average(tracked.p_guess, 1.0 if guessed else 0.0)
    if whole and guessed and following.segment.pos_start == run.position:
        tracked.in_flight = tracked.ahead.pop(0)
        counters.kept += 1
        return
    drop_ahead(tracked, counters)


def end_ahead(tracked: Tracked, counters: AheadCounters) -> None:
    """The request ended (its last token, a stop string, its client gone) with windows
    ahead in flight: their rows were computed for nothing (counted as wasted, for the
    mesh and the request, not as refuted)."""
    wasted = sum(f.segment.token_count for f in tracked.ahead)
    counters.wasted_tokens += wasted
    tracked.run.ahead_wasted += wasted
    tracked.ahead.clear()


def drop_ahead(tracked: Tracked, counters: AheadCounters) -> None:
    """Void every window ahead: answers of the old epoch are ignored from now on."""
    if not tracked.ahead:
        return
    wasted = sum(f.segment.token_count for f in tracked.ahead)
    counters.dropped += len(tracked.ahead)
    counters.wasted_tokens += wasted
    tracked.run.ahead_dropped += len(tracked.ahead)
    tracked.run.ahead_wasted += wasted
    tracked.ahead.clear()
    tracked.epoch += 1


def pick_depth(tracked: Tracked, window: int, step_s: float, max_depth: int) -> int:
    """The depth for the request's next window (docs: the cost rule in
    mesh/speculative/depth.py) from its measured round trip, acceptance and the
    measured survival of windows drafted ahead."""
    telemetry = tracked.run.telemetry
    if telemetry is None or max_depth <= 1 or tracked.round_s <= 0.0:
        return 1
    alpha = acceptance(telemetry.drafted, telemetry.accepted)
    survival = None
    if tracked.p_whole >= 0.0:
        guess = tracked.p_guess if tracked.p_guess >= 0.0 else alpha
        survival = tracked.p_whole * guess
    inputs = DepthInputs(
        acceptance=alpha,
        window=window,
        round_s=tracked.round_s,
        step_s=step_s,
        survival=survival,
    )
    return choose_depth(inputs, max_depth)


def observe_round(tracked: Tracked, round_s: float, drafts: int, accepted: int) -> None:
    """Fold a decode or verify window's send-to-verdict time, and whether it was
    accepted whole, into the request's averages."""
    if round_s > 0.0:
        tracked.round_s = average(tracked.round_s, round_s)
    if drafts:
        tracked.p_whole = average(tracked.p_whole, 1.0 if accepted == drafts else 0.0)


def average(current: float, value: float) -> float:
    """Exponentially weighted average; a negative ``current`` means none yet."""
    return value if current < 0.0 else (1.0 - EWMA) * current + EWMA * value
