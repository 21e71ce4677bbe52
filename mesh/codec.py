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
    ErrorInfo,
    Frame,
    FrameAck,
    FrameKind,
    ReturnAck,
    StageTiming,
    TokenResult,
    sampling_from_proto,
    sampling_to_proto,
)
from mesh.codec_tensor import (
    WireDType,
    bytes_per_token,
    decode_tensor,
    encode_tensor,
    payload_problem,
)
from mesh.errors import InvalidRequest
from mesh.proto.v1 import common_pb2, data_pb2

__all__ = [
    "PackageManifestRequest",
    "ReadFileRequest",
    "FileChunk",
    "PackageManifestReply",
    "ClaimReply",
    "ClaimRequest",
    "ErrorInfo",
    "FileInventory",
    "Frame",
    "FrameAck",
    "FrameKind",
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
    "ReleaseReply",
    "ReleaseRequest",
    "ReturnAck",
    "StageLoadRequest",
    "StageStatus",
    "StageTiming",
    "StatusReply",
    "StatusRequest",
    "TokenResult",
    "WireDType",
    "bytes_per_token",
    "decode_tensor",
    "encode_tensor",
    "layer_range_from_proto",
    "layer_range_to_proto",
    "sampling_from_proto",
    "sampling_to_proto",
    "validate_frame",
]


# -------------------------------------------------------------------- validation


def validate_frame(
    frame: data_pb2.Frame | Frame,
    *,
    hidden_size: int,
    expects_hidden: bool,
    allowed_dtypes: Collection[WireDType],
    max_frame_bytes: int,
    max_tokens: int,
) -> None:
    """Check a frame before it is applied; raise InvalidRequest naming the problem.

    Give it the proto before decoding (its byte lengths and wire dtype are checked
    too) or a decoded Frame. ``expects_hidden`` is False on stage 0, which takes
    token ids, and True on every later stage. Checks that need the session's state
    (known session, positions, KV limits) are the stage's.
    """

    def bad(problem: str) -> InvalidRequest:
        where = f"frame for request {frame.request_id!r} (session {frame.session_id!r})"
        return InvalidRequest(f"{where}: {problem}")

    if not frame.session_id:
        raise bad("session_id is empty; every frame must name its session")
    if isinstance(frame, Frame):
        kind = frame.kind
        has_hidden = frame.hidden is not None
        size = frame.hidden.numel() * frame.hidden.element_size() if has_hidden else 0
        size += 4 * len(frame.token_ids)
    else:
        try:
            kind = FrameKind.from_proto(frame.kind)
        except InvalidRequest as exc:
            raise bad(exc.message) from None
        has_hidden = frame.HasField("hidden")
        size = frame.ByteSize()
    if size > max_frame_bytes:
        raise bad(
            f"{size} bytes exceeds the frame limit of {max_frame_bytes} bytes; "
            "split the prompt into smaller PREFILL chunks or raise the limit"
        )
    count = len(frame.token_ids)
    if not kind.computes:
        if has_hidden:
            raise bad(f"{kind.value.upper()} frames carry no activations, but this one does")
        return
    if count == 0:
        raise bad(f"{kind.value.upper()} frame has no token_ids; it needs one per position")
    if count > max_tokens:
        raise bad(
            f"{count} tokens exceeds the limit of {max_tokens} tokens per frame; "
            "send the prompt in smaller PREFILL chunks"
        )
    if not expects_hidden:
        if has_hidden:
            raise bad("carries activations, but stage 0 embeds token ids itself")
        return
    if not has_hidden:
        raise bad("has no hidden tensor; this stage takes activations from its upstream stage")
    if isinstance(frame, Frame):
        shape = list(frame.hidden.shape)
    else:
        _check_wire_tensor(frame.hidden, allowed_dtypes, bad)
        shape = list(frame.hidden.shape)
    if shape != [count, hidden_size]:
        raise bad(
            f"hidden shape {shape} does not match [tokens={count}, hidden_size={hidden_size}]; "
            "the sender must send one activation row per token of the model's hidden size"
        )


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
