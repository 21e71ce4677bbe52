from mesh.proto.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PackageManifestRequest(_message.Message):
    __slots__ = ("package_ref", "node_id")
    PACKAGE_REF_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    package_ref: str
    node_id: str
    def __init__(self, package_ref: _Optional[str] = ..., node_id: _Optional[str] = ...) -> None: ...

class PackageManifestReply(_message.Message):
    __slots__ = ("manifest_json",)
    MANIFEST_JSON_FIELD_NUMBER: _ClassVar[int]
    manifest_json: str
    def __init__(self, manifest_json: _Optional[str] = ...) -> None: ...

class ReadFileRequest(_message.Message):
    __slots__ = ("package_ref", "path", "offset", "node_id")
    PACKAGE_REF_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    package_ref: str
    path: str
    offset: int
    node_id: str
    def __init__(self, package_ref: _Optional[str] = ..., path: _Optional[str] = ..., offset: _Optional[int] = ..., node_id: _Optional[str] = ...) -> None: ...

class FileChunk(_message.Message):
    __slots__ = ("offset", "data")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("node_id", "address", "device", "memory_bytes", "speed_hint", "frontend", "http_url", "term", "memory_source")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    SPEED_HINT_FIELD_NUMBER: _ClassVar[int]
    FRONTEND_FIELD_NUMBER: _ClassVar[int]
    HTTP_URL_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    MEMORY_SOURCE_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    device: str
    memory_bytes: int
    speed_hint: float
    frontend: bool
    http_url: str
    term: int
    memory_source: str
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., device: _Optional[str] = ..., memory_bytes: _Optional[int] = ..., speed_hint: _Optional[float] = ..., frontend: _Optional[bool] = ..., http_url: _Optional[str] = ..., term: _Optional[int] = ..., memory_source: _Optional[str] = ...) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("coordinator_id", "heartbeat_interval_ms")
    COORDINATOR_ID_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    coordinator_id: str
    heartbeat_interval_ms: int
    def __init__(self, coordinator_id: _Optional[str] = ..., heartbeat_interval_ms: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("node_id", "term", "state", "active_sessions", "kv_bytes", "prefix_bytes", "step_ms", "step_frames", "link_error", "progress", "address")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BYTES_FIELD_NUMBER: _ClassVar[int]
    STEP_MS_FIELD_NUMBER: _ClassVar[int]
    STEP_FRAMES_FIELD_NUMBER: _ClassVar[int]
    LINK_ERROR_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    term: int
    state: str
    active_sessions: int
    kv_bytes: int
    prefix_bytes: int
    step_ms: float
    step_frames: int
    link_error: str
    progress: FrameProgress
    address: str
    def __init__(self, node_id: _Optional[str] = ..., term: _Optional[int] = ..., state: _Optional[str] = ..., active_sessions: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., prefix_bytes: _Optional[int] = ..., step_ms: _Optional[float] = ..., step_frames: _Optional[int] = ..., link_error: _Optional[str] = ..., progress: _Optional[_Union[FrameProgress, _Mapping]] = ..., address: _Optional[str] = ...) -> None: ...

class FrameProgress(_message.Message):
    __slots__ = ("done", "waiting_frame", "waiting_s", "waiting_compute_s", "longest_round_s", "received")
    DONE_FIELD_NUMBER: _ClassVar[int]
    WAITING_FRAME_FIELD_NUMBER: _ClassVar[int]
    WAITING_S_FIELD_NUMBER: _ClassVar[int]
    WAITING_COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    LONGEST_ROUND_S_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_FIELD_NUMBER: _ClassVar[int]
    done: int
    waiting_frame: int
    waiting_s: float
    waiting_compute_s: float
    longest_round_s: float
    received: int
    def __init__(self, done: _Optional[int] = ..., waiting_frame: _Optional[int] = ..., waiting_s: _Optional[float] = ..., waiting_compute_s: _Optional[float] = ..., longest_round_s: _Optional[float] = ..., received: _Optional[int] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("known", "term", "superseded_by")
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    SUPERSEDED_BY_FIELD_NUMBER: _ClassVar[int]
    known: bool
    term: int
    superseded_by: str
    def __init__(self, known: _Optional[bool] = ..., term: _Optional[int] = ..., superseded_by: _Optional[str] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StageStatus(_message.Message):
    __slots__ = ("node_id", "address", "device", "memory_bytes", "assigned", "stage_index", "layer_range", "health", "state", "term", "heartbeat_age_s", "param_bytes", "active_sessions", "slice_bytes_done", "slice_bytes_total", "kv_bytes", "prefix_bytes", "memory_source", "planned_step_ms", "measured_step_ms", "layer_ms", "head_ms")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    ASSIGNED_FIELD_NUMBER: _ClassVar[int]
    STAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    LAYER_RANGE_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    PARAM_BYTES_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    SLICE_BYTES_DONE_FIELD_NUMBER: _ClassVar[int]
    SLICE_BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_SOURCE_FIELD_NUMBER: _ClassVar[int]
    PLANNED_STEP_MS_FIELD_NUMBER: _ClassVar[int]
    MEASURED_STEP_MS_FIELD_NUMBER: _ClassVar[int]
    LAYER_MS_FIELD_NUMBER: _ClassVar[int]
    HEAD_MS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    device: str
    memory_bytes: int
    assigned: bool
    stage_index: int
    layer_range: _common_pb2.LayerRange
    health: str
    state: str
    term: int
    heartbeat_age_s: float
    param_bytes: int
    active_sessions: int
    slice_bytes_done: int
    slice_bytes_total: int
    kv_bytes: int
    prefix_bytes: int
    memory_source: str
    planned_step_ms: float
    measured_step_ms: float
    layer_ms: float
    head_ms: float
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., device: _Optional[str] = ..., memory_bytes: _Optional[int] = ..., assigned: _Optional[bool] = ..., stage_index: _Optional[int] = ..., layer_range: _Optional[_Union[_common_pb2.LayerRange, _Mapping]] = ..., health: _Optional[str] = ..., state: _Optional[str] = ..., term: _Optional[int] = ..., heartbeat_age_s: _Optional[float] = ..., param_bytes: _Optional[int] = ..., active_sessions: _Optional[int] = ..., slice_bytes_done: _Optional[int] = ..., slice_bytes_total: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., prefix_bytes: _Optional[int] = ..., memory_source: _Optional[str] = ..., planned_step_ms: _Optional[float] = ..., measured_step_ms: _Optional[float] = ..., layer_ms: _Optional[float] = ..., head_ms: _Optional[float] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("coordinator_id", "model_id", "package_ref", "term", "state", "error", "http_url", "layer_count", "stages", "waiting_for")
    COORDINATOR_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    PACKAGE_REF_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    HTTP_URL_FIELD_NUMBER: _ClassVar[int]
    LAYER_COUNT_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    WAITING_FOR_FIELD_NUMBER: _ClassVar[int]
    coordinator_id: str
    model_id: str
    package_ref: str
    term: int
    state: str
    error: str
    http_url: str
    layer_count: int
    stages: _containers.RepeatedCompositeFieldContainer[StageStatus]
    waiting_for: str
    def __init__(self, coordinator_id: _Optional[str] = ..., model_id: _Optional[str] = ..., package_ref: _Optional[str] = ..., term: _Optional[int] = ..., state: _Optional[str] = ..., error: _Optional[str] = ..., http_url: _Optional[str] = ..., layer_count: _Optional[int] = ..., stages: _Optional[_Iterable[_Union[StageStatus, _Mapping]]] = ..., waiting_for: _Optional[str] = ...) -> None: ...
