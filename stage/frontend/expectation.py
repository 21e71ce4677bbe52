"""What may answer a segment in flight, as data, and the pure rule that tells a live
answer from a stale one.

Stage 0 hands a SegmentResult to the request waiting on it only when the result
answers the very segment that request sent: the same term (a frame of an older term
may still be in some stage's queue after a failover, e.g. a stage that hung and
woke up), the same epoch, and the position that segment's first emitted token must
have. An error answers the segment when it has the segment's term and a position no
later than the segment's (an earlier prefill chunk of the same session may fail
first); a window the last stage dropped unrun, when it has the segment's position.
"""

from __future__ import annotations

from dataclasses import dataclass

from mesh.frames import Segment, SegmentResult

STALE_REASONS = ("term", "epoch", "position", "count")


@dataclass(frozen=True)
class Expected:
    """The answer a segment in flight waits for."""

    term: int
    epoch: int
    segment_pos: int  # pos_start of the segment sent
    result_pos: int  # position of the first token its result must emit
    max_tokens: int  # tokens a result may emit (1, or draft count + 1 for VERIFY)

    @classmethod
    def for_segment(cls, segment: Segment, term: int) -> Expected:
        return cls(
            term,
            segment.epoch,
            segment.pos_start,
            segment.result_pos(),
            segment.max_emitted(),
        )


def stale_reason(result: SegmentResult, term: int, expected: Expected) -> str | None:
    """None when ``result`` (of a frame of ``term``) answers the expected segment, else
    why it does not (one of STALE_REASONS)."""
    if term != expected.term:
        return "term"
    if result.epoch != expected.epoch:
        return "epoch"
    if result.error is not None:
        return None if result.pos_start <= expected.segment_pos else "position"
    if result.dropped:
        # A window the last stage dropped unrun answers at the segment's own start.
        return None if result.pos_start == expected.segment_pos else "position"
    if result.pos_start != expected.result_pos:
        return "position"
    if not 1 <= len(result.token_ids) <= expected.max_tokens:
        return "count"
    return None
