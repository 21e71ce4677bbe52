from mesh.proto.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FrameKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FRAME_KIND_UNSPECIFIED: _ClassVar[FrameKind]
    FRAME_KIND_PREFILL: _ClassVar[FrameKind]
    FRAME_KIND_DECODE: _ClassVar[FrameKind]
    FRAME_KIND_VERIFY: _ClassVar[FrameKind]
    FRAME_KIND_TRIM: _ClassVar[FrameKind]
    FRAME_KIND_END: _ClassVar[FrameKind]
FRAME_KIND_UNSPECIFIED: FrameKind
FRAME_KIND_PREFILL: FrameKind
FRAME_KIND_DECODE: FrameKind
FRAME_KIND_VERIFY: FrameKind
FRAME_KIND_TRIM: FrameKind
FRAME_KIND_END: FrameKind

class Frame(_message.Message):
    __slots__ = ("request_id", "session_id", "kind", "pos_start", "token_ids", "hidden", "sampling", "term", "sample", "timings")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    POS_START_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    session_id: str
    kind: FrameKind
    pos_start: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    hidden: _common_pb2.Tensor
    sampling: _common_pb2.SamplingParams
    term: int
    sample: bool
    timings: _containers.RepeatedCompositeFieldContainer[_common_pb2.StageTiming]
    def __init__(self, request_id: _Optional[str] = ..., session_id: _Optional[str] = ..., kind: _Optional[_Union[FrameKind, str]] = ..., pos_start: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., hidden: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., term: _Optional[int] = ..., sample: _Optional[bool] = ..., timings: _Optional[_Iterable[_Union[_common_pb2.StageTiming, _Mapping]]] = ...) -> None: ...

class FrameAck(_message.Message):
    __slots__ = ("request_id", "session_id", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    session_id: str
    error: _common_pb2.ErrorInfo
    def __init__(self, request_id: _Optional[str] = ..., session_id: _Optional[str] = ..., error: _Optional[_Union[_common_pb2.ErrorInfo, _Mapping]] = ...) -> None: ...

class TokenResult(_message.Message):
    __slots__ = ("request_id", "session_id", "pos_start", "token_ids", "accepted_count", "timings", "error", "term")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    POS_START_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_COUNT_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    session_id: str
    pos_start: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    accepted_count: int
    timings: _containers.RepeatedCompositeFieldContainer[_common_pb2.StageTiming]
    error: _common_pb2.ErrorInfo
    term: int
    def __init__(self, request_id: _Optional[str] = ..., session_id: _Optional[str] = ..., pos_start: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., accepted_count: _Optional[int] = ..., timings: _Optional[_Iterable[_Union[_common_pb2.StageTiming, _Mapping]]] = ..., error: _Optional[_Union[_common_pb2.ErrorInfo, _Mapping]] = ..., term: _Optional[int] = ...) -> None: ...

class ReturnAck(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
