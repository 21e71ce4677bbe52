"""Wire codec: tensors, data-plane messages and frame validation."""

from __future__ import annotations

import pytest
import torch

from mesh import codec
from mesh.codec import (
    ErrorInfo,
    Frame,
    FrameAck,
    FrameResult,
    Segment,
    SegmentKind,
    SegmentResult,
    StageTiming,
    WireDType,
    ack_from_proto,
    ack_to_proto,
    bytes_per_token,
    decode_tensor,
    encode_tensor,
    error_from_proto,
    error_to_proto,
    frame_from_proto,
    frame_to_proto,
    result_from_proto,
    result_to_proto,
    sampling_from_proto,
    timing_from_proto,
    timing_to_proto,
)
from mesh.errors import (
    CapacityExceeded,
    Fatal,
    InvalidRequest,
    StaleTerm,
    Unavailable,
)
from mesh.proto.v1 import common_pb2, coordinator_pb2, data_pb2, stage_pb2
from mesh.types import SamplingParams


def roundtrip(message, **to_proto_kwargs):
    """dataclass -> proto -> bytes -> proto -> dataclass."""
    pb = message.to_proto(**to_proto_kwargs)
    parsed = type(pb).FromString(pb.SerializeToString())
    return type(message).from_proto(parsed)


# ----------------------------------------------------------------------- tensors


@pytest.mark.parametrize("shape", [(1, 576), (7, 64), (2, 3, 8)])
def test_f32_roundtrip_is_exact(shape: tuple[int, ...]) -> None:
    x = torch.randn(shape) * 10
    y = decode_tensor(encode_tensor(x, WireDType.F32))
    assert y.dtype == torch.float32 and y.shape == x.shape
    assert torch.equal(x, y)


@pytest.mark.parametrize(("wire", "rel"), [(WireDType.F16, 2**-11), (WireDType.BF16, 2**-8)])
def test_half_precision_roundtrip_within_rounding(wire: WireDType, rel: float) -> None:
    torch.manual_seed(0)
    x = torch.randn(5, 576) * torch.logspace(-3, 3, 576)
    y = decode_tensor(encode_tensor(x, wire))
    bound = x.abs() * rel + 2**-24
    assert bool(((y - x).abs() <= bound).all())
    # Not exact: the test would be meaningless if the wire kept float32.
    assert not torch.equal(x, y)


def test_int8_roundtrip_within_half_a_step_per_row() -> None:
    torch.manual_seed(1)
    x = torch.randn(9, 576) * torch.tensor([0.01, 1, 100, 3, 5, 7, 0.5, 2, 1e4]).unsqueeze(1)
    pb = encode_tensor(x, "int8")
    y = decode_tensor(pb)
    scales = torch.frombuffer(bytearray(pb.scales), dtype=torch.float32)
    assert scales.shape == (9,)
    assert torch.allclose(scales, x.abs().amax(dim=1) / 127)
    error = (y - x).abs()
    assert bool((error <= scales.unsqueeze(1) * (0.5 + 1e-5)).all())
    # The largest value of each row is carried exactly (up to float rounding).
    assert torch.allclose(y.abs().amax(dim=1), x.abs().amax(dim=1), rtol=1e-6)


def test_int8_zero_rows_and_empty_tensors() -> None:
    x = torch.zeros(2, 16)
    x[1] = torch.linspace(-1, 1, 16)
    y = decode_tensor(encode_tensor(x, WireDType.INT8))
    assert torch.equal(y[0], torch.zeros(16))
    for wire in WireDType:
        empty = decode_tensor(encode_tensor(torch.empty(0, 576), wire))
        assert empty.shape == (0, 576)


def test_int8_refuses_non_finite_activations() -> None:
    x = torch.ones(2, 8)
    x[1, 3] = float("nan")
    with pytest.raises(Fatal, match="inf or NaN"):
        encode_tensor(x, WireDType.INT8)


