"""What a stage's data listeners take from peers that are slow, greedy or in the wrong
place: framed TCP hellos have one deadline and a cap, links a cap, announced lengths
do not allocate what never arrives, stage 0 refuses Forward links, and the gRPC
Forward and Return streams are capped per kind. Real sockets and a real gRPC server
on 127.0.0.1."""

from __future__ import annotations

import socket
import ssl
import struct
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from test_tcp_data import endpoint, frame, serve, wait_for

from coordinator.certs import generate_cluster_certs
from mesh.errors import Unavailable
from mesh.grpc_util import bind, channel, new_server
from mesh.proto.v1 import data_pb2, data_pb2_grpc
from mesh.security import MeshSecurity
from stage import servicers, tcp_data
from stage.node import NodeSettings, StageNode
from stage.servicers import STAGE0_FORWARD_REFUSAL, DataServicer
from stage.tcp_data import KIND_FORWARD, KIND_RETURN, MAGIC, TcpLink

HELLO = struct.Struct("<8sBH")


@pytest.fixture(autouse=True)
def received_bytes_kept() -> Iterator[None]:
    """The process-wide count of bytes read from data links (heartbeats carry it) is
    left as it was: other tests read it as this process's own."""
    before = tcp_data._ReceivedBytes.total
    yield
    tcp_data._ReceivedBytes.total = before


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.settimeout(10)
    return sock


def closed_by_peer(sock: socket.socket, within_s: float = 10.0) -> bool:
    """Whether the server ends ``sock`` (EOF or reset) within ``within_s``, reading and
    discarding whatever it sends first."""
    sock.settimeout(within_s)
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return True


def open_forward(port: int) -> socket.socket:
    """A Forward link by hand, its hello accepted."""
    sock = connect(port)
    sock.sendall(HELLO.pack(MAGIC, KIND_FORWARD, 0))
    assert sock.recv(1) == bytes([tcp_data.ACCEPTED])
    return sock


def trickled_until_cut(slow: socket.socket) -> bool:
    """Send a hello one byte per 0.25 s, 20 times over (far longer than a 1 s
    deadline at this pace); whether the server ended the connection meanwhile."""
    hello = HELLO.pack(MAGIC, KIND_FORWARD, 0)
    for byte in hello[:-1] * 20:
        try:
            slow.sendall(bytes([byte]))
        except OSError:
            return True
        time.sleep(0.25)
        slow.settimeout(0.01)
        try:
            if slow.recv(1) == b"":
                return True
        except (TimeoutError, ssl.SSLWantReadError):
            pass
        except (ConnectionResetError, ssl.SSLError):
            return True
    return False


def test_a_hello_trickled_byte_by_byte_is_cut_at_its_deadline(monkeypatch) -> None:
    """Each byte comes well within a per-read timeout, but the hello as a whole is
    overdue: the connection ends, and a sound link is served afterwards."""
    monkeypatch.setattr(tcp_data, "HELLO_TIMEOUT_S", 1.0)
    server, got = serve()
    try:
        slow = connect(server.port)
        assert trickled_until_cut(slow)
        slow.close()
        link = TcpLink(endpoint(server), KIND_FORWARD, lambda e: None, security=MeshSecurity())
        link.send(frame(5))
        assert data_pb2.Frame.FromString(got.frames.get(timeout=10)).frame_id == 5
        link.close()
    finally:
        server.close()


def test_a_tls_hello_trickled_byte_by_byte_is_cut_at_its_deadline(monkeypatch, tmp_path) -> None:
    """The same over TLS: the cut must shut down the TLS socket, which took the raw
    socket's descriptor over (shutting the raw one down did nothing: the trickle
    went on for as long as the client liked)."""
    monkeypatch.setattr(tcp_data, "HELLO_TIMEOUT_S", 1.0)
    made = generate_cluster_certs(tmp_path, ("127.0.0.1",))
    ca, cert, key = made.ca_cert, made.nodes[0].cert, made.nodes[0].key
    security = MeshSecurity(tls_cert=cert, tls_key=key, tls_ca=ca)
    server, got = serve(security)
    try:
        context = ssl.create_default_context(cafile=str(ca))
        slow = context.wrap_socket(connect(server.port), server_hostname="127.0.0.1")
        started = time.monotonic()
        ended = trickled_until_cut(slow)
        assert ended and time.monotonic() - started < 5.0
        slow.close()
        link = TcpLink(endpoint(server), KIND_FORWARD, lambda e: None, tls=True, security=security)
        link.send(frame(5))
        assert data_pb2.Frame.FromString(got.frames.get(timeout=10)).frame_id == 5
        link.close()
    finally:
        server.close()


