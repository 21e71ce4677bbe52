"""What may answer a frame in flight, as data, and the pure rule that tells a live
answer from a stale one.

Stage 0 hands a TokenResult to the request waiting on it only when the result
answers the very frame that request sent: the same term (a frame of an older term
may still be in some stage's queue after a failover, e.g. a stage that hung and
woke up), and the position that frame's first emitted token must have. An error
answers the frame when it has the frame's term and a position no later than the
frame's (an earlier prefill chunk of the same session may fail first).
"""

from __future__ import annotations

from dataclasses import dataclass

from mesh.codec import Frame, FrameKind, TokenResult

STALE_REASONS = ("term", "position", "count")


@dataclass(frozen=True)
class Expected:
    """The answer a frame in flight waits for."""

    term: int
    frame_pos: int  # pos_start of the frame sent
    result_pos: int  # position of the first token its result must emit
    max_tokens: int  # tokens a result may emit (1, or draft count + 1 for VERIFY)

    @classmethod
    def for_frame(cls, frame: Frame) -> Expected:
        if frame.kind is FrameKind.VERIFY:
            return cls(frame.term, frame.pos_start, frame.pos_start + 1, len(frame.token_ids))
        return cls(frame.term, frame.pos_start, frame.pos_end, 1)


def stale_reason(result: TokenResult, expected: Expected) -> str | None:
    """None when ``result`` answers the expected frame, else why it does not (one of
    STALE_REASONS)."""
    if result.term != expected.term:
        return "term"
    if result.error is not None:
        return None if result.pos_start <= expected.frame_pos else "position"
    if result.pos_start != expected.result_pos:
        return "position"
    if not 1 <= len(result.token_ids) <= expected.max_tokens:
        return "count"
    return None
