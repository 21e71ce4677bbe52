"""Control-plane and coordinator messages round-trip through their protos."""

from __future__ import annotations

import pytest

from mesh.codec import (
    ClaimReply,
    ClaimRequest,
    FileChunk,
    FileInventory,
    HeartbeatReply,
    HeartbeatRequest,
    InventoryReply,
    InventoryRequest,
    JoinReply,
    JoinRequest,
    PackageManifestReply,
    PackageManifestRequest,
    PeerRef,
    PrepareReply,
    PrepareRequest,
    ReadFileRequest,
    Ready,
    ReleaseReply,
    ReleaseRequest,
    StageLoadRequest,
    StageStatus,
    StatusReply,
    StatusRequest,
    WireDType,
)
from mesh.errors import InvalidRequest
from mesh.frames import FrameProgress
from mesh.proto.v1 import coordinator_pb2, stage_pb2
from mesh.types import LayerRange


def roundtrip(message):
    pb = message.to_proto()
    return type(message).from_proto(type(pb).FromString(pb.SerializeToString()))


def load_request(**overrides) -> StageLoadRequest:
    fields = dict(
        term=4,
        stage_index=1,
        stage_count=3,
        layer_range=LayerRange(10, 20),
        package_ref="/srv/packages/smollm2",
        manifest_sha256="ab" * 32,
        downstream=PeerRef("node-c", "10.0.0.3:7071"),
        return_endpoint="10.0.0.1:7071",
        wire_dtype=WireDType.BF16,
        device="cuda:0",
        torch_dtype="bfloat16",
        max_sessions=64,
        max_tokens_per_session=8192,
        max_batch_tokens=2048,
        session_idle_timeout_s=120.5,
    )
    return StageLoadRequest(**(fields | overrides))


CONTROL_MESSAGES = [
    ClaimRequest(term=7, coordinator_id="coord-1", model_id="smollm2"),
    ClaimReply(term=7, node_id="node-b"),
    PrepareRequest(term=7, package_ref="org/repo@main", layer_range=LayerRange(0, 30)),
    PrepareReply(term=7),
    InventoryRequest(term=7),
    InventoryReply(term=7, state="empty"),
    InventoryReply(
        term=7,
        state="preparing",
        package_ref="org/repo",
        layer_range=LayerRange(3, 9),
        bytes_done=100,
        bytes_total=300,
        files=(
            FileInventory("layers/00003.safetensors", "ready", 100, 100),
            FileInventory("layers/00004.safetensors", "failed", 0, 200, "sha256 mismatch"),
        ),
        error="",
        manifest_sha256="cd" * 32,
    ),
    load_request(),
    load_request(stage_index=0, layer_range=LayerRange(0, 10)),
    load_request(stage_index=2, downstream=None, wire_dtype=WireDType.INT8),
    load_request(
        stage_index=0,
        serving=(
            ("frontend.max_queued", "64", "mesh.toml [frontend] max_queued"),
            ("speculation.window_policy.max_window", "8", "CLI"),
            ("speculation.draft_model", '"org/draft:Q8_0"', "[defaults.speculative]"),
        ),
    ),
    Ready(term=7, data_endpoint="10.0.0.2:7071", param_bytes=123456789, load_ms=812.5),
    Ready(term=8, data_endpoint="10.0.0.3:7071", layer_ms=0.75, head_ms=2.5),
    ReleaseRequest(term=7, reason="replan after node-c died"),
    ReleaseReply(term=7),
]