def test_encode_accepts_views_grads_and_other_dtypes() -> None:
    base = torch.randn(64, 4, requires_grad=True)
    view = base.t()  # non-contiguous [4, 64]
    for wire in WireDType:
        y = decode_tensor(encode_tensor(view, wire))
        assert y.shape == (4, 64)
    bf = torch.randn(3, 32).to(torch.bfloat16)
    out = decode_tensor(encode_tensor(bf, WireDType.BF16), out_dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16 and torch.equal(out, bf)
    with pytest.raises(InvalidRequest, match="0-d"):
        encode_tensor(torch.tensor(1.0), WireDType.F32)


def test_decoded_tensor_is_writable_and_independent_of_the_message() -> None:
    pb = encode_tensor(torch.ones(2, 4), WireDType.F32)
    y = decode_tensor(pb)
    y.add_(1)
    assert torch.equal(decode_tensor(pb), torch.ones(2, 4))


def test_decode_rejects_inconsistent_payloads() -> None:
    pb = encode_tensor(torch.ones(2, 4), WireDType.F16)
    truncated = common_pb2.Tensor(dtype=pb.dtype, shape=pb.shape, data=pb.data[:-2])
    with pytest.raises(InvalidRequest, match="14 bytes but shape \\[2, 4\\] in f16 needs 16"):
        decode_tensor(truncated)
    q = encode_tensor(torch.ones(2, 4), WireDType.INT8)
    no_scales = common_pb2.Tensor(dtype=q.dtype, shape=q.shape, data=q.data)
    with pytest.raises(InvalidRequest, match="scales are 0 bytes"):
        decode_tensor(no_scales)
    with pytest.raises(InvalidRequest, match="unset or unknown"):
        decode_tensor(common_pb2.Tensor(shape=[1], data=b"\0\0\0\0"))


def test_bytes_per_token_matches_encoded_size() -> None:
    assert {w.value: bytes_per_token(576, w) for w in WireDType} == {
        "f32": 2304,
        "f16": 1152,
        "bf16": 1152,
        "int8": 580,
    }
    for wire in WireDType:
        pb = encode_tensor(torch.randn(5, 576), wire)
        assert len(pb.data) + len(pb.scales) == 5 * bytes_per_token(576, wire)


def test_wire_dtype_parse_and_proto() -> None:
    assert WireDType.parse("bf16") is WireDType.BF16
    assert WireDType.parse(" Float16 ") is WireDType.F16
    assert WireDType.parse(WireDType.INT8) is WireDType.INT8
    with pytest.raises(InvalidRequest, match="unknown wire dtype 'fp8'; use one of: f32"):
        WireDType.parse("fp8")
    for wire in WireDType:
        assert WireDType.from_proto(wire.to_proto()) is wire
    with pytest.raises(InvalidRequest):
        WireDType.from_proto(common_pb2.WIRE_DTYPE_UNSPECIFIED)


# -------------------------------------------------------------------- data plane


def wire_roundtrip(value, encode, decode, **kwargs):
    pb = encode(value, **kwargs)
    return decode(type(pb).FromString(pb.SerializeToString()))


def sample_frame(hidden: torch.Tensor | None) -> Frame:
    params = SamplingParams(
        temperature=0.7, top_p=0.9, top_k=40, seed=2**64 - 1, grammar='{"type":"json_object"}'
    )
    return Frame(
        term=3,
        frame_id=17,
        segments=(
            Segment("req-1", "sess-1", SegmentKind.VERIFY, 41, (7, 8, 49151), epoch=2),
            Segment("req-2", "sess-2", SegmentKind.END, 0),
            Segment("req-3", "sess-3", SegmentKind.PREFILL, 0, (5, 6), params, sample=False),
            Segment("req-4", "sess-4", SegmentKind.DECODE, 9, (1,)),
        ),
        hidden=hidden,
        timings=(StageTiming(0, 1.5, 0.25), StageTiming(1, 2.0)),
    )


@pytest.mark.parametrize("wire", list(WireDType))
def test_frame_roundtrip(wire: WireDType) -> None:
    # Values on the int8 grid (row absmax 127 * 0.5) survive every wire dtype exactly.
    hidden = torch.randint(-127, 128, (6, 64)).float() * 0.5
    hidden[:, 0] = 63.5
    frame = sample_frame(hidden)
    assert frame.row_count == 6
    back = wire_roundtrip(frame, frame_to_proto, frame_from_proto, wire_dtype=wire)
    assert back == frame
    assert [s.pos_end for s in back.segments] == [44, 0, 2, 10]
    assert [(row, count) for _, row, count in back.spans()] == [(0, 3), (3, 0), (3, 2), (5, 1)]
    # float32 on the wire would turn 0.7 into 0.699999988...: sampling must be exact.
    sampling = back.segments[2].sampling
    assert sampling.temperature == 0.7 and sampling.top_p == 0.9


def test_frame_without_refused_segments_drops_their_rows() -> None:
    hidden = torch.arange(6 * 4, dtype=torch.float32).reshape(6, 4)
    pb = frame_to_proto(sample_frame(hidden))
    back = frame_from_proto(pb, skip={0})
    assert [s.request_id for s in back.segments] == ["req-2", "req-3", "req-4"]
    assert torch.equal(back.hidden, hidden[3:])


def test_frame_equality_sees_tensor_values() -> None:
    segments = (Segment("r", "s", SegmentKind.DECODE, 1, (1,)),)
    a = Frame(1, 1, segments, hidden=torch.zeros(1, 4))
    b = Frame(1, 1, segments, hidden=torch.ones(1, 4))
    assert a != b
    assert a != Frame(1, 1, segments)
    back = frame_from_proto(frame_to_proto(a), hidden_dtype=torch.float16)
    assert back.hidden.dtype == torch.float16


def test_segment_kind_unset_is_rejected() -> None:
    pb = data_pb2.Frame(segments=[data_pb2.Segment(request_id="r", session_id="s")])
    with pytest.raises(InvalidRequest, match="segment kind 0"):
        frame_from_proto(pb)


def test_frame_result_roundtrip() -> None:
    ok = SegmentResult("r", "s", pos_start=10, token_ids=[4, 5, 6], accepted_count=2, epoch=4)
    failed = SegmentResult("q", "t", 10, error=ErrorInfo("UNAVAILABLE", "stage 1 gone", 1))
    result = FrameResult(9, 12, (ok, failed), timings=[StageTiming(2, 0.5)])
    back = wire_roundtrip(result, result_to_proto, result_from_proto)
    assert back == result and back.results[0].ok and not back.results[1].ok
    assert back.results[1].token_ids == ()


def test_a_reopened_note_names_its_link() -> None:
    """A stage's note that it opened a link again names it; a note that names none
    (or something else) reads as the Return link, what such a note meant first."""
    for link in ("return", "forward"):
        note = FrameResult(3, 7 if link == "return" else 0, (), reopened=True, reopened_link=link)
        assert wire_roundtrip(note, result_to_proto, result_from_proto) == note
    for named in ("", "sideways"):
        pb = result_to_proto(FrameResult(3, 7, (), reopened=True))
        pb.reopened_link = named
        assert result_from_proto(pb).reopened_link == "return"
    assert result_from_proto(result_to_proto(FrameResult(3, 7, ()))).reopened_link == ""


def test_frame_ack_and_timing_roundtrip() -> None:
    assert wire_roundtrip(FrameAck(4), ack_to_proto, ack_from_proto) == FrameAck(4)
    ack = FrameAck(5, ErrorInfo("INVALID_ARGUMENT", "bad shape", 2))
    assert wire_roundtrip(ack, ack_to_proto, ack_from_proto) == ack
    timing = StageTiming(3, 0.125, 4.0)
    assert wire_roundtrip(timing, timing_to_proto, timing_from_proto) == timing


@pytest.mark.parametrize(
    ("error", "code", "cls"),
    [
        (InvalidRequest("too long"), "INVALID_ARGUMENT", InvalidRequest),
        (CapacityExceeded("full"), "RESOURCE_EXHAUSTED", CapacityExceeded),
        (Unavailable("peer gone"), "UNAVAILABLE", Unavailable),
        (StaleTerm("term 2 < 3"), "FAILED_PRECONDITION", StaleTerm),
        (RuntimeError("boom"), "INTERNAL", Fatal),
    ],
)
def test_error_info_from_and_to_exceptions(error: Exception, code: str, cls: type) -> None:
    info = ErrorInfo.from_exception(error, stage_index=2)
    assert info.code == code and info.stage_index == 2
    back = wire_roundtrip(info, error_to_proto, error_from_proto)
    assert back == info
    rebuilt = back.to_error()
    assert type(rebuilt) is cls
    assert str(error) in rebuilt.message
    if cls is Fatal:
        assert rebuilt.message == "RuntimeError: boom"


def test_sampling_unset_top_p_means_no_filtering() -> None:
    params = sampling_from_proto(common_pb2.SamplingParams(temperature=1.0, seed=5))
    assert params == SamplingParams(temperature=1.0, top_p=1.0, top_k=0, seed=5)


def test_every_proto_message_has_a_codec_type() -> None:
    # Setting: (key, JSON value, origin) triples inside StageLoadRequest.serving.
    # FrameProgress: inside HeartbeatRequest (mesh.frames.FrameProgress).
    mapped_elsewhere = {"Tensor", "SamplingParams", "LayerRange", "Setting", "FrameProgress"}
    # The data plane's values are proto-free (mesh/frames.py); functions encode them.
    data_plane = {
        "Frame": (frame_to_proto, frame_from_proto),
        "Segment": (codec.segment_to_proto, codec.segment_from_proto),
        "FrameAck": (ack_to_proto, ack_from_proto),
        "SegmentResult": (codec.segment_result_to_proto, codec.segment_result_from_proto),
        "FrameResult": (result_to_proto, result_from_proto),
        "ErrorInfo": (error_to_proto, error_from_proto),
        "StageTiming": (timing_to_proto, timing_from_proto),
        # Encoded inside SegmentResult (codec.segment_result_to_proto).
        "TokenLogprob": (None, None),
        "ReturnAck": (None, None),
        # Where a stage takes framed TCP: read and answered by the links and the
        # servicer themselves (stage/links.py, stage/servicers.py), never a frame.
        "EndpointRequest": (None, None),
        "EndpointReply": (None, None),
    }
    names = set()
    for module in (common_pb2, stage_pb2, coordinator_pb2):
        names |= set(module.DESCRIPTOR.message_types_by_name)
    assert set(data_pb2.DESCRIPTOR.message_types_by_name) <= set(data_plane)
    names -= set(data_plane)
    for name in sorted(names - mapped_elsewhere):
        cls = getattr(codec, name, None)
        assert cls is not None, f"mesh.codec has no dataclass for {name}"
        assert hasattr(cls, "to_proto") and hasattr(cls, "from_proto"), name


def test_segment_results_carry_their_logprobs() -> None:
    from mesh.frames import SegmentResult, TokenLogprob

    result = SegmentResult(
        request_id="r",
        session_id="s",
        pos_start=7,
        token_ids=(5, 9),
        accepted_count=1,
        logprobs=(TokenLogprob(-0.5, ((5, -0.5), (3, -1.25))), TokenLogprob(-2.0, ())),
    )
    assert codec.segment_result_from_proto(codec.segment_result_to_proto(result)) == result


def test_scored_prompt_chunks_and_their_scores_survive_the_wire() -> None:
    from mesh.frames import TokenLogprob

    chunk = Segment("r", "s", SegmentKind.PREFILL, 0, (5, 6, 0), sample=False, score=True)
    last = Segment("r", "s", SegmentKind.PREFILL, 3, (8,), score=True, next_token=None)
    middle = replace_segment(chunk, next_token=0)  # token id 0 is a token like any other
    frame = Frame(1, 2, (middle, last), hidden=None)
    back = wire_roundtrip(frame, frame_to_proto, frame_from_proto)
    assert back == frame
    assert back.segments[0].next_token == 0 and back.segments[1].next_token is None
    assert back.segments[0].scored_tokens == (6, 0, 0) and back.segments[1].scored_tokens == ()
    scores = (TokenLogprob(-0.25, ((6, -0.25),)), TokenLogprob(-3.5, ()))
    result = SegmentResult("r", "s", 1, prompt_logprobs=scores)
    assert codec.segment_result_from_proto(codec.segment_result_to_proto(result)) == result


@pytest.mark.parametrize(
    "fields, message",
    [
        (
            {"kind": data_pb2.SEGMENT_KIND_DECODE, "score": True},
            "only a PREFILL segment may be scored",
        ),
        ({"kind": data_pb2.SEGMENT_KIND_PREFILL, "next_token": 4}, "next_token is only read"),
    ],
)
def test_scoring_fields_outside_a_scored_prefill_are_refused(fields: dict, message: str) -> None:
    pb = data_pb2.Segment(request_id="r", session_id="s", token_count=1, token_ids=[3], **fields)
    problem = codec.segment_problem(pb)
    assert problem is not None and message in problem.message


def test_pooled_prompt_chunks_and_their_pooled_rows_survive_the_wire() -> None:
    from mesh.frames import Pooling

    chunk = Segment("r", "s", SegmentKind.PREFILL, 0, (5, 6), sample=False, pooling=Pooling.MEAN)
    last = Segment("r", "s", SegmentKind.PREFILL, 2, (8,), pooling=Pooling.LAST)
    plain = Segment("q", "q", SegmentKind.DECODE, 4, (9,))
    frame = Frame(1, 2, (chunk, last, plain), hidden=None)
    back = wire_roundtrip(frame, frame_to_proto, frame_from_proto)
    assert back == frame and [s.pooling for s in back.segments] == [
        Pooling.MEAN,
        Pooling.LAST,
        Pooling.NONE,
    ]
    result = SegmentResult("r", "s", 1, pooled=(0.5, -1.25, 3.0))
    assert codec.segment_result_from_proto(codec.segment_result_to_proto(result)) == result


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"kind": data_pb2.SEGMENT_KIND_DECODE, "pooling": 1}, "only a PREFILL segment"),
        ({"kind": data_pb2.SEGMENT_KIND_PREFILL, "pooling": 7}, "pooling 7 is unknown"),
    ],
)
def test_pooling_outside_a_prefill_or_of_an_unknown_kind_is_refused(
    fields: dict, message: str
) -> None:
    pb = data_pb2.Segment(request_id="r", session_id="s", token_count=1, token_ids=[3], **fields)
    problem = codec.segment_problem(pb)
    assert problem is not None and message in problem.message


def replace_segment(segment: Segment, **changes) -> Segment:
    from dataclasses import replace

    return replace(segment, **changes)
