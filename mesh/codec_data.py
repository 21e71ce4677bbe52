"""Data-plane messages (StageData service): frames, acks, token results, errors.

``mesh.codec`` re-exports everything here; callers import from there.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields

import torch

from mesh.codec_tensor import WireDType, decode_tensor, fill_tensor
from mesh.errors import InvalidRequest, MeshError, from_code, grpc_code_name
from mesh.proto.v1 import common_pb2, data_pb2
from mesh.types import SamplingParams


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(
        temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, seed=params.seed
    )


def sampling_from_proto(pb: common_pb2.SamplingParams) -> SamplingParams:
    """An unset top_p (0) means no nucleus filtering, like 1."""
    top_p = pb.top_p if pb.top_p > 0 else 1.0
    return SamplingParams(temperature=pb.temperature, top_p=top_p, top_k=pb.top_k, seed=pb.seed)


class FrameKind(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    VERIFY = "verify"
    TRIM = "trim"
    END = "end"

    @property
    def computes(self) -> bool:
        """True for kinds that run tokens through the layers (and carry activations)."""
        return self in (FrameKind.PREFILL, FrameKind.DECODE, FrameKind.VERIFY)

    def to_proto(self) -> int:
        return _KIND_TO_PB[self]

    @classmethod
    def from_proto(cls, value: int) -> FrameKind:
        found = _KIND_FROM_PB.get(value)
        if found is None:
            raise InvalidRequest(f"frame kind {value} is unset or unknown")
        return found


_KIND_TO_PB = {
    FrameKind.PREFILL: data_pb2.FRAME_KIND_PREFILL,
    FrameKind.DECODE: data_pb2.FRAME_KIND_DECODE,
    FrameKind.VERIFY: data_pb2.FRAME_KIND_VERIFY,
    FrameKind.TRIM: data_pb2.FRAME_KIND_TRIM,
    FrameKind.END: data_pb2.FRAME_KIND_END,
}
_KIND_FROM_PB = {v: k for k, v in _KIND_TO_PB.items()}


@dataclass(frozen=True)
class StageTiming:
    """Time one stage spent on a frame (sent as float32 milliseconds)."""

    stage_index: int
    compute_ms: float
    queue_ms: float = 0.0

    def to_proto(self) -> common_pb2.StageTiming:
        return common_pb2.StageTiming(
            stage_index=self.stage_index, compute_ms=self.compute_ms, queue_ms=self.queue_ms
        )

    @classmethod
    def from_proto(cls, pb: common_pb2.StageTiming) -> StageTiming:
        return cls(pb.stage_index, pb.compute_ms, pb.queue_ms)


@dataclass(frozen=True)
class ErrorInfo:
    """A per-request error: a gRPC status code name, a message, the failing stage."""

    code: str
    message: str
    stage_index: int = 0

    @classmethod
    def from_exception(cls, error: BaseException, stage_index: int = 0) -> ErrorInfo:
        if isinstance(error, MeshError):
            message = error.message
        else:
            message = f"{type(error).__name__}: {error}"
        return cls(grpc_code_name(error), message, stage_index)

    def to_error(self) -> MeshError:
        """The typed mesh error for this code (Fatal for codes without a class)."""
        return from_code(self.code, self.message)

    def to_proto(self) -> common_pb2.ErrorInfo:
        return common_pb2.ErrorInfo(
            code=self.code, message=self.message, stage_index=self.stage_index
        )

    @classmethod
    def from_proto(cls, pb: common_pb2.ErrorInfo) -> ErrorInfo:
        return cls(pb.code, pb.message, pb.stage_index)


def _same(a: object, b: object) -> bool:
    """Field equality that also compares tensors (dtype, shape and values)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        same_layout = a.dtype == b.dtype and a.shape == b.shape
        return same_layout and torch.equal(a.cpu(), b.cpu())
    return a == b


def _optional_error(pb, field: str = "error") -> ErrorInfo | None:
    return ErrorInfo.from_proto(getattr(pb, field)) if pb.HasField(field) else None


# -------------------------------------------------------------------- data plane


