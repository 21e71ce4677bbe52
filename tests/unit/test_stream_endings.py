"""A stream whose caller goes away ends quietly, whatever form gRPC's error takes."""

from __future__ import annotations

import grpc

from mesh.grpc_util import rpc_status_name
from stage.node import NodeSettings, StageNode
from stage.servicers import DataServicer


class StatusError(grpc.RpcError, grpc.Call):
    """What a client-side call raises: an RpcError with a status."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "peer gone"

    # grpc.Call's other abstract methods, unused here.
    def initial_metadata(self):  # noqa: ANN201
        return None

    def trailing_metadata(self):  # noqa: ANN201
        return None

    def time_remaining(self):  # noqa: ANN201
        return None

    def cancel(self):  # noqa: ANN201
        return False

    def is_active(self):  # noqa: ANN201
        return False

    def add_callback(self, callback):  # noqa: ANN001, ANN201
        return False


def ended_stream(error: grpc.RpcError):
    raise error
    yield  # pragma: no cover - makes this a generator


def test_status_name_of_a_bare_and_a_full_rpc_error() -> None:
    assert rpc_status_name(grpc.RpcError()) == "CANCELLED"
    assert rpc_status_name(StatusError()) == "UNAVAILABLE"


def test_return_stream_ended_by_a_bare_rpc_error_returns_an_ack(tmp_path) -> None:
    results: list = []
    node = StageNode(NodeSettings(node_id="n", cache_dir=tmp_path), "127.0.0.1:1")
    try:
        servicer = DataServicer(node=node, on_result=results.append)
        reply = servicer.Return(ended_stream(grpc.RpcError()), context=None)
    finally:
        node.stop()
    assert reply is not None and results == []
