"""validate_frame: a malformed frame is refused whole, a malformed segment alone, each
with a message naming the problem."""

from __future__ import annotations

import pytest
import torch

from mesh.codec import Frame, Segment, SegmentKind, WireDType, frame_to_proto, validate_frame
from mesh.errors import InvalidRequest
from mesh.proto.v1 import common_pb2, data_pb2

HIDDEN = 64
LIMITS = dict(
    hidden_size=HIDDEN,
    allowed_dtypes={WireDType.F32, WireDType.BF16, WireDType.INT8},
    max_frame_bytes=1 << 20,
    max_tokens=32,
)


def segment(tokens: int = 3, kind: SegmentKind = SegmentKind.PREFILL, **fields) -> Segment:
    return Segment(
        request_id=fields.pop("request_id", "req-9"),
        session_id=fields.pop("session_id", "sess-9"),
        kind=kind,
        pos_start=fields.pop("pos_start", 0),
        token_ids=tuple(range(tokens)),
    )


def frame_pb(*segments: Segment, wire: WireDType = WireDType.BF16, hidden=...) -> data_pb2.Frame:
    segments = segments or (segment(),)
    rows = sum(s.token_count for s in segments)
    if hidden is ...:
        hidden = torch.randn(rows, HIDDEN) if rows else None
    return frame_to_proto(Frame(4, 11, segments, hidden=hidden), wire)


def check(frame, expects_hidden: bool = True, **overrides) -> dict:
    return validate_frame(frame, expects_hidden=expects_hidden, **(LIMITS | overrides))


def test_valid_frames_pass() -> None:
    for wire in (WireDType.F32, WireDType.BF16, WireDType.INT8):
        assert check(frame_pb(wire=wire)) == {}
    mixed = (
        segment(5, SegmentKind.VERIFY),
        segment(1, SegmentKind.DECODE, session_id="b"),
        segment(0, SegmentKind.END, session_id="c"),
    )
    assert check(frame_pb(*mixed)) == {}
    stage0 = frame_pb(segment(1, SegmentKind.DECODE), hidden=None)
    assert check(stage0, expects_hidden=False) == {}
    assert check(frame_pb(segment(0, SegmentKind.END), hidden=None)) == {}


def test_a_bad_segment_is_refused_alone() -> None:
    pb = frame_pb(
        segment(2), segment(1, SegmentKind.DECODE, session_id=""), segment(3, session_id="x")
    )
    pb.segments[2].kind = data_pb2.SEGMENT_KIND_UNSPECIFIED
    problems = check(pb)
    assert sorted(problems) == [1, 2]
    assert "request 'req-9'" in problems[1].message and "session_id is empty" in problems[1].message
    assert "segment kind 0 is unset" in problems[2].message


def test_segment_token_rules() -> None:
    pb = frame_pb(segment(2, SegmentKind.DECODE), segment(1, session_id="b"))
    problems = check(pb)
    assert list(problems) == [0] and "DECODE segment holds one token" in problems[0].message
    pb = frame_pb(segment(2), segment(0, SegmentKind.VERIFY, session_id="b"))
    assert "VERIFY segment has no tokens" in check(pb)[1].message
    pb = frame_pb(segment(2))
    pb.segments[0].token_count = 1
    with pytest.raises(InvalidRequest, match=r"does not match \[tokens=1"):
        check(pb)
    pb = frame_pb(segment(2), segment(1, session_id="b"))
    pb.segments[0].token_count, pb.segments[1].token_count = 1, 2
    assert "token_count is 1 but it carries 2 token ids" in check(pb)[0].message
    end = frame_pb(segment(0, SegmentKind.END), hidden=None)
    end.segments[0].token_ids.append(4)
    assert "END segments carry no tokens" in check(end)[0].message


def test_dtype_not_allowed() -> None:
    with pytest.raises(InvalidRequest, match="wire dtype f16 is not allowed.*bf16, f32, int8"):
        check(frame_pb(wire=WireDType.F16))
    pb = frame_pb()
    pb.hidden.dtype = common_pb2.WIRE_DTYPE_UNSPECIFIED
    with pytest.raises(InvalidRequest, match="hidden wire dtype 0 is unset"):
        check(pb)


def test_shape_must_be_rows_by_hidden_size() -> None:
    with pytest.raises(InvalidRequest, match=r"hidden shape \[3, 32\] does not match \[tokens=3"):
        check(frame_pb(hidden=torch.randn(3, 32)))
    two = frame_pb(segment(3), segment(2, session_id="b"), hidden=torch.randn(4, HIDDEN))
    with pytest.raises(InvalidRequest, match=r"hidden shape \[4, 64\] does not match \[tokens=5"):
        check(two)


def test_data_length_must_match_shape() -> None:
    pb = frame_pb()
    pb.hidden.data = pb.hidden.data[:-1]
    with pytest.raises(InvalidRequest, match=r"data is 383 bytes but shape \[3, 64\] in bf16"):
        check(pb)
    q = frame_pb(wire=WireDType.INT8)
    q.hidden.scales = q.hidden.scales[:4]
    with pytest.raises(InvalidRequest, match="scales are 4 bytes .* needs 12"):
        check(q)


def test_frame_limits() -> None:
    pb = frame_pb(segment(8), wire=WireDType.F32)
    with pytest.raises(InvalidRequest, match=r"\d+ bytes exceeds the frame limit of 1000 bytes"):
        check(pb, max_frame_bytes=1000)
    many = frame_pb(segment(20), segment(20, session_id="b"))
    with pytest.raises(InvalidRequest, match="40 tokens exceeds the limit of 32"):
        check(many)
    with pytest.raises(InvalidRequest, match="no segments"):
        check(data_pb2.Frame(term=1, frame_id=2))


def test_hidden_presence_rules() -> None:
    with pytest.raises(InvalidRequest, match="has no hidden tensor"):
        check(frame_pb(hidden=None))
    with pytest.raises(InvalidRequest, match="stage 0 embeds token ids itself"):
        check(frame_pb(), expects_hidden=False)
    ends = frame_pb(segment(0, SegmentKind.END), hidden=torch.zeros(1, HIDDEN))
    with pytest.raises(InvalidRequest, match="no segment has tokens"):
        check(ends)
