"""validate_frame: every malformed frame is refused with a message naming the problem."""

from __future__ import annotations

import pytest
import torch

from mesh.codec import Frame, FrameKind, WireDType, validate_frame
from mesh.errors import InvalidRequest
from mesh.proto.v1 import common_pb2, data_pb2

HIDDEN = 64
LIMITS = dict(
    hidden_size=HIDDEN,
    allowed_dtypes={WireDType.F32, WireDType.BF16, WireDType.INT8},
    max_frame_bytes=1 << 20,
    max_tokens=32,
)


def frame_pb(tokens: int = 3, wire: WireDType = WireDType.BF16, **fields) -> data_pb2.Frame:
    frame = Frame(
        request_id=fields.pop("request_id", "req-9"),
        session_id=fields.pop("session_id", "sess-9"),
        kind=fields.pop("kind", FrameKind.PREFILL),
        pos_start=0,
        token_ids=tuple(range(tokens)),
        hidden=fields.pop("hidden", torch.randn(tokens, HIDDEN)),
    )
    return frame.to_proto(wire)


def check(frame, expects_hidden: bool = True, **overrides) -> None:
    validate_frame(frame, expects_hidden=expects_hidden, **(LIMITS | overrides))


def test_valid_frames_pass() -> None:
    for wire in (WireDType.F32, WireDType.BF16, WireDType.INT8):
        check(frame_pb(wire=wire))
    check(frame_pb(kind=FrameKind.VERIFY, tokens=5))
    stage0 = Frame("r", "s", FrameKind.DECODE, 4, (17,)).to_proto()
    check(stage0, expects_hidden=False)
    check(Frame("r", "s", FrameKind.TRIM, 4).to_proto())
    check(Frame("r", "s", FrameKind.END, 0).to_proto(), expects_hidden=False)
    check(Frame("r", "s", FrameKind.DECODE, 4, (3,), hidden=torch.zeros(1, HIDDEN)))


def test_missing_session_id() -> None:
    with pytest.raises(InvalidRequest, match="request 'req-9' .*session_id is empty"):
        check(frame_pb(session_id=""))


def test_unset_kind() -> None:
    pb = frame_pb()
    pb.kind = data_pb2.FRAME_KIND_UNSPECIFIED
    with pytest.raises(InvalidRequest, match="frame kind 0 is unset"):
        check(pb)


def test_dtype_not_allowed() -> None:
    with pytest.raises(InvalidRequest, match="wire dtype f16 is not allowed.*bf16, f32, int8"):
        check(frame_pb(wire=WireDType.F16))
    pb = frame_pb()
    pb.hidden.dtype = common_pb2.WIRE_DTYPE_UNSPECIFIED
    with pytest.raises(InvalidRequest, match="hidden wire dtype 0 is unset"):
        check(pb)


def test_shape_must_be_tokens_by_hidden_size() -> None:
    with pytest.raises(InvalidRequest, match=r"hidden shape \[3, 32\] does not match \[tokens=3"):
        check(frame_pb(hidden=torch.randn(3, 32)))
    with pytest.raises(InvalidRequest, match=r"hidden shape \[2, 64\] does not match \[tokens=3"):
        check(frame_pb(hidden=torch.randn(2, HIDDEN)))
    decoded = Frame("r", "s", FrameKind.DECODE, 0, (1,), hidden=torch.zeros(1, 32))
    with pytest.raises(InvalidRequest, match=r"\[1, 32\] does not match"):
        check(decoded)


def test_data_length_must_match_shape() -> None:
    pb = frame_pb()
    pb.hidden.data = pb.hidden.data[:-1]
    with pytest.raises(InvalidRequest, match=r"data is 383 bytes but shape \[3, 64\] in bf16"):
        check(pb)
    q = frame_pb(wire=WireDType.INT8)
    q.hidden.scales = q.hidden.scales[:4]
    with pytest.raises(InvalidRequest, match="scales are 4 bytes .* needs 12"):
        check(q)


def test_frame_size_limit() -> None:
    pb = frame_pb(tokens=8, wire=WireDType.F32)
    with pytest.raises(InvalidRequest, match=r"\d+ bytes exceeds the frame limit of 1000 bytes"):
        check(pb, max_frame_bytes=1000)


def test_token_count_rules() -> None:
    with pytest.raises(InvalidRequest, match="PREFILL frame has no token_ids"):
        check(frame_pb(tokens=0, hidden=torch.randn(0, HIDDEN)))
    with pytest.raises(InvalidRequest, match="VERIFY frame has no token_ids"):
        check(Frame("r", "s", FrameKind.VERIFY, 3).to_proto(), expects_hidden=False)
    with pytest.raises(InvalidRequest, match="40 tokens exceeds the limit of 32"):
        check(frame_pb(tokens=40))


def test_hidden_presence_rules() -> None:
    with pytest.raises(InvalidRequest, match="has no hidden tensor"):
        check(Frame("r", "s", FrameKind.DECODE, 3, (1,)).to_proto())
    with pytest.raises(InvalidRequest, match="stage 0 embeds token ids itself"):
        check(frame_pb(), expects_hidden=False)
    trim = Frame("r", "s", FrameKind.TRIM, 3, hidden=torch.zeros(1, HIDDEN)).to_proto()
    with pytest.raises(InvalidRequest, match="TRIM frames carry no activations"):
        check(trim)
