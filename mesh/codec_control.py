"""Stage control-plane messages: frozen dataclasses and their proto forms.

Every message of ``StageControl`` (coordinator -> stage) has a dataclass here
with ``to_proto()`` and ``from_proto(pb)``. ``mesh.codec`` re-exports everything,
so callers import from there.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from mesh.codec_tensor import WireDType
from mesh.errors import InvalidRequest
from mesh.netaddr import split_host_port
from mesh.proto.v1 import common_pb2, stage_pb2
from mesh.types import LayerRange


def layer_range_to_proto(layer_range: LayerRange) -> common_pb2.LayerRange:
    return common_pb2.LayerRange(start=layer_range.start, end=layer_range.end)


def layer_range_from_proto(pb: common_pb2.LayerRange, where: str) -> LayerRange:
    """Convert a set LayerRange field; ``where`` names it in the error message."""
    if pb.end <= pb.start:
        raise InvalidRequest(
            f"{where} is [{pb.start}, {pb.end}), which is empty; "
            "layer ranges are half-open [start, end) with start < end"
        )
    return LayerRange(pb.start, pb.end)


def _optional_range(pb_owner, field: str, where: str) -> LayerRange | None:
    if not pb_owner.HasField(field):
        return None
    return layer_range_from_proto(getattr(pb_owner, field), where)


def _setting(pb: stage_pb2.Setting) -> tuple[str, str, str]:
    try:
        json.loads(pb.value_json)
    except ValueError:
        raise InvalidRequest(
            f"StageLoadRequest.serving: {pb.key!r} holds {pb.value_json!r}, which is not "
            "JSON; send each value JSON-encoded"
        ) from None
    return pb.key, pb.value_json, pb.origin


def _set_range(pb_owner, field: str, layer_range: LayerRange | None) -> None:
    if layer_range is not None:
        getattr(pb_owner, field).CopyFrom(layer_range_to_proto(layer_range))


# ---------------------------------------------------------------- StageControl


@dataclass(frozen=True)
class ClaimRequest:
    term: int
    coordinator_id: str
    model_id: str
    # Refuse rather than fence a loaded term while the stage serves requests.
    only_if_idle: bool = False

    def to_proto(self) -> stage_pb2.ClaimRequest:
        return stage_pb2.ClaimRequest(
            term=self.term,
            coordinator_id=self.coordinator_id,
            model_id=self.model_id,
            only_if_idle=self.only_if_idle,
        )

    @classmethod
    def from_proto(cls, pb: stage_pb2.ClaimRequest) -> ClaimRequest:
        return cls(pb.term, pb.coordinator_id, pb.model_id, pb.only_if_idle)


@dataclass(frozen=True)
class ClaimReply:
    term: int
    node_id: str

    def to_proto(self) -> stage_pb2.ClaimReply:
        return stage_pb2.ClaimReply(term=self.term, node_id=self.node_id)

    @classmethod
    def from_proto(cls, pb: stage_pb2.ClaimReply) -> ClaimReply:
        return cls(pb.term, pb.node_id)


@dataclass(frozen=True)
class PrepareRequest:
    term: int
    package_ref: str
    layer_range: LayerRange
    manifest_sha256: str = ""

    def to_proto(self) -> stage_pb2.PrepareRequest:
        pb = stage_pb2.PrepareRequest(
            term=self.term, package_ref=self.package_ref, manifest_sha256=self.manifest_sha256
        )
        _set_range(pb, "layer_range", self.layer_range)
        return pb

    @classmethod
    def from_proto(cls, pb: stage_pb2.PrepareRequest) -> PrepareRequest:
        if not pb.HasField("layer_range"):
            raise InvalidRequest("PrepareRequest has no layer_range; say which layers to prepare")
        layer_range = layer_range_from_proto(pb.layer_range, "PrepareRequest.layer_range")
        return cls(pb.term, pb.package_ref, layer_range, pb.manifest_sha256)


@dataclass(frozen=True)
class PrepareReply:
    term: int

    def to_proto(self) -> stage_pb2.PrepareReply:
        return stage_pb2.PrepareReply(term=self.term)

    @classmethod
    def from_proto(cls, pb: stage_pb2.PrepareReply) -> PrepareReply:
        return cls(pb.term)


@dataclass(frozen=True)
class InventoryRequest:
    term: int

    def to_proto(self) -> stage_pb2.InventoryRequest:
        return stage_pb2.InventoryRequest(term=self.term)

    @classmethod
    def from_proto(cls, pb: stage_pb2.InventoryRequest) -> InventoryRequest:
        return cls(pb.term)


@dataclass(frozen=True)
class FileInventory:
    """One package file: state is ready, missing, preparing or failed."""

    path: str
    state: str
    bytes_done: int = 0
    bytes_total: int = 0
    error: str = ""

    def to_proto(self) -> stage_pb2.FileInventory:
        return stage_pb2.FileInventory(
            path=self.path,
            state=self.state,
            bytes_done=self.bytes_done,
            bytes_total=self.bytes_total,
            error=self.error,
        )

    @classmethod
    def from_proto(cls, pb: stage_pb2.FileInventory) -> FileInventory:
        return cls(pb.path, pb.state, pb.bytes_done, pb.bytes_total, pb.error)


@dataclass(frozen=True)
class InventoryReply:
    """What the stage holds of its slice; state is empty, preparing, ready or failed."""

    term: int
    state: str
    package_ref: str = ""
    layer_range: LayerRange | None = None
    bytes_done: int = 0
    bytes_total: int = 0
    files: tuple[FileInventory, ...] = ()
    error: str = ""
    manifest_sha256: str = ""

    def to_proto(self) -> stage_pb2.InventoryReply:
        pb = stage_pb2.InventoryReply(
            term=self.term,
            package_ref=self.package_ref,
            state=self.state,
            bytes_done=self.bytes_done,
            bytes_total=self.bytes_total,
            files=[f.to_proto() for f in self.files],
            error=self.error,
            manifest_sha256=self.manifest_sha256,
        )
        _set_range(pb, "layer_range", self.layer_range)
        return pb

    @classmethod
    def from_proto(cls, pb: stage_pb2.InventoryReply) -> InventoryReply:
        return cls(
            term=pb.term,
            state=pb.state,
            package_ref=pb.package_ref,
            layer_range=_optional_range(pb, "layer_range", "InventoryReply.layer_range"),
            bytes_done=pb.bytes_done,
            bytes_total=pb.bytes_total,
            files=tuple(FileInventory.from_proto(f) for f in pb.files),
            error=pb.error,
            manifest_sha256=pb.manifest_sha256,
        )


@dataclass(frozen=True)
class PeerRef:
    node_id: str
    address: str

    def to_proto(self) -> stage_pb2.PeerRef:
        return stage_pb2.PeerRef(node_id=self.node_id, address=self.address)

    @classmethod
    def from_proto(cls, pb: stage_pb2.PeerRef) -> PeerRef:
        return cls(pb.node_id, pb.address)


@dataclass(frozen=True)
class StageLoadRequest:
    """Everything a stage needs to build its runtime and open its data links.

    ``downstream`` is None on the last stage. ``max_batch_tokens`` is the step token
    budget of stage 0's engine core (0: its default).
    """

    term: int
    stage_index: int
    stage_count: int
    layer_range: LayerRange
    package_ref: str
    manifest_sha256: str
    downstream: PeerRef | None
    return_endpoint: str
    wire_dtype: WireDType
    device: str = "cpu"
    torch_dtype: str = "float32"
    max_sessions: int = 0
    max_tokens_per_session: int = 0
    max_batch_tokens: int = 0
    session_idle_timeout_s: float = 0.0
    # Stage 0: (key, JSON value, origin) of the coordinator's serving settings.
    serving: tuple[tuple[str, str, str], ...] = ()

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.stage_count - 1

    def to_proto(self) -> stage_pb2.StageLoadRequest:
        pb = stage_pb2.StageLoadRequest(
            term=self.term,
            stage_index=self.stage_index,
            stage_count=self.stage_count,
            package_ref=self.package_ref,
            manifest_sha256=self.manifest_sha256,
            return_endpoint=self.return_endpoint,
            wire_dtype=self.wire_dtype.to_proto(),
            device=self.device,
            torch_dtype=self.torch_dtype,
            max_sessions=self.max_sessions,
            max_tokens_per_session=self.max_tokens_per_session,
            max_batch_tokens=self.max_batch_tokens,
            session_idle_timeout_s=self.session_idle_timeout_s,
            serving=[
                stage_pb2.Setting(key=key, value_json=value, origin=origin)
                for key, value, origin in self.serving
            ],
        )
        _set_range(pb, "layer_range", self.layer_range)
        if self.downstream is not None:
            pb.downstream.CopyFrom(self.downstream.to_proto())
        return pb

    @classmethod
    def from_proto(cls, pb: stage_pb2.StageLoadRequest) -> StageLoadRequest:
        if not pb.HasField("layer_range"):
            raise InvalidRequest("StageLoadRequest has no layer_range; say which layers to load")
        if pb.stage_count == 0 or pb.stage_index >= pb.stage_count:
            raise InvalidRequest(
                f"StageLoadRequest names stage {pb.stage_index} of {pb.stage_count}; "
                "stage_index must be below stage_count"
            )
        for field_name, address in (
            ("return_endpoint", pb.return_endpoint),
            ("downstream.address", pb.downstream.address if pb.HasField("downstream") else ""),
        ):
            if address:
                _check_dialable(f"StageLoadRequest.{field_name}", address)
        idle_s = pb.session_idle_timeout_s
        if not (math.isfinite(idle_s) and idle_s >= 0):
            raise InvalidRequest(
                f"StageLoadRequest.session_idle_timeout_s is {idle_s}; give seconds >= 0 "
                "(0: sessions never expire)"
            )
        return cls(
            term=pb.term,
            stage_index=pb.stage_index,
            stage_count=pb.stage_count,
            layer_range=layer_range_from_proto(pb.layer_range, "StageLoadRequest.layer_range"),
            package_ref=pb.package_ref,
            manifest_sha256=pb.manifest_sha256,
            downstream=PeerRef.from_proto(pb.downstream) if pb.HasField("downstream") else None,
            return_endpoint=pb.return_endpoint,
            wire_dtype=WireDType.from_proto(pb.wire_dtype),
            device=pb.device,
            torch_dtype=pb.torch_dtype,
            max_sessions=pb.max_sessions,
            max_tokens_per_session=pb.max_tokens_per_session,
            max_batch_tokens=pb.max_batch_tokens,
            session_idle_timeout_s=pb.session_idle_timeout_s,
            serving=tuple(_setting(item) for item in pb.serving),
        )


def _check_dialable(what: str, address: str) -> None:
    """InvalidRequest unless ``address`` is HOST:PORT with a port to dial (1-65535)."""
    try:
        _, port = split_host_port(address)
    except ValueError as error:
        raise InvalidRequest(f"{what}: {error}; give HOST:PORT") from None
    if port == 0:
        raise InvalidRequest(f"{what}: {address!r} has port 0, which cannot be dialled")


@dataclass(frozen=True)
class Ready:
    """A loaded stage: where upstream stages send their Forward frames."""

    term: int
    data_endpoint: str
    param_bytes: int = 0
    load_ms: float = 0.0
    # Measured after loading: ms per decoder layer and for the LM head (0: not measured).
    layer_ms: float = 0.0
    head_ms: float = 0.0

    def to_proto(self) -> stage_pb2.Ready:
        return stage_pb2.Ready(
            term=self.term,
            data_endpoint=self.data_endpoint,
            param_bytes=self.param_bytes,
            load_ms=self.load_ms,
            layer_ms=self.layer_ms,
            head_ms=self.head_ms,
        )

    @classmethod
    def from_proto(cls, pb: stage_pb2.Ready) -> Ready:
        return cls(pb.term, pb.data_endpoint, pb.param_bytes, pb.load_ms, pb.layer_ms, pb.head_ms)


@dataclass(frozen=True)
class ReleaseRequest:
    term: int
    reason: str = ""

    def to_proto(self) -> stage_pb2.ReleaseRequest:
        return stage_pb2.ReleaseRequest(term=self.term, reason=self.reason)

    @classmethod
    def from_proto(cls, pb: stage_pb2.ReleaseRequest) -> ReleaseRequest:
        return cls(pb.term, pb.reason)


@dataclass(frozen=True)
class ReleaseReply:
    term: int

    def to_proto(self) -> stage_pb2.ReleaseReply:
        return stage_pb2.ReleaseReply(term=self.term)

    @classmethod
    def from_proto(cls, pb: stage_pb2.ReleaseReply) -> ReleaseReply:
        return cls(pb.term)


@dataclass(frozen=True)
class ProbeLinkRequest:
    """Ask a stage whether it could open a data link to the stage whose gRPC
    address is ``address`` (host:port) now."""

    address: str

    def to_proto(self) -> stage_pb2.ProbeLinkRequest:
        return stage_pb2.ProbeLinkRequest(address=self.address)

    @classmethod
    def from_proto(cls, pb: stage_pb2.ProbeLinkRequest) -> ProbeLinkRequest:
        try:
            split_host_port(pb.address)
        except ValueError as error:
            raise InvalidRequest(
                f"ProbeLinkRequest.address {pb.address!r}: {error}; give the peer stage's "
                "gRPC address as host:port"
            ) from None
        return cls(pb.address)


@dataclass(frozen=True)
class ProbeLinkReply:
    """Why the link could not be opened ("" when it could)."""

    error: str = ""

    def to_proto(self) -> stage_pb2.ProbeLinkReply:
        return stage_pb2.ProbeLinkReply(error=self.error)

    @classmethod
    def from_proto(cls, pb: stage_pb2.ProbeLinkReply) -> ProbeLinkReply:
        return cls(pb.error)
