"""Data-plane messages (StageData service): frames of segments, acks, results.

The values are the proto-free dataclasses of ``mesh.frames``; this module turns
them into messages and back. ``mesh.codec`` re-exports everything here; callers
import from there.
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from mesh.codec_tensor import WireDType, decode_tensor, fill_tensor
from mesh.errors import InvalidRequest
from mesh.frames import (
    ErrorInfo,
    Frame,
    FrameAck,
    FrameResult,
    Pooling,
    Segment,
    SegmentKind,
    SegmentResult,
    StageTiming,
    TokenLogprob,
)
from mesh.proto.v1 import common_pb2, data_pb2
from mesh.types import SamplingParams


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        seed=params.seed,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        min_p=params.min_p,
        logit_bias=dict(params.logit_bias),
        prompt_tokens=params.prompt_tokens,
        logprobs=params.top_logprobs >= 0,
        top_logprobs=max(0, params.top_logprobs),
        grammar=params.grammar,
        min_tokens=params.min_tokens,
        hold_back=params.hold_back,
        penalty_last_n=params.penalty_last_n,
        typical_p=params.typical_p,
        top_n_sigma=params.top_n_sigma,
        xtc_probability=params.xtc_probability,
        xtc_threshold=params.xtc_threshold,
        dry_multiplier=params.dry_multiplier,
        dry_base=params.dry_base,
        dry_allowed_length=params.dry_allowed_length,
        dry_penalty_last_n=params.dry_penalty_last_n,
        dry_breakers=params.dry_breakers,
        dynatemp_range=params.dynatemp_range,
        dynatemp_exponent=params.dynatemp_exponent,
    )


def sampling_from_proto(pb: common_pb2.SamplingParams) -> SamplingParams:
    """An unset top_p (0) means no nucleus filtering, like 1; an unset
    repetition_penalty (0) means none, like 1; so does an unset typical_p (0). The
    values that tune a sampler take their defaults while it is off (XTC's threshold,
    DRY's base and allowed length, the dynamic temperature's exponent), as do an
    unset dry_base or dynatemp_exponent (0, outside their ranges). Out-of-range
    values raise InvalidRequest (SamplingParams checks them)."""
    top_p = pb.top_p if pb.top_p > 0 else 1.0
    return SamplingParams(
        temperature=pb.temperature,
        top_p=top_p,
        top_k=pb.top_k,
        seed=pb.seed,
        presence_penalty=pb.presence_penalty,
        frequency_penalty=pb.frequency_penalty,
        repetition_penalty=pb.repetition_penalty or 1.0,
        min_p=pb.min_p,
        logit_bias=tuple(sorted((int(k), float(v)) for k, v in pb.logit_bias.items())),
        prompt_tokens=pb.prompt_tokens,
        top_logprobs=pb.top_logprobs if pb.logprobs else -1,
        grammar=pb.grammar,
        min_tokens=pb.min_tokens,
        hold_back=tuple(pb.hold_back),
        penalty_last_n=pb.penalty_last_n,
        typical_p=pb.typical_p or 1.0,
        top_n_sigma=pb.top_n_sigma,
        xtc_probability=pb.xtc_probability,
        xtc_threshold=pb.xtc_threshold if pb.xtc_probability else 0.1,
        dry_multiplier=pb.dry_multiplier,
        dry_base=(pb.dry_base or 1.75) if pb.dry_multiplier else 1.75,
        dry_allowed_length=pb.dry_allowed_length if pb.dry_multiplier else 2,
        dry_penalty_last_n=pb.dry_penalty_last_n,
        dry_breakers=tuple(pb.dry_breakers),
        dynatemp_range=pb.dynatemp_range,
        dynatemp_exponent=(pb.dynatemp_exponent or 1.0) if pb.dynatemp_range else 1.0,
    )


_KIND_TO_PB = {
    SegmentKind.PREFILL: data_pb2.SEGMENT_KIND_PREFILL,
    SegmentKind.DECODE: data_pb2.SEGMENT_KIND_DECODE,
    SegmentKind.VERIFY: data_pb2.SEGMENT_KIND_VERIFY,
    SegmentKind.END: data_pb2.SEGMENT_KIND_END,
}
_KIND_FROM_PB = {v: k for k, v in _KIND_TO_PB.items()}
_POOLING_TO_PB = {
    Pooling.NONE: data_pb2.POOLING_NONE,
    Pooling.MEAN: data_pb2.POOLING_MEAN,
    Pooling.LAST: data_pb2.POOLING_LAST,
}
_POOLING_FROM_PB = {v: k for k, v in _POOLING_TO_PB.items()}


def kind_from_proto(value: int) -> SegmentKind:
    found = _KIND_FROM_PB.get(value)
    if found is None:
        raise InvalidRequest(f"segment kind {value} is unset or unknown")
    return found


def pooling_from_proto(value: int) -> Pooling:
    found = _POOLING_FROM_PB.get(value)
    if found is None:
        raise InvalidRequest(f"pooling {value} is unknown; send none, mean or last")
    return found


def timing_to_proto(timing: StageTiming) -> common_pb2.StageTiming:
    return common_pb2.StageTiming(
        stage_index=timing.stage_index, compute_ms=timing.compute_ms, queue_ms=timing.queue_ms
    )


def timing_from_proto(pb: common_pb2.StageTiming) -> StageTiming:
    return StageTiming(pb.stage_index, pb.compute_ms, pb.queue_ms)


def error_to_proto(error: ErrorInfo) -> common_pb2.ErrorInfo:
    return common_pb2.ErrorInfo(
        code=error.code, message=error.message, stage_index=error.stage_index
    )


def error_from_proto(pb: common_pb2.ErrorInfo) -> ErrorInfo:
    return ErrorInfo(pb.code, pb.message, pb.stage_index)


def _optional_error(pb) -> ErrorInfo | None:
    return error_from_proto(pb.error) if pb.HasField("error") else None


def segment_to_proto(segment: Segment) -> data_pb2.Segment:
    pb = data_pb2.Segment(
        request_id=segment.request_id,
        session_id=segment.session_id,
        kind=_KIND_TO_PB[segment.kind],
        pos_start=segment.pos_start,
        token_count=segment.token_count,
        token_ids=segment.token_ids,
        sample=segment.sample,
        epoch=segment.epoch,
        prefix_from=segment.prefix_from,
        keep_prefix=segment.keep_prefix,
        forget_prefix=segment.forget_prefix,
        ahead=segment.ahead,
        score=segment.score,
        pooling=_POOLING_TO_PB[segment.pooling],
    )
    if segment.next_token is not None:
        pb.next_token = segment.next_token
    if segment.sampling is not None:
        pb.sampling.CopyFrom(sampling_to_proto(segment.sampling))
    return pb


def segment_from_proto(pb: data_pb2.Segment) -> Segment:
    """Decode a segment (``validate_frame`` has checked its kind and counts)."""
    return Segment(
        request_id=pb.request_id,
        session_id=pb.session_id,
        kind=kind_from_proto(pb.kind),
        pos_start=pb.pos_start,
        token_ids=tuple(pb.token_ids),
        sampling=sampling_from_proto(pb.sampling) if pb.HasField("sampling") else None,
        sample=pb.sample,
        epoch=pb.epoch,
        prefix_from=pb.prefix_from,
        keep_prefix=pb.keep_prefix,
        forget_prefix=pb.forget_prefix,
        ahead=pb.ahead,
        score=pb.score,
        next_token=pb.next_token if pb.HasField("next_token") else None,
        pooling=pooling_from_proto(pb.pooling),
    )


def frame_to_proto(frame: Frame, wire_dtype: WireDType | str = WireDType.F32) -> data_pb2.Frame:
    pb = data_pb2.Frame(
        term=frame.term,
        frame_id=frame.frame_id,
        segments=[segment_to_proto(s) for s in frame.segments],
        timings=[timing_to_proto(t) for t in frame.timings],
    )
    if frame.hidden is not None:
        fill_tensor(pb.hidden, frame.hidden, WireDType.parse(wire_dtype))
    return pb


def frame_from_proto(
    pb: data_pb2.Frame, hidden_dtype: torch.dtype = torch.float32, skip: Collection[int] = ()
) -> Frame:
    """Decode a frame; the activations become a CPU tensor of ``hidden_dtype``.

    The segments at the indices in ``skip`` (refused by ``validate_frame``) are left
    out, with their rows of the tensor (counted by their ``token_count``).
    """
    hidden = decode_tensor(pb.hidden, hidden_dtype) if pb.HasField("hidden") else None
    segments = []
    keep_rows: list[torch.Tensor] = []
    row = 0
    for index, segment in enumerate(pb.segments):
        count = segment.token_count
        if index not in skip:
            segments.append(segment_from_proto(segment))
            if hidden is not None and count:
                keep_rows.append(hidden[row : row + count])
        row += count
    if hidden is not None and skip:
        hidden = torch.cat(keep_rows) if keep_rows else None
    return Frame(
        term=pb.term,
        frame_id=pb.frame_id,
        segments=tuple(segments),
        hidden=hidden,
        timings=tuple(timing_from_proto(t) for t in pb.timings),
    )


def refused_segment(pb: data_pb2.Segment, error: BaseException, stage_index: int) -> SegmentResult:
    """The failure answer for a segment that could not be decoded or applied."""
    return SegmentResult(
        request_id=pb.request_id,
        session_id=pb.session_id,
        pos_start=pb.pos_start,
        error=ErrorInfo.from_exception(error, stage_index=stage_index),
        epoch=pb.epoch,
    )


def ack_to_proto(ack: FrameAck) -> data_pb2.FrameAck:
    pb = data_pb2.FrameAck(frame_id=ack.frame_id)
    if ack.error is not None:
        pb.error.CopyFrom(error_to_proto(ack.error))
    return pb


def ack_from_proto(pb: data_pb2.FrameAck) -> FrameAck:
    return FrameAck(pb.frame_id, _optional_error(pb))


def segment_result_to_proto(result: SegmentResult) -> data_pb2.SegmentResult:
    pb = data_pb2.SegmentResult(
        request_id=result.request_id,
        session_id=result.session_id,
        pos_start=result.pos_start,
        token_ids=result.token_ids,
        accepted_count=result.accepted_count,
        epoch=result.epoch,
        dropped=result.dropped,
        logprobs=[_logprob_to_proto(entry) for entry in result.logprobs],
        prompt_logprobs=[_logprob_to_proto(entry) for entry in result.prompt_logprobs],
        pooled=result.pooled,
    )
    if result.error is not None:
        pb.error.CopyFrom(error_to_proto(result.error))
    return pb


def segment_result_from_proto(pb: data_pb2.SegmentResult) -> SegmentResult:
    return SegmentResult(
        request_id=pb.request_id,
        session_id=pb.session_id,
        pos_start=pb.pos_start,
        token_ids=tuple(pb.token_ids),
        accepted_count=pb.accepted_count,
        error=_optional_error(pb),
        epoch=pb.epoch,
        dropped=pb.dropped,
        logprobs=tuple(_logprob_from_proto(entry) for entry in pb.logprobs),
        prompt_logprobs=tuple(_logprob_from_proto(entry) for entry in pb.prompt_logprobs),
        pooled=tuple(pb.pooled),
    )


def _logprob_to_proto(entry: TokenLogprob) -> data_pb2.TokenLogprob:
    return data_pb2.TokenLogprob(
        logprob=entry.logprob,
        top_tokens=[token for token, _ in entry.top],
        top_logprobs=[value for _, value in entry.top],
    )


def _logprob_from_proto(pb: data_pb2.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(pb.logprob, tuple(zip(pb.top_tokens, pb.top_logprobs, strict=False)))


def result_to_proto(result: FrameResult) -> data_pb2.FrameResult:
    return data_pb2.FrameResult(
        term=result.term,
        frame_id=result.frame_id,
        results=[segment_result_to_proto(r) for r in result.results],
        timings=[timing_to_proto(t) for t in result.timings],
        reopened=result.reopened,
        reopened_link=result.reopened_link,
    )


def result_from_proto(pb: data_pb2.FrameResult) -> FrameResult:
    return FrameResult(
        term=pb.term,
        frame_id=pb.frame_id,
        results=tuple(segment_result_from_proto(r) for r in pb.results),
        timings=tuple(timing_from_proto(t) for t in pb.timings),
        reopened=pb.reopened,
        reopened_link=_reopened_link(pb),
    )


def _reopened_link(pb: data_pb2.FrameResult) -> str:
    """The link a reopened note names: "forward", else "return" (what a note that
    names none means); "" on any other result."""
    if not pb.reopened:
        return ""
    return "forward" if pb.reopened_link == "forward" else "return"