@dataclass(frozen=True, eq=False)
class Frame:
    """One unit of work for a session, flowing stage 0 -> last stage.

    ``token_ids`` sit at positions ``[pos_start, pos_start + len)``. ``hidden`` is
    ``[len(token_ids), hidden_size]`` activations entering the receiving stage
    (None for stage 0's input and for TRIM/END). ``sample`` is honoured on PREFILL
    frames: False means a prompt chunk after which the last stage samples nothing.
    """

    request_id: str
    session_id: str
    kind: FrameKind
    pos_start: int
    token_ids: tuple[int, ...] = ()
    hidden: torch.Tensor | None = None
    sampling: SamplingParams | None = None
    term: int = 0
    sample: bool = True
    timings: tuple[StageTiming, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.token_ids, tuple):
            object.__setattr__(self, "token_ids", tuple(int(t) for t in self.token_ids))
        if not isinstance(self.timings, tuple):
            object.__setattr__(self, "timings", tuple(self.timings))

    @property
    def pos_end(self) -> int:
        """One past the position of the last token: the KV length after this frame."""
        return self.pos_start + len(self.token_ids)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Frame):
            return NotImplemented
        return all(_same(getattr(self, f.name), getattr(other, f.name)) for f in fields(self))

    __hash__ = None  # type: ignore[assignment]

    def to_proto(self, wire_dtype: WireDType | str = WireDType.F32) -> data_pb2.Frame:
        pb = data_pb2.Frame(
            request_id=self.request_id,
            session_id=self.session_id,
            kind=self.kind.to_proto(),
            pos_start=self.pos_start,
            token_ids=self.token_ids,
            term=self.term,
            sample=self.sample,
            timings=[t.to_proto() for t in self.timings],
        )
        if self.hidden is not None:
            fill_tensor(pb.hidden, self.hidden, WireDType.parse(wire_dtype))
        if self.sampling is not None:
            pb.sampling.CopyFrom(sampling_to_proto(self.sampling))
        return pb

    @classmethod
    def from_proto(cls, pb: data_pb2.Frame, hidden_dtype: torch.dtype = torch.float32) -> Frame:
        """Decode a frame; the activations become a CPU tensor of ``hidden_dtype``."""
        return cls(
            request_id=pb.request_id,
            session_id=pb.session_id,
            kind=FrameKind.from_proto(pb.kind),
            pos_start=pb.pos_start,
            token_ids=tuple(pb.token_ids),
            hidden=decode_tensor(pb.hidden, hidden_dtype) if pb.HasField("hidden") else None,
            sampling=sampling_from_proto(pb.sampling) if pb.HasField("sampling") else None,
            term=pb.term,
            sample=pb.sample,
            timings=tuple(StageTiming.from_proto(t) for t in pb.timings),
        )


@dataclass(frozen=True)
class FrameAck:
    """Sent back on the Forward stream, only for a frame that failed."""

    request_id: str
    session_id: str
    error: ErrorInfo | None = None

    def to_proto(self) -> data_pb2.FrameAck:
        pb = data_pb2.FrameAck(request_id=self.request_id, session_id=self.session_id)
        if self.error is not None:
            pb.error.CopyFrom(self.error.to_proto())
        return pb

    @classmethod
    def from_proto(cls, pb: data_pb2.FrameAck) -> FrameAck:
        return cls(pb.request_id, pb.session_id, _optional_error(pb))


@dataclass(frozen=True)
class TokenResult:
    """Emitted tokens (or an error) for one frame, sent straight to stage 0.

    ``pos_start`` is the position of the first emitted token; ``accepted_count``
    how many draft tokens of a VERIFY frame were kept.
    """

    request_id: str
    session_id: str
    pos_start: int
    token_ids: tuple[int, ...] = ()
    accepted_count: int = 0
    timings: tuple[StageTiming, ...] = ()
    error: ErrorInfo | None = None
    term: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.token_ids, tuple):
            object.__setattr__(self, "token_ids", tuple(int(t) for t in self.token_ids))
        if not isinstance(self.timings, tuple):
            object.__setattr__(self, "timings", tuple(self.timings))

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_proto(self) -> data_pb2.TokenResult:
        pb = data_pb2.TokenResult(
            request_id=self.request_id,
            session_id=self.session_id,
            pos_start=self.pos_start,
            token_ids=self.token_ids,
            accepted_count=self.accepted_count,
            timings=[t.to_proto() for t in self.timings],
            term=self.term,
        )
        if self.error is not None:
            pb.error.CopyFrom(self.error.to_proto())
        return pb

    @classmethod
    def from_proto(cls, pb: data_pb2.TokenResult) -> TokenResult:
        return cls(
            request_id=pb.request_id,
            session_id=pb.session_id,
            pos_start=pb.pos_start,
            token_ids=tuple(pb.token_ids),
            accepted_count=pb.accepted_count,
            timings=tuple(StageTiming.from_proto(t) for t in pb.timings),
            error=_optional_error(pb),
            term=pb.term,
        )


@dataclass(frozen=True)
class ReturnAck:
    """Stage 0's answer when a Return stream closes."""

    def to_proto(self) -> data_pb2.ReturnAck:
        return data_pb2.ReturnAck()

    @classmethod
    def from_proto(cls, pb: data_pb2.ReturnAck) -> ReturnAck:
        return cls()
