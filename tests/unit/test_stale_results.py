"""Stage 0 takes a result only when it answers the segment in flight: same term and
epoch, the position that segment's first token must have, no more tokens than it can
emit."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mesh.frames import ErrorInfo, Segment, SegmentKind, SegmentResult
from stage.frontend.expectation import Expected
from stage.frontend.expectation import stale_reason as reason_of


def frame(kind: SegmentKind, pos: int, tokens: tuple[int, ...], term: int = 3, epoch: int = 0):
    return Segment("r", "r", kind, pos, token_ids=tokens, epoch=epoch), term


def result(pos: int, tokens: tuple[int, ...] = (5,), term: int = 3, error: bool = False):
    info = ErrorInfo(code="UNAVAILABLE", message="gone", stage_index=1) if error else None
    return SegmentResult("r", "r", pos, () if error else tokens, error=info), term


def for_frame(sent) -> Expected:
    segment, term = sent
    return Expected.for_segment(segment, term)


def stale_reason(answer: tuple[SegmentResult, int], expected: Expected) -> str | None:
    """The rule applied to a (result, term of the frame it answers) pair."""
    return reason_of(*answer, expected)


@pytest.mark.parametrize(
    ("sent", "first_token_pos", "max_tokens"),
    [
        (frame(SegmentKind.PREFILL, 0, (1, 2, 3, 4)), 4, 1),
        (frame(SegmentKind.PREFILL, 512, (9, 9)), 514, 1),
        (frame(SegmentKind.DECODE, 10, (7,)), 11, 1),
        (frame(SegmentKind.VERIFY, 10, (7, 8, 9, 10)), 11, 4),
    ],
)
def test_expected_answer_of_each_frame_kind(sent, first_token_pos, max_tokens) -> None:
    expected = for_frame(sent)
    assert (expected.result_pos, expected.max_tokens, expected.term) == (
        first_token_pos,
        max_tokens,
        3,
    )
    assert stale_reason(result(first_token_pos), expected) is None


def test_a_result_of_an_older_term_at_the_right_position_is_stale() -> None:
    # The hung-stage case: a woken stage returns its old-term token for the very
    # position the recovered request now waits for.
    expected = for_frame(frame(SegmentKind.DECODE, 10, (7,), term=4))
    assert stale_reason(result(11, term=3), expected) == "term"
    assert stale_reason(result(11, term=5), expected) == "term"


def test_a_result_for_another_position_is_stale() -> None:
    expected = for_frame(frame(SegmentKind.DECODE, 10, (7,)))
    assert stale_reason(result(10), expected) == "position"
    assert stale_reason(result(12), expected) == "position"


def test_a_result_with_too_many_or_no_tokens_is_refused() -> None:
    verify = for_frame(frame(SegmentKind.VERIFY, 10, (7, 8, 9)))
    assert stale_reason(result(11, (1, 2, 3)), verify) is None
    assert stale_reason(result(11, (1, 2, 3, 4)), verify) == "count"
    assert stale_reason(result(11, ()), verify) == "count"


def test_errors_answer_the_frame_or_an_earlier_one_of_its_term_only() -> None:
    expected = for_frame(frame(SegmentKind.PREFILL, 512, (9, 9)))
    # An earlier prefill chunk of the same session failed: the request fails.
    assert stale_reason(result(0, error=True), expected) is None
    assert stale_reason(result(512, error=True), expected) is None
    # An error of an older term never fails a request of a newer term.
    assert stale_reason(result(512, error=True, term=2), expected) == "term"
    assert stale_reason(result(600, error=True), expected) == "position"


def test_a_result_of_an_older_epoch_is_stale() -> None:
    expected = for_frame(frame(SegmentKind.DECODE, 10, (7,), epoch=2))
    answer, term = result(11)
    assert reason_of(answer, term, expected) == "epoch"


def test_a_window_the_last_stage_dropped_answers_at_the_window_s_start() -> None:
    """A dropped window carries no token and the window's own start: it answers the
    window (stage 0 then drafts again from its committed tokens) instead of being
    taken for a result at the wrong position."""
    window = Segment("r", "r", SegmentKind.VERIFY, 10, token_ids=(1, 2, 3), epoch=2)
    expected = Expected.for_segment(window, 4)
    dropped = SegmentResult("r", "r", 10, dropped=True, epoch=2)
    assert reason_of(dropped, 4, expected) is None
    assert reason_of(replace(dropped, pos_start=11), 4, expected) == "position"
    assert reason_of(replace(dropped, epoch=1), 4, expected) == "epoch"