def test_connections_past_the_hello_cap_are_closed_and_others_still_served(
    monkeypatch,
) -> None:
    monkeypatch.setattr(tcp_data, "HELLO_TIMEOUT_S", 2.0)
    server, got = serve(max_pending_hellos=2)
    silent = [connect(server.port) for _ in range(2)]
    try:
        wait_for(lambda: len(server._hellos) == 2)
        extra = connect(server.port)
        assert closed_by_peer(extra, within_s=5.0)
        extra.close()
        # The silent ones are cut at their deadline, freeing the hello slots.
        assert all(closed_by_peer(sock) for sock in silent)
        link = TcpLink(endpoint(server), KIND_RETURN, lambda e: None, security=MeshSecurity())
        link.send(data_pb2.FrameResult(term=1, frame_id=9))
        assert data_pb2.FrameResult.FromString(got.results.get(timeout=10)).frame_id == 9
        link.close()
    finally:
        for sock in silent:
            sock.close()
        server.close()


def test_connections_past_the_link_cap_are_closed_while_open_links_carry_on() -> None:
    server, got = serve(max_connections=2)
    first = TcpLink(endpoint(server), KIND_FORWARD, lambda e: None, security=MeshSecurity())
    second = TcpLink(endpoint(server), KIND_RETURN, lambda e: None, security=MeshSecurity())
    try:
        with pytest.raises(Unavailable):
            TcpLink(endpoint(server), KIND_FORWARD, lambda e: None, security=MeshSecurity())
        first.send(frame(1))
        assert data_pb2.Frame.FromString(got.frames.get(timeout=10)).frame_id == 1
        second.close()
        wait_for(lambda: len(server._links) == 1)
        third = TcpLink(endpoint(server), KIND_FORWARD, lambda e: None, security=MeshSecurity())
        third.send(frame(2))
        assert data_pb2.Frame.FromString(got.frames.get(timeout=10)).frame_id == 2
        third.close()
    finally:
        first.close()
        second.close()
        server.close()


def test_the_listener_keeps_accepting_when_a_reader_thread_cannot_start(monkeypatch) -> None:
    real = tcp_data.NamedThread
    failures = [0]

    class NoThreadOnce(real):
        def start(self) -> None:
            if self.name == "data-reader" and failures[0] == 0:
                failures[0] += 1
                raise RuntimeError("can't start new thread")
            super().start()

    monkeypatch.setattr(tcp_data, "NamedThread", NoThreadOnce)
    server, got = serve()
    try:
        unlucky = connect(server.port)
        assert closed_by_peer(unlucky)
        unlucky.close()
        assert failures[0] == 1
        link = TcpLink(endpoint(server), KIND_FORWARD, lambda e: None, security=MeshSecurity())
        link.send(frame(3))
        assert data_pb2.Frame.FromString(got.frames.get(timeout=10)).frame_id == 3
        link.close()
    finally:
        server.close()


