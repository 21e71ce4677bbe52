"""Bytes that are not a method's protobuf message get INVALID_ARGUMENT naming the
method and the message expected (grpcio alone answers INTERNAL, which reads as a
server fault), on unary and streamed methods, with and without the join token; the
server goes on answering sound calls."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from mesh.codec import ClaimRequest, InventoryRequest
from mesh.grpc_util import bind, channel, new_server
from mesh.proto.v1 import data_pb2_grpc, stage_pb2_grpc
from mesh.security import MeshSecurity
from stage.node import NodeSettings, StageNode
from stage.servicers import ControlServicer, DataServicer

GARBAGE = b"\xff\xff\xff\xff\x0f"
TOKEN = "decoding-test-token-3c9a1e7b5d"


def serve_stage(tmp_path: Path, security: MeshSecurity) -> Iterator[tuple[str, MeshSecurity]]:
    """A stage's control and data services on a real gRPC server."""
    node = StageNode(NodeSettings(node_id="n", cache_dir=tmp_path), "127.0.0.1:1")
    server = new_server(4, security)
    stage_pb2_grpc.add_StageControlServicer_to_server(ControlServicer(node), server)
    data_pb2_grpc.add_StageDataServicer_to_server(DataServicer(node, lambda _: None), server)
    port = bind(server, "127.0.0.1:0", security)
    server.start()
    try:
        yield f"127.0.0.1:{port}", security
    finally:
        server.stop(None)
        node.stop()


@pytest.fixture(params=[None, TOKEN], ids=["open", "token"])
def stage_server(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[tuple[str, MeshSecurity]]:
    yield from serve_stage(tmp_path, MeshSecurity(join_token=request.param))


@pytest.fixture
def token_server(tmp_path: Path) -> Iterator[tuple[str, MeshSecurity]]:
    yield from serve_stage(tmp_path, MeshSecurity(join_token=TOKEN))


def test_undecodable_requests_get_invalid_argument(stage_server: tuple[str, MeshSecurity]) -> None:
    address, security = stage_server
    ch = channel(address, security)
    claim = ch.unary_unary("/mesh.v1.StageControl/Claim")
    with pytest.raises(grpc.RpcError) as refused:
        claim(GARBAGE, timeout=10)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = refused.value.details()
    assert "/mesh.v1.StageControl/Claim" in details and "mesh.v1.ClaimRequest" in details

    forward = ch.stream_stream("/mesh.v1.StageData/Forward")
    with pytest.raises(grpc.RpcError) as streamed:
        list(forward(iter([GARBAGE]), timeout=10))
    assert streamed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "/mesh.v1.StageData/Forward" in streamed.value.details()

    # The same server still answers sound calls, through the generated stubs.
    stub = stage_pb2_grpc.StageControlStub(ch)
    assert stub.Claim(ClaimRequest(1, "coord", "m").to_proto(), timeout=10).term == 1
    assert stub.Inventory(InventoryRequest(1).to_proto(), timeout=10) is not None
    ch.close()


def test_without_the_token_the_caller_learns_nothing_of_the_messages(
    token_server: tuple[str, MeshSecurity],
) -> None:
    address, _ = token_server
    ch = channel(address, MeshSecurity(join_token=None))
    with pytest.raises(grpc.RpcError) as refused:
        ch.unary_unary("/mesh.v1.StageControl/Claim")(GARBAGE, timeout=10)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    ch.close()
