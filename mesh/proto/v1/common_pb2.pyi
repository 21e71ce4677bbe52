from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WireDType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WIRE_DTYPE_UNSPECIFIED: _ClassVar[WireDType]
    WIRE_DTYPE_F32: _ClassVar[WireDType]
    WIRE_DTYPE_F16: _ClassVar[WireDType]
    WIRE_DTYPE_BF16: _ClassVar[WireDType]
    WIRE_DTYPE_INT8: _ClassVar[WireDType]
WIRE_DTYPE_UNSPECIFIED: WireDType
WIRE_DTYPE_F32: WireDType
WIRE_DTYPE_F16: WireDType
WIRE_DTYPE_BF16: WireDType
WIRE_DTYPE_INT8: WireDType

class LayerRange(_message.Message):
    __slots__ = ("start", "end")
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    start: int
    end: int
    def __init__(self, start: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data", "scales")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SCALES_FIELD_NUMBER: _ClassVar[int]
    dtype: WireDType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    scales: bytes
    def __init__(self, dtype: _Optional[_Union[WireDType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., scales: _Optional[bytes] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class ErrorInfo(_message.Message):
    __slots__ = ("code", "message", "stage_index")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    STAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    stage_index: int
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ..., stage_index: _Optional[int] = ...) -> None: ...

class StageTiming(_message.Message):
    __slots__ = ("stage_index", "compute_ms", "queue_ms")
    STAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    stage_index: int
    compute_ms: float
    queue_ms: float
    def __init__(self, stage_index: _Optional[int] = ..., compute_ms: _Optional[float] = ..., queue_ms: _Optional[float] = ...) -> None: ...
