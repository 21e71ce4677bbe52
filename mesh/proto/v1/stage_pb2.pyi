from mesh.proto.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ClaimRequest(_message.Message):
    __slots__ = ("term", "coordinator_id", "model_id", "only_if_idle")
    TERM_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    ONLY_IF_IDLE_FIELD_NUMBER: _ClassVar[int]
    term: int
    coordinator_id: str
    model_id: str
    only_if_idle: bool
    def __init__(self, term: _Optional[int] = ..., coordinator_id: _Optional[str] = ..., model_id: _Optional[str] = ..., only_if_idle: _Optional[bool] = ...) -> None: ...

class ClaimReply(_message.Message):
    __slots__ = ("term", "node_id")
    TERM_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    term: int
    node_id: str
    def __init__(self, term: _Optional[int] = ..., node_id: _Optional[str] = ...) -> None: ...

class PrepareRequest(_message.Message):
    __slots__ = ("term", "package_ref", "layer_range", "manifest_sha256")
    TERM_FIELD_NUMBER: _ClassVar[int]
    PACKAGE_REF_FIELD_NUMBER: _ClassVar[int]
    LAYER_RANGE_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_SHA256_FIELD_NUMBER: _ClassVar[int]
    term: int
    package_ref: str
    layer_range: _common_pb2.LayerRange
    manifest_sha256: str
    def __init__(self, term: _Optional[int] = ..., package_ref: _Optional[str] = ..., layer_range: _Optional[_Union[_common_pb2.LayerRange, _Mapping]] = ..., manifest_sha256: _Optional[str] = ...) -> None: ...

class PrepareReply(_message.Message):
    __slots__ = ("term",)
    TERM_FIELD_NUMBER: _ClassVar[int]
    term: int
    def __init__(self, term: _Optional[int] = ...) -> None: ...

class InventoryRequest(_message.Message):
    __slots__ = ("term",)
    TERM_FIELD_NUMBER: _ClassVar[int]
    term: int
    def __init__(self, term: _Optional[int] = ...) -> None: ...

