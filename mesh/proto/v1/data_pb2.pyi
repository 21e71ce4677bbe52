from mesh.proto.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SegmentKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SEGMENT_KIND_UNSPECIFIED: _ClassVar[SegmentKind]
    SEGMENT_KIND_PREFILL: _ClassVar[SegmentKind]
    SEGMENT_KIND_DECODE: _ClassVar[SegmentKind]
    SEGMENT_KIND_VERIFY: _ClassVar[SegmentKind]
    SEGMENT_KIND_END: _ClassVar[SegmentKind]

class Pooling(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    POOLING_NONE: _ClassVar[Pooling]
    POOLING_MEAN: _ClassVar[Pooling]
    POOLING_LAST: _ClassVar[Pooling]
SEGMENT_KIND_UNSPECIFIED: SegmentKind
SEGMENT_KIND_PREFILL: SegmentKind
SEGMENT_KIND_DECODE: SegmentKind
SEGMENT_KIND_VERIFY: SegmentKind
SEGMENT_KIND_END: SegmentKind
POOLING_NONE: Pooling
POOLING_MEAN: Pooling
POOLING_LAST: Pooling

class EndpointRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EndpointReply(_message.Message):
    __slots__ = ("tcp", "tls", "serving_term", "forward_broken")
    TCP_FIELD_NUMBER: _ClassVar[int]
    TLS_FIELD_NUMBER: _ClassVar[int]
    SERVING_TERM_FIELD_NUMBER: _ClassVar[int]
    FORWARD_BROKEN_FIELD_NUMBER: _ClassVar[int]
    tcp: str
    tls: bool
    serving_term: int
    forward_broken: bool
    def __init__(self, tcp: _Optional[str] = ..., tls: _Optional[bool] = ..., serving_term: _Optional[int] = ..., forward_broken: _Optional[bool] = ...) -> None: ...

class Segment(_message.Message):
    __slots__ = ("request_id", "session_id", "kind", "pos_start", "token_count", "token_ids", "sampling", "sample", "epoch", "prefix_from", "keep_prefix", "forget_prefix", "ahead", "score", "next_token", "pooling")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    POS_START_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FROM_FIELD_NUMBER: _ClassVar[int]
    KEEP_PREFIX_FIELD_NUMBER: _ClassVar[int]
    FORGET_PREFIX_FIELD_NUMBER: _ClassVar[int]
    AHEAD_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    session_id: str
    kind: SegmentKind
    pos_start: int
    token_count: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    sample: bool
    epoch: int
    prefix_from: str
    keep_prefix: bool
    forget_prefix: bool
    ahead: bool
    score: bool
    next_token: int
    pooling: Pooling
    def __init__(self, request_id: _Optional[str] = ..., session_id: _Optional[str] = ..., kind: _Optional[_Union[SegmentKind, str]] = ..., pos_start: _Optional[int] = ..., token_count: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., sample: _Optional[bool] = ..., epoch: _Optional[int] = ..., prefix_from: _Optional[str] = ..., keep_prefix: _Optional[bool] = ..., forget_prefix: _Optional[bool] = ..., ahead: _Optional[bool] = ..., score: _Optional[bool] = ..., next_token: _Optional[int] = ..., pooling: _Optional[_Union[Pooling, str]] = ...) -> None: ...

class Frame(_message.Message):
    __slots__ = ("term", "frame_id", "segments", "hidden", "timings")
    TERM_FIELD_NUMBER: _ClassVar[int]
    FRAME_ID_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    term: int
    frame_id: int
    segments: _containers.RepeatedCompositeFieldContainer[Segment]
    hidden: _common_pb2.Tensor
    timings: _containers.RepeatedCompositeFieldContainer[_common_pb2.StageTiming]
    def __init__(self, term: _Optional[int] = ..., frame_id: _Optional[int] = ..., segments: _Optional[_Iterable[_Union[Segment, _Mapping]]] = ..., hidden: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., timings: _Optional[_Iterable[_Union[_common_pb2.StageTiming, _Mapping]]] = ...) -> None: ...

class FrameAck(_message.Message):
    __slots__ = ("frame_id", "error")
    FRAME_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    frame_id: int
    error: _common_pb2.ErrorInfo
    def __init__(self, frame_id: _Optional[int] = ..., error: _Optional[_Union[_common_pb2.ErrorInfo, _Mapping]] = ...) -> None: ...

class SegmentResult(_message.Message):
    __slots__ = ("request_id", "session_id", "pos_start", "token_ids", "accepted_count", "error", "epoch", "logprobs", "dropped", "prompt_logprobs", "pooled")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    POS_START_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_COUNT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    POOLED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    session_id: str
    pos_start: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    accepted_count: int
    error: _common_pb2.ErrorInfo
    epoch: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    dropped: bool
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    pooled: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, request_id: _Optional[str] = ..., session_id: _Optional[str] = ..., pos_start: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., accepted_count: _Optional[int] = ..., error: _Optional[_Union[_common_pb2.ErrorInfo, _Mapping]] = ..., epoch: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., dropped: _Optional[bool] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., pooled: _Optional[_Iterable[float]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("logprob", "top_tokens", "top_logprobs")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top_tokens: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprob: _Optional[float] = ..., top_tokens: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class FrameResult(_message.Message):
    __slots__ = ("term", "frame_id", "results", "timings", "reopened", "reopened_link")
    TERM_FIELD_NUMBER: _ClassVar[int]
    FRAME_ID_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    REOPENED_FIELD_NUMBER: _ClassVar[int]
    REOPENED_LINK_FIELD_NUMBER: _ClassVar[int]
    term: int
    frame_id: int
    results: _containers.RepeatedCompositeFieldContainer[SegmentResult]
    timings: _containers.RepeatedCompositeFieldContainer[_common_pb2.StageTiming]
    reopened: bool
    reopened_link: str
    def __init__(self, term: _Optional[int] = ..., frame_id: _Optional[int] = ..., results: _Optional[_Iterable[_Union[SegmentResult, _Mapping]]] = ..., timings: _Optional[_Iterable[_Union[_common_pb2.StageTiming, _Mapping]]] = ..., reopened: _Optional[bool] = ..., reopened_link: _Optional[str] = ...) -> None: ...

class ReturnAck(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
