"""Coordinator service messages (Join, Heartbeat, Status) as frozen dataclasses.

``mesh.codec`` re-exports everything here; callers import from there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mesh.codec_control import layer_range_from_proto, layer_range_to_proto
from mesh.errors import InvalidRequest
from mesh.frames import FrameProgress
from mesh.netaddr import split_host_port
from mesh.proto.v1 import coordinator_pb2
from mesh.types import LayerRange, check_term


@dataclass(frozen=True)
class JoinRequest:
    """A stage offering itself to the coordinator."""

    node_id: str
    address: str
    device: str
    memory_bytes: int
    speed_hint: float = 1.0
    frontend: bool = False
    http_url: str = ""
    term: int = 0
    # "stated" (--memory), "measured" (free device memory / available RAM) or "".
    memory_source: str = ""

    def to_proto(self) -> coordinator_pb2.JoinRequest:
        return coordinator_pb2.JoinRequest(
            node_id=self.node_id,
            address=self.address,
            device=self.device,
            memory_bytes=self.memory_bytes,
            speed_hint=self.speed_hint,
            frontend=self.frontend,
            http_url=self.http_url,
            term=self.term,
            memory_source=self.memory_source,
        )

    @classmethod
    def from_proto(cls, pb: coordinator_pb2.JoinRequest) -> JoinRequest:
        return cls(
            node_id=pb.node_id,
            address=pb.address,
            device=pb.device,
            memory_bytes=pb.memory_bytes,
            # An unset hint (0) means the reference speed.
            speed_hint=pb.speed_hint if pb.speed_hint > 0 else 1.0,
            frontend=pb.frontend,
            http_url=pb.http_url,
            term=pb.term,
            memory_source=pb.memory_source,
        )


# Bounds of what a node may say of itself when it joins.
MAX_NODE_ID_CHARS = 256
MAX_JOIN_TEXT_CHARS = 1024
MAX_MEMORY_BYTES = 2**56
MAX_SPEED_HINT = 1e6


def check_join(request: JoinRequest) -> JoinRequest:
    """``request`` where what it says can be planned with; else InvalidRequest
    naming the field: an address the coordinator could dial (HOST:PORT), a bounded
    node id, a finite positive speed, a memory size and term in range."""
    if not request.node_id or len(request.node_id) > MAX_NODE_ID_CHARS:
        raise InvalidRequest(f"node_id must hold 1 to {MAX_NODE_ID_CHARS} characters")
    if not request.node_id.isprintable() or any(c.isspace() for c in request.node_id):
        raise InvalidRequest(f"node_id {request.node_id!r} holds spaces or control characters")
    try:
        _, port = split_host_port(request.address)
    except ValueError:
        port = 0
    if not 0 < port < 65536 or any(c.isspace() for c in request.address):
        raise InvalidRequest(
            f"address {request.address!r} is not HOST:PORT of the stage's gRPC server; "
            "give the node an --advertise address the coordinator and stages can reach"
        )
    for name in ("address", "device", "http_url", "memory_source"):
        if len(getattr(request, name)) > MAX_JOIN_TEXT_CHARS:
            raise InvalidRequest(f"{name} holds more than {MAX_JOIN_TEXT_CHARS} characters")
    if not (math.isfinite(request.speed_hint) and 0 < request.speed_hint <= MAX_SPEED_HINT):
        raise InvalidRequest(
            f"speed_hint must be a finite number in (0, {MAX_SPEED_HINT:g}], got "
            f"{request.speed_hint}"
        )
    if not 0 <= request.memory_bytes <= MAX_MEMORY_BYTES:
        raise InvalidRequest(f"memory_bytes {request.memory_bytes} is beyond 2^56 (64 PiB)")
    check_term(request.term, "Join")
    return request


@dataclass(frozen=True)
class JoinReply:
    coordinator_id: str
    heartbeat_interval_ms: int

    def to_proto(self) -> coordinator_pb2.JoinReply:
        return coordinator_pb2.JoinReply(
            coordinator_id=self.coordinator_id,
            heartbeat_interval_ms=self.heartbeat_interval_ms,
        )

    @classmethod
    def from_proto(cls, pb: coordinator_pb2.JoinReply) -> JoinReply:
        return cls(pb.coordinator_id, pb.heartbeat_interval_ms)


@dataclass(frozen=True)
class HeartbeatRequest:
    """state: idle, claimed, preparing, loaded, serving or failed. ``kv_bytes``: KV
    cache held for live sessions; ``prefix_bytes``: for kept prefixes; ``step_ms``:
    mean compute time of the last ``step_frames`` frames."""

    node_id: str
    term: int
    state: str
    active_sessions: int = 0
    kv_bytes: int = 0
    prefix_bytes: int = 0
    step_ms: float = 0.0
    step_frames: int = 0
    # A data link of the loaded pipeline that broke ("" while they work).
    link_error: str = ""
    progress: FrameProgress = FrameProgress()
    # The address this process joined with ("": not said; counted as the node's).
    address: str = ""

    def to_proto(self) -> coordinator_pb2.HeartbeatRequest:
        return coordinator_pb2.HeartbeatRequest(
            node_id=self.node_id,
            term=self.term,
            state=self.state,
            active_sessions=self.active_sessions,
            kv_bytes=self.kv_bytes,
            prefix_bytes=self.prefix_bytes,
            step_ms=self.step_ms,
            step_frames=self.step_frames,
            link_error=self.link_error,
            progress=coordinator_pb2.FrameProgress(**vars(self.progress)),
            address=self.address,
        )

    @classmethod
    def from_proto(cls, pb: coordinator_pb2.HeartbeatRequest) -> HeartbeatRequest:
        return cls(
            pb.node_id,
            pb.term,
            pb.state,
            pb.active_sessions,
            pb.kv_bytes,
            pb.prefix_bytes,
            pb.step_ms,
            pb.step_frames,
            pb.link_error,
            FrameProgress(
                **{f: getattr(pb.progress, f) for f in FrameProgress.__dataclass_fields__}
            ),
            pb.address,
        )


@dataclass(frozen=True)
class HeartbeatReply:
    """``known`` is False when the coordinator does not know the node: join again.
    ``superseded_by`` is the address of a process that joined with this node id
    after this one: this one's heartbeats no longer count."""

    known: bool
    term: int
    superseded_by: str = ""

    def to_proto(self) -> coordinator_pb2.HeartbeatReply:
        return coordinator_pb2.HeartbeatReply(
            known=self.known, term=self.term, superseded_by=self.superseded_by
        )

    @classmethod
    def from_proto(cls, pb: coordinator_pb2.HeartbeatReply) -> HeartbeatReply:
        return cls(pb.known, pb.term, pb.superseded_by)


