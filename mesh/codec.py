"""The wire codec: one import surface for every message, and frame validation.

This module and its parts, all re-exported here, are the only code that reads or
writes raw proto fields: mesh.codec_tensor (tensors, WireDType), mesh.codec_data
(StageData), mesh.codec_control (StageControl), mesh.codec_coordinator
(Coordinator). Servicers decode a proto into a frozen dataclass, call compute
code, and encode the answer. Import from ``mesh.codec``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from mesh.codec_control import (
    ClaimReply,
    ClaimRequest,
    FileInventory,
    InventoryReply,
    InventoryRequest,
    PeerRef,
    PrepareReply,
    PrepareRequest,
    ProbeLinkReply,
    ProbeLinkRequest,
    Ready,
    ReleaseReply,
    ReleaseRequest,
    StageLoadRequest,
    layer_range_from_proto,
    layer_range_to_proto,
)
from mesh.codec_coordinator import (
    FileChunk,
    HeartbeatReply,
    HeartbeatRequest,
    JoinReply,
    JoinRequest,
    PackageManifestReply,
    PackageManifestRequest,
    ReadFileRequest,
    StageStatus,
    StatusReply,
    StatusRequest,
)
from mesh.codec_data import (
    ack_from_proto,
    ack_to_proto,
    error_from_proto,
    error_to_proto,
    frame_from_proto,
    frame_to_proto,
    kind_from_proto,
    refused_segment,
    result_from_proto,
    result_to_proto,
    sampling_from_proto,
    sampling_to_proto,
    segment_from_proto,
    segment_result_from_proto,
    segment_result_to_proto,
    segment_to_proto,
    timing_from_proto,
    timing_to_proto,
)
from mesh.codec_tensor import (
    WireDType,
    bytes_per_token,
    decode_tensor,
    encode_tensor,
    payload_problem,
)
from mesh.errors import InvalidRequest
from mesh.frames import (
    ErrorInfo,
    Frame,
    FrameAck,
    FrameResult,
    Segment,
    SegmentKind,
    SegmentResult,
    StageTiming,
)
from mesh.proto.v1 import common_pb2, data_pb2

__all__ = [
    "PackageManifestRequest",
    "ReadFileRequest",
    "FileChunk",
    "PackageManifestReply",
    "ClaimReply",
    "ClaimRequest",
    "FileInventory",
    "HeartbeatReply",
    "HeartbeatRequest",
    "InventoryReply",
    "InventoryRequest",
    "JoinReply",
    "JoinRequest",
    "PeerRef",
    "PrepareReply",
    "PrepareRequest",
    "Ready",
    "ProbeLinkReply",
    "ProbeLinkRequest",
    "ReleaseReply",
    "ReleaseRequest",
    "StageLoadRequest",
    "StageStatus",
    "StatusReply",
    "StatusRequest",
    "WireDType",
    "bytes_per_token",
    "decode_tensor",
    "encode_tensor",
    "layer_range_from_proto",
    "layer_range_to_proto",
    "sampling_from_proto",
    "sampling_to_proto",
    "validate_frame",
    "ErrorInfo",
    "Frame",
    "FrameAck",
    "FrameResult",
    "Segment",
    "SegmentKind",
    "SegmentResult",
    "StageTiming",
    "ack_from_proto",
    "ack_to_proto",
    "error_from_proto",
    "error_to_proto",
    "segment_from_proto",
    "segment_to_proto",
    "timing_from_proto",
    "timing_to_proto",
    "frame_from_proto",
    "frame_to_proto",
    "kind_from_proto",
    "refused_segment",
    "result_from_proto",
    "result_to_proto",
    "segment_result_from_proto",
    "segment_result_to_proto",
]


# -------------------------------------------------------------------- validation


def validate_frame(
    frame: data_pb2.Frame,
    *,
    hidden_size: int,
    expects_hidden: bool,
    allowed_dtypes: Collection[WireDType],
    max_frame_bytes: int,
    max_tokens: int,
) -> dict[int, InvalidRequest]:
    """Check a frame before it is decoded and applied.

    Raises InvalidRequest naming the problem when the frame as a whole cannot be
    used (over the size limits, a bad tensor, rows that do not add up): every
    segment of it fails. Returns the problems of single segments by index (empty
    session id, unknown kind, token counts): those segments fail, the others are
    applied. ``expects_hidden`` is False on stage 0, which takes token ids, and
    True on every later stage. Checks that need the session's state (known
    session, positions, KV limits) are the stage's.
    """

    def bad(problem: str) -> InvalidRequest:
        return InvalidRequest(f"frame {frame.frame_id} of term {frame.term}: {problem}")

    size = frame.ByteSize()
    if size > max_frame_bytes:
        raise bad(
            f"{size} bytes exceeds the frame limit of {max_frame_bytes} bytes; "
            "split the prompt into smaller PREFILL chunks or raise the limit"
        )
    if not frame.segments:
        raise bad("it has no segments")
    rows = sum(s.token_count for s in frame.segments)
    if rows > max_tokens:
        raise bad(
            f"{rows} tokens exceeds the limit of {max_tokens} tokens per frame; "
            "send the prompt in smaller PREFILL chunks"
        )
    problems = {
        index: problem
        for index, segment in enumerate(frame.segments)
        if (problem := segment_problem(segment)) is not None
    }
    has_hidden = frame.HasField("hidden")
    if not expects_hidden or rows == 0:
        if has_hidden:
            raise bad(
                "carries activations, but stage 0 embeds token ids itself"
                if not expects_hidden
                else "carries activations but no segment has tokens"
            )
        return problems
    if not has_hidden:
        raise bad("has no hidden tensor; this stage takes activations from its upstream stage")
    _check_wire_tensor(frame.hidden, allowed_dtypes, bad)
    shape = list(frame.hidden.shape)
    if shape != [rows, hidden_size]:
        raise bad(
            f"hidden shape {shape} does not match [tokens={rows}, hidden_size={hidden_size}]; "
            "the sender must send one activation row per token of the model's hidden size"
        )
    return problems


def segment_problem(segment: data_pb2.Segment) -> InvalidRequest | None:
    """What makes one segment unusable on its own, or None."""
    where = f"segment of request {segment.request_id!r} (session {segment.session_id!r})"
    try:
        kind = kind_from_proto(segment.kind)
    except InvalidRequest as exc:
        return InvalidRequest(f"{where}: {exc.message}")
    if not segment.session_id:
        return InvalidRequest(f"{where}: session_id is empty; every segment must name its session")
    count = segment.token_count
    if segment.prefix_from and kind is not SegmentKind.PREFILL:
        return InvalidRequest(f"{where}: only a PREFILL segment may start from a prefix")
    if (segment.score or segment.HasField("next_token")) and kind is not SegmentKind.PREFILL:
        return InvalidRequest(f"{where}: only a PREFILL segment may be scored")
    if segment.HasField("next_token") and not segment.score:
        return InvalidRequest(f"{where}: next_token is only read on a segment with score set")
    if segment.pooling and kind is not SegmentKind.PREFILL:
        return InvalidRequest(f"{where}: only a PREFILL segment may be pooled")
    if segment.pooling not in data_pb2.Pooling.values():
        return InvalidRequest(
            f"{where}: pooling {segment.pooling} is unknown; send none, mean or last"
        )
    if (segment.keep_prefix or segment.forget_prefix) and kind is not SegmentKind.END:
        return InvalidRequest(f"{where}: only an END segment may keep or forget a prefix")
    if segment.keep_prefix and segment.forget_prefix:
        return InvalidRequest(f"{where}: an END segment keeps or forgets a prefix, not both")
    if not kind.computes:
        if count or segment.token_ids:
            return InvalidRequest(f"{where}: {kind.value.upper()} segments carry no tokens")
        return None
    if count == 0:
        return InvalidRequest(
            f"{where}: {kind.value.upper()} segment has no tokens; it needs one per position"
        )
    if len(segment.token_ids) != count:
        return InvalidRequest(
            f"{where}: token_count is {count} but it carries {len(segment.token_ids)} token ids"
        )
    if kind is SegmentKind.DECODE and count != 1:
        return InvalidRequest(f"{where}: a DECODE segment holds one token, this one {count}")
    if segment.HasField("sampling"):
        try:
            sampling_from_proto(segment.sampling)
        except InvalidRequest as exc:
            return InvalidRequest(f"{where}: sampling: {exc.message}")
    return None


def _check_wire_tensor(
    pb: common_pb2.Tensor,
    allowed_dtypes: Collection[WireDType],
    bad: Callable[[str], InvalidRequest],
) -> None:
    try:
        wire = WireDType.from_proto(pb.dtype)
    except InvalidRequest as exc:
        raise bad(f"hidden {exc.message}") from None
    if wire not in allowed_dtypes:
        allowed = ", ".join(sorted(d.value for d in allowed_dtypes)) or "none"
        raise bad(f"wire dtype {wire.value} is not allowed on this link (allowed: {allowed})")
    problem = payload_problem(pb, wire)
    if problem is not None:
        raise bad("hidden " + problem)