class FileInventory(_message.Message):
    __slots__ = ("path", "state", "bytes_done", "bytes_total", "error")
    PATH_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    BYTES_DONE_FIELD_NUMBER: _ClassVar[int]
    BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    path: str
    state: str
    bytes_done: int
    bytes_total: int
    error: str
    def __init__(self, path: _Optional[str] = ..., state: _Optional[str] = ..., bytes_done: _Optional[int] = ..., bytes_total: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class InventoryReply(_message.Message):
    __slots__ = ("term", "package_ref", "layer_range", "state", "bytes_done", "bytes_total", "files", "error", "manifest_sha256")
    TERM_FIELD_NUMBER: _ClassVar[int]
    PACKAGE_REF_FIELD_NUMBER: _ClassVar[int]
    LAYER_RANGE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    BYTES_DONE_FIELD_NUMBER: _ClassVar[int]
    BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_SHA256_FIELD_NUMBER: _ClassVar[int]
    term: int
    package_ref: str
    layer_range: _common_pb2.LayerRange
    state: str
    bytes_done: int
    bytes_total: int
    files: _containers.RepeatedCompositeFieldContainer[FileInventory]
    error: str
    manifest_sha256: str
    def __init__(self, term: _Optional[int] = ..., package_ref: _Optional[str] = ..., layer_range: _Optional[_Union[_common_pb2.LayerRange, _Mapping]] = ..., state: _Optional[str] = ..., bytes_done: _Optional[int] = ..., bytes_total: _Optional[int] = ..., files: _Optional[_Iterable[_Union[FileInventory, _Mapping]]] = ..., error: _Optional[str] = ..., manifest_sha256: _Optional[str] = ...) -> None: ...

class PeerRef(_message.Message):
    __slots__ = ("node_id", "address")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class StageLoadRequest(_message.Message):
    __slots__ = ("term", "stage_index", "stage_count", "layer_range", "package_ref", "manifest_sha256", "downstream", "return_endpoint", "wire_dtype", "device", "torch_dtype", "max_sessions", "max_tokens_per_session", "max_batch_tokens", "session_idle_timeout_s", "serving")
    TERM_FIELD_NUMBER: _ClassVar[int]
    STAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    STAGE_COUNT_FIELD_NUMBER: _ClassVar[int]
    LAYER_RANGE_FIELD_NUMBER: _ClassVar[int]
    PACKAGE_REF_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_SHA256_FIELD_NUMBER: _ClassVar[int]
    DOWNSTREAM_FIELD_NUMBER: _ClassVar[int]
    RETURN_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    WIRE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    TORCH_DTYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_PER_SESSION_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SESSION_IDLE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    term: int
    stage_index: int
    stage_count: int
    layer_range: _common_pb2.LayerRange
    package_ref: str
    manifest_sha256: str
    downstream: PeerRef
    return_endpoint: str
    wire_dtype: _common_pb2.WireDType
    device: str
    torch_dtype: str
    max_sessions: int
    max_tokens_per_session: int
    max_batch_tokens: int
    session_idle_timeout_s: float
    serving: _containers.RepeatedCompositeFieldContainer[Setting]
    def __init__(self, term: _Optional[int] = ..., stage_index: _Optional[int] = ..., stage_count: _Optional[int] = ..., layer_range: _Optional[_Union[_common_pb2.LayerRange, _Mapping]] = ..., package_ref: _Optional[str] = ..., manifest_sha256: _Optional[str] = ..., downstream: _Optional[_Union[PeerRef, _Mapping]] = ..., return_endpoint: _Optional[str] = ..., wire_dtype: _Optional[_Union[_common_pb2.WireDType, str]] = ..., device: _Optional[str] = ..., torch_dtype: _Optional[str] = ..., max_sessions: _Optional[int] = ..., max_tokens_per_session: _Optional[int] = ..., max_batch_tokens: _Optional[int] = ..., session_idle_timeout_s: _Optional[float] = ..., serving: _Optional[_Iterable[_Union[Setting, _Mapping]]] = ...) -> None: ...

class Setting(_message.Message):
    __slots__ = ("key", "value_json", "origin")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_JSON_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    key: str
    value_json: str
    origin: str
    def __init__(self, key: _Optional[str] = ..., value_json: _Optional[str] = ..., origin: _Optional[str] = ...) -> None: ...

class Ready(_message.Message):
    __slots__ = ("term", "data_endpoint", "param_bytes", "load_ms", "layer_ms", "head_ms")
    TERM_FIELD_NUMBER: _ClassVar[int]
    DATA_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    PARAM_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOAD_MS_FIELD_NUMBER: _ClassVar[int]
    LAYER_MS_FIELD_NUMBER: _ClassVar[int]
    HEAD_MS_FIELD_NUMBER: _ClassVar[int]
    term: int
    data_endpoint: str
    param_bytes: int
    load_ms: float
    layer_ms: float
    head_ms: float
    def __init__(self, term: _Optional[int] = ..., data_endpoint: _Optional[str] = ..., param_bytes: _Optional[int] = ..., load_ms: _Optional[float] = ..., layer_ms: _Optional[float] = ..., head_ms: _Optional[float] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("term", "reason")
    TERM_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    term: int
    reason: str
    def __init__(self, term: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class ReleaseReply(_message.Message):
    __slots__ = ("term",)
    TERM_FIELD_NUMBER: _ClassVar[int]
    term: int
    def __init__(self, term: _Optional[int] = ...) -> None: ...

class ProbeLinkRequest(_message.Message):
    __slots__ = ("address",)
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    address: str
    def __init__(self, address: _Optional[str] = ...) -> None: ...

class ProbeLinkReply(_message.Message):
    __slots__ = ("error",)
    ERROR_FIELD_NUMBER: _ClassVar[int]
    error: str
    def __init__(self, error: _Optional[str] = ...) -> None: ...