@dataclass(frozen=True)
class StatusRequest:
    def to_proto(self) -> coordinator_pb2.StatusRequest:
        return coordinator_pb2.StatusRequest()

    @classmethod
    def from_proto(cls, pb: coordinator_pb2.StatusRequest) -> StatusRequest:
        return cls()


@dataclass(frozen=True)
class StageStatus:
    """One known node. ``layer_range`` is None unless the node is assigned."""

    node_id: str
    address: str
    device: str = ""
    memory_bytes: int = 0
    assigned: bool = False
    stage_index: int = 0
    layer_range: LayerRange | None = None
    health: str = "alive"
    state: str = "idle"
    term: int = 0
    heartbeat_age_s: float = 0.0
    param_bytes: int = 0
    active_sessions: int = 0
    slice_bytes_done: int = 0
    slice_bytes_total: int = 0
    kv_bytes: int = 0
    prefix_bytes: int = 0
    memory_source: str = ""
    planned_step_ms: float = 0.0
    measured_step_ms: float = 0.0
    layer_ms: float = 0.0
    head_ms: float = 0.0

    def to_proto(self) -> coordinator_pb2.StageStatus:
        pb = coordinator_pb2.StageStatus(
            node_id=self.node_id,
            address=self.address,
            device=self.device,
            memory_bytes=self.memory_bytes,
            assigned=self.assigned,
            stage_index=self.stage_index,
            health=self.health,
            state=self.state,
            term=self.term,
            heartbeat_age_s=self.heartbeat_age_s,
            param_bytes=self.param_bytes,
            active_sessions=self.active_sessions,
            slice_bytes_done=self.slice_bytes_done,
            slice_bytes_total=self.slice_bytes_total,
            kv_bytes=self.kv_bytes,
            prefix_bytes=self.prefix_bytes,
            memory_source=self.memory_source,
            planned_step_ms=self.planned_step_ms,
            measured_step_ms=self.measured_step_ms,
            layer_ms=self.layer_ms,
            head_ms=self.head_ms,
        )
        if self.layer_range is not None:
            pb.layer_range.CopyFrom(layer_range_to_proto(self.layer_range))
        return pb

    @classmethod
    def from_proto(cls, pb: coordinator_pb2.StageStatus) -> StageStatus:
        layer_range = None
        if pb.HasField("layer_range"):
            layer_range = layer_range_from_proto(pb.layer_range, "StageStatus.layer_range")
        return cls(
            node_id=pb.node_id,
            address=pb.address,
            device=pb.device,
            memory_bytes=pb.memory_bytes,
            assigned=pb.assigned,
            stage_index=pb.stage_index,
            layer_range=layer_range,
            health=pb.health,
            state=pb.state,
            term=pb.term,
            heartbeat_age_s=pb.heartbeat_age_s,
            param_bytes=pb.param_bytes,
            active_sessions=pb.active_sessions,
            slice_bytes_done=pb.slice_bytes_done,
            slice_bytes_total=pb.slice_bytes_total,
            kv_bytes=pb.kv_bytes,
            prefix_bytes=pb.prefix_bytes,
            memory_source=pb.memory_source,
            planned_step_ms=pb.planned_step_ms,
            measured_step_ms=pb.measured_step_ms,
            layer_ms=pb.layer_ms,
            head_ms=pb.head_ms,
        )