COORDINATOR_MESSAGES = [
    JoinRequest("node-b", "10.0.0.2:7071", "cuda:0", 24 << 30, 1.5, False, ""),
    JoinRequest("head", "10.0.0.1:7071", "cpu", 8 << 30, frontend=True, http_url="http://h:8000"),
    JoinReply("coord-1", 1000),
    HeartbeatRequest("node-b", term=7, state="serving", active_sessions=3),
    HeartbeatRequest("node-c", 7, "serving", 1, kv_bytes=3 << 33, prefix_bytes=5 << 20),
    HeartbeatRequest("node-d", 7, "serving", step_ms=12.5, step_frames=64),
    HeartbeatRequest("node-e", 7, "serving", progress=FrameProgress(done=41)),
    HeartbeatRequest(
        "head",
        7,
        "serving",
        progress=FrameProgress(
            done=44, waiting_frame=42, waiting_s=2.5, waiting_compute_s=0.25, longest_round_s=1.5
        ),
    ),
    HeartbeatReply(known=False, term=7),
    HeartbeatReply(known=True, term=8, superseded_by="10.0.0.3:7071"),
    HeartbeatRequest("node-f", 8, "idle", address="10.0.0.2:7071"),
    StatusRequest(),
    StageStatus("node-z", "10.0.0.9:7071"),
    StatusReply(
        coordinator_id="coord-1",
        state="serving",
        model_id="smollm2",
        package_ref="/srv/p",
        term=7,
        http_url="http://h:8000",
        layer_count=30,
        stages=(
            StageStatus(
                "node-b",
                "10.0.0.2:7071",
                device="cuda:0",
                memory_bytes=1 << 30,
                assigned=True,
                stage_index=1,
                layer_range=LayerRange(15, 30),
                health="alive",
                state="serving",
                term=7,
                heartbeat_age_s=0.3,
                param_bytes=5000,
                active_sessions=2,
            ),
            StageStatus("node-x", "10.0.0.4:7071", health="dead", state="failed"),
            StageStatus("node-y", "10.0.0.5:7071", slice_bytes_done=5, slice_bytes_total=9),
            StageStatus("node-w", "10.0.0.6:7071", kv_bytes=1 << 34, prefix_bytes=7),
            StageStatus(
                "node-v",
                "10.0.0.7:7071",
                memory_bytes=3 << 30,
                memory_source="measured",
                planned_step_ms=10.5,
                measured_step_ms=11.25,
                layer_ms=0.5,
                head_ms=4.0,
            ),
        ),
        waiting_for="stage 0 to be idle",
    ),
    JoinRequest("node-c", "10.0.0.3:7071", "cpu", 0, term=12),
    JoinRequest("node-e", "10.0.0.5:7071", "cpu", 6 << 30, memory_source="measured"),
    PackageManifestRequest("/srv/p", "node-b"),
    PackageManifestReply('{"schema_version": 1}'),
    ReadFileRequest("/srv/p", "layers/00003.safetensors", offset=1 << 33, node_id="node-b"),
    FileChunk(offset=1 << 20, data=b"\x00\x01weights"),
]


@pytest.mark.parametrize("message", CONTROL_MESSAGES + COORDINATOR_MESSAGES, ids=repr)
def test_roundtrip(message) -> None:
    assert roundtrip(message) == message


def test_load_request_helpers_and_peers() -> None:
    first = roundtrip(load_request(stage_index=0))
    assert first.is_first and not first.is_last
    assert first.downstream == PeerRef("node-c", "10.0.0.3:7071")
    last = roundtrip(load_request(stage_index=2, downstream=None))
    assert last.is_last and last.downstream is None


def test_load_request_rejects_missing_pieces() -> None:
    pb = load_request().to_proto()
    pb.ClearField("layer_range")
    with pytest.raises(InvalidRequest, match="no layer_range"):
        StageLoadRequest.from_proto(pb)
    pb = load_request().to_proto()
    pb.wire_dtype = 0
    with pytest.raises(InvalidRequest, match="wire dtype 0 is unset"):
        StageLoadRequest.from_proto(pb)
    pb = load_request().to_proto()
    pb.stage_index = 3
    with pytest.raises(InvalidRequest, match="stage 3 of 3"):
        StageLoadRequest.from_proto(pb)
    pb = load_request().to_proto()
    pb.layer_range.end = pb.layer_range.start
    with pytest.raises(InvalidRequest, match=r"StageLoadRequest.layer_range is \[10, 10\)"):
        StageLoadRequest.from_proto(pb)
    pb = load_request(serving=(("frontend.max_queued", "64", "CLI"),)).to_proto()
    pb.serving[0].value_json = "sixty-four"
    with pytest.raises(InvalidRequest, match="'frontend.max_queued' holds 'sixty-four'"):
        StageLoadRequest.from_proto(pb)


def test_prepare_request_needs_a_range() -> None:
    with pytest.raises(InvalidRequest, match="PrepareRequest has no layer_range"):
        PrepareRequest.from_proto(stage_pb2.PrepareRequest(term=1, package_ref="p"))


def test_unset_speed_hint_means_reference_speed() -> None:
    join = JoinRequest.from_proto(coordinator_pb2.JoinRequest(node_id="n", address="a:1"))
    assert join.speed_hint == 1.0


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"session_idle_timeout_s": float("nan")}, "session_idle_timeout_s is nan"),
        ({"session_idle_timeout_s": -1.0}, "give seconds >= 0"),
        ({"return_endpoint": "not an endpoint"}, "return_endpoint: .* is not HOST:PORT"),
        ({"return_endpoint": "127.0.0.1:0"}, "port 0"),
        ({"downstream": PeerRef("n", "10.0.0.3:99999")}, "downstream.address: .*out of range"),
    ],
)
def test_a_load_with_numbers_or_addresses_no_coordinator_sends_is_refused(
    overrides, message
) -> None:
    """Refused on decoding with INVALID_ARGUMENT at once (a NaN idle timeout would
    keep every session forever; an endpoint that is not HOST:PORT waited 10 s for a
    connection and came back as UNAVAILABLE)."""
    with pytest.raises(InvalidRequest, match=message):
        roundtrip(load_request(**overrides))
    # An empty return endpoint (a single stage) is not an address to check.
    assert roundtrip(load_request(return_endpoint="")).return_endpoint == ""