def test_an_announced_length_allocates_only_what_arrives() -> None:
    """A length near the limit followed by a few bytes costs the listener about the
    eager buffer, not the length; a long message that does arrive is read whole."""
    server, got = serve(max_message_bytes=200 * 2**20)
    tracemalloc.start()
    try:
        liar = open_forward(server.port)
        before = tcp_data.received_bytes()
        liar.sendall(struct.pack("<I", 190 * 2**20) + b"x" * 100)
        wait_for(lambda: tcp_data.received_bytes() >= before + 104)
        time.sleep(0.2)
        _, peak = tracemalloc.get_traced_memory()
        assert peak < 16 * 2**20
        liar.close()
    finally:
        tracemalloc.stop()
    try:
        link = TcpLink(endpoint(server), KIND_FORWARD, lambda e: None, security=MeshSecurity())
        payload = bytes(range(256)) * (5 * 2**20 // 256 + 7)  # several doublings
        link.send(frame(4, payload))
        arrived = data_pb2.Frame.FromString(got.frames.get(timeout=30))
        assert arrived.frame_id == 4 and arrived.hidden.data == payload
        link.close()
    finally:
        server.close()


def test_stage0_refuses_forward_links_and_takes_return_links() -> None:
    server, got = serve(forward_refusal=STAGE0_FORWARD_REFUSAL)
    try:
        with pytest.raises(Unavailable, match="takes no Forward frames"):
            TcpLink(endpoint(server), KIND_FORWARD, lambda e: None, security=MeshSecurity())
        link = TcpLink(endpoint(server), KIND_RETURN, lambda e: None, security=MeshSecurity())
        link.send(data_pb2.FrameResult(term=2, frame_id=11))
        assert data_pb2.FrameResult.FromString(got.results.get(timeout=10)).frame_id == 11
        link.close()
    finally:
        server.close()


# ---- the gRPC streams ----------------------------------------------------------------


@pytest.fixture
def grpc_stage(tmp_path: Path) -> Iterator[tuple[str, DataServicer]]:
    """A stage's data service on a real gRPC server with threads to spare."""
    node = StageNode(NodeSettings(node_id="n", cache_dir=tmp_path), "127.0.0.1:1")
    server = new_server(16, MeshSecurity())
    data = DataServicer(node, lambda _: None)
    data_pb2_grpc.add_StageDataServicer_to_server(data, server)
    port = bind(server, "127.0.0.1:0", MeshSecurity())
    server.start()
    try:
        yield f"127.0.0.1:{port}", data
    finally:
        server.stop(None)
        node.stop()


class Held:
    """A client stream kept open until ``close``."""

    def __init__(self) -> None:
        self._done = False

    def __iter__(self):
        while not self._done:
            time.sleep(0.02)
        return
        yield

    def close(self) -> None:
        self._done = True


@pytest.mark.parametrize("kind", ["Forward", "Return"])
def test_streams_past_the_cap_are_refused_until_one_closes(
    grpc_stage, kind: str, monkeypatch
) -> None:
    address, data = grpc_stage
    ch = channel(address, MeshSecurity())
    stub = data_pb2_grpc.StageDataStub(ch)
    monkeypatch.setitem(servicers.MAX_STREAMS, kind, 4)
    call = stub.Forward if kind == "Forward" else stub.Return.future
    held = [Held() for _ in range(4)]
    calls = [call(iter(h), timeout=30) for h in held]
    try:
        wait_for(lambda: data._open[kind] == 4)
        extra = Held()
        with pytest.raises(grpc.RpcError) as refused:
            answer = call(iter(extra), timeout=30)
            next(answer) if kind == "Forward" else answer.result()
        extra.close()
        assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"4 {kind} streams open" in refused.value.details()
        held[0].close()
        if kind == "Return":
            calls[0].result(timeout=10)
        else:
            assert list(calls[0]) == []
        wait_for(lambda: data._open[kind] == 3)
        again = Held()
        calls.append(call(iter(again), timeout=30))
        held.append(again)
        wait_for(lambda: data._open[kind] == 4)
    finally:
        for h in held:
            h.close()
        ch.close()
    wait_for(lambda: data._open[kind] == 0)


def test_stage0_refuses_grpc_forward_streams(grpc_stage) -> None:
    address, data = grpc_stage
    data.forward_refusal = STAGE0_FORWARD_REFUSAL
    ch = channel(address, MeshSecurity())
    try:
        with pytest.raises(grpc.RpcError) as refused:
            next(data_pb2_grpc.StageDataStub(ch).Forward(iter([]), timeout=10))
        assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert "takes no Forward frames" in refused.value.details()
        assert data._open["Forward"] == 0
    finally:
        ch.close()