@dataclass(frozen=True)
class StatusReply:
    """The coordinator's view; state is waiting, loading, serving or failed."""

    coordinator_id: str
    state: str
    model_id: str = ""
    package_ref: str = ""
    term: int = 0
    error: str = ""
    http_url: str = ""
    layer_count: int = 0
    stages: tuple[StageStatus, ...] = ()
    waiting_for: str = ""

    def to_proto(self) -> coordinator_pb2.StatusReply:
        return coordinator_pb2.StatusReply(
            coordinator_id=self.coordinator_id,
            model_id=self.model_id,
            package_ref=self.package_ref,
            term=self.term,
            state=self.state,
            error=self.error,
            http_url=self.http_url,
            layer_count=self.layer_count,
            stages=[s.to_proto() for s in self.stages],
            waiting_for=self.waiting_for,
        )

    @classmethod
    def from_proto(cls, pb: coordinator_pb2.StatusReply) -> StatusReply:
        return cls(
            coordinator_id=pb.coordinator_id,
            state=pb.state,
            model_id=pb.model_id,
            package_ref=pb.package_ref,
            term=pb.term,
            error=pb.error,
            http_url=pb.http_url,
            layer_count=pb.layer_count,
            stages=tuple(StageStatus.from_proto(s) for s in pb.stages),
            waiting_for=pb.waiting_for,
        )


@dataclass(frozen=True)
class PackageManifestRequest:
    """A worker asks the coordinator for the manifest of the package it serves."""

    package_ref: str
    node_id: str = ""

    def to_proto(self) -> coordinator_pb2.PackageManifestRequest:
        return coordinator_pb2.PackageManifestRequest(
            package_ref=self.package_ref, node_id=self.node_id
        )

    @classmethod
    def from_proto(cls, pb: coordinator_pb2.PackageManifestRequest) -> PackageManifestRequest:
        return cls(package_ref=pb.package_ref, node_id=pb.node_id)


@dataclass(frozen=True)
class ReadFileRequest:
    """A worker reads one package file from ``offset`` on."""

    package_ref: str
    path: str
    offset: int = 0
    node_id: str = ""

    def to_proto(self) -> coordinator_pb2.ReadFileRequest:
        return coordinator_pb2.ReadFileRequest(
            package_ref=self.package_ref, path=self.path, offset=self.offset, node_id=self.node_id
        )

    @classmethod
    def from_proto(cls, pb: coordinator_pb2.ReadFileRequest) -> ReadFileRequest:
        return cls(package_ref=pb.package_ref, path=pb.path, offset=pb.offset, node_id=pb.node_id)


@dataclass(frozen=True)
class PackageManifestReply:
    """model-package.json as JSON text."""

    manifest_json: str

    def to_proto(self) -> coordinator_pb2.PackageManifestReply:
        return coordinator_pb2.PackageManifestReply(manifest_json=self.manifest_json)

    @classmethod
    def from_proto(cls, pb: coordinator_pb2.PackageManifestReply) -> PackageManifestReply:
        return cls(manifest_json=pb.manifest_json)


@dataclass(frozen=True)
class FileChunk:
    """Bytes of a package file starting at ``offset``."""

    offset: int
    data: bytes

    def to_proto(self) -> coordinator_pb2.FileChunk:
        return coordinator_pb2.FileChunk(offset=self.offset, data=self.data)

    @classmethod
    def from_proto(cls, pb: coordinator_pb2.FileChunk) -> FileChunk:
        return cls(offset=int(pb.offset), data=bytes(pb.data))
