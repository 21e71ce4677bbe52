"""Data links checked from the stage that would open them before a load fences the
serving pipeline (``StageControl.ProbeLink``; coordinator/server.py ``_unlinkable``):
two workers that cannot reach each other while the coordinator reaches both are
found before anything is claimed. Real gRPC servers and sockets on 127.0.0.1."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from coordinator import registry
from coordinator.planner import Plan, StageAssignment
from coordinator.server import _new_links, _unlinkable
from mesh.grpc_util import bind, channel, new_server
from mesh.proto.v1 import data_pb2, data_pb2_grpc, stage_pb2, stage_pb2_grpc
from mesh.security import MeshSecurity
from mesh.types import LayerRange
from stage.node import NodeSettings, StageNode
from stage.servicers import ControlServicer


class Data(data_pb2_grpc.StageDataServicer):
    """A stage's data service that names ``tcp`` as its framed TCP port."""

    def __init__(self, tcp: str) -> None:
        self.tcp = tcp

    def Endpoint(self, request, context):
        return data_pb2.EndpointReply(tcp=self.tcp, tls=False)


@pytest.fixture
def stages(tmp_path: Path) -> Iterator:
    """stages(name, data_port_open) -> gRPC address of a stage with the real control
    service and a data port that accepts connections or not."""
    started: list = []

    def start(name: str, open_port: bool) -> str:
        listening = socket.create_server(("127.0.0.1", 0))
        port = listening.getsockname()[1]
        if not open_port:
            listening.close()  # nothing accepts here any more
        node = StageNode(NodeSettings(node_id=name, cache_dir=tmp_path / name), "127.0.0.1:1")
        server = new_server(4, MeshSecurity())
        stage_pb2_grpc.add_StageControlServicer_to_server(ControlServicer(node), server)
        data_pb2_grpc.add_StageDataServicer_to_server(Data(f"127.0.0.1:{port}"), server)
        address = f"127.0.0.1:{bind(server, '127.0.0.1:0', MeshSecurity())}"
        server.start()
        started.append((server, node, listening))
        return address

    yield start
    for server, node, listening in started:
        server.stop(None)
        node.stop()
        listening.close()


def plan_of(*addresses: tuple[str, str]) -> Plan:
    return Plan(
        tuple(
            StageAssignment(node_id, address, index, LayerRange(index, index + 1), 0)
            for index, (node_id, address) in enumerate(addresses)
        )
    )


def test_a_stage_says_whether_it_can_open_a_link(stages) -> None:
    source = stages("a", True)
    good, bad = stages("b", True), stages("c", False)
    free = socket.create_server(("127.0.0.1", 0))
    nobody = f"127.0.0.1:{free.getsockname()[1]}"
    free.close()
    ch = channel(source, MeshSecurity())
    try:
        probe = stage_pb2_grpc.StageControlStub(ch).ProbeLink
        assert probe(stage_pb2.ProbeLinkRequest(address=good), timeout=20).error == ""
        error = probe(stage_pb2.ProbeLinkRequest(address=bad), timeout=20).error
        assert "cannot connect to its data port" in error
        error = probe(stage_pb2.ProbeLinkRequest(address=nobody), timeout=20).error
        assert f"cannot reach {nobody}" in error
        with pytest.raises(grpc.RpcError) as refused:
            probe(stage_pb2.ProbeLinkRequest(address="not an address"), timeout=20)
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    finally:
        ch.close()


def test_a_link_between_workers_that_cannot_be_opened_leaves_its_target_out(stages) -> None:
    head, w1, w2 = stages("head", True), stages("w1", True), stages("w2", False)
    serving = registry.State(topology=plan_of(("head", head), ("w1", w1)), mesh_state="serving")
    plan = plan_of(("head", head), ("w1", w1), ("w2", w2))
    found = _unlinkable(plan, serving)
    assert [node for node, _ in found] == ["w2"]
    assert "stage 1 (w1) cannot open its data link to w2" in found[0][1]
    # Nothing new to link: nothing asked. Nothing serving: nothing to fence, so the
    # load itself finds the link (and a first load's error names the address).
    assert _unlinkable(plan_of(("head", head), ("w1", w1)), serving) == []
    assert _unlinkable(plan, registry.State()) == []


def test_links_that_serve_now_are_not_asked_and_serving_nodes_never_blamed() -> None:
    serving = plan_of(("head", "h:1"), ("w1", "a:1"))
    state = registry.State(topology=serving, mesh_state="serving")
    grown = plan_of(("head", "h:1"), ("w1", "a:1"), ("w2", "b:1"))
    # head -> w1 serves already; w1 -> w2 and w2's return link are new, held against w2.
    assert names(_new_links(grown, state)) == [("w1", "w2", "w2"), ("w2", "head", "w2")]
    # A newcomer put before a serving node: the forward link to the serving node is
    # held against the newcomer, not the serving node (that would fail it over).
    moved = plan_of(("head", "h:1"), ("w2", "b:1"), ("w1", "a:1"))
    assert names(_new_links(moved, state)) == [("head", "w2", "w2"), ("w2", "w1", "w2")]
    # Serving nodes put in another order: their new links are asked, and held
    # against nobody (the old pipeline stays until a load fails on them).
    three = plan_of(("head", "h:1"), ("w1", "a:1"), ("w2", "b:1"))
    state = registry.State(topology=three, mesh_state="serving")
    swapped = plan_of(("head", "h:1"), ("w2", "b:1"), ("w1", "a:1"))
    assert names(_new_links(swapped, state)) == [
        ("head", "w2", None),
        ("w2", "w1", None),
        ("w1", "head", None),
    ]


def names(links) -> list[tuple[str, str, str | None]]:
    return [(a.node_id, b.node_id, c.node_id if c else None) for a, b, c in links]
