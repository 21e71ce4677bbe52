"""Framed TCP data links (stage/tcp_data.py): real sockets on 127.0.0.1, real TLS."""

from __future__ import annotations

import queue
import socket
import struct
import threading
import time
from pathlib import Path

import pytest

from coordinator.certs import generate_cluster_certs
from mesh.errors import Unavailable
from mesh.proto.v1 import data_pb2
from mesh.security import REFUSED_MESSAGE, MeshSecurity
from stage import tcp_data
from stage.tcp_data import KIND_FORWARD, KIND_RETURN, TcpDataServer, TcpLink

TOKEN = "a-join-token-of-enough-length-0123456789"


class Received:
    """What a server's handlers got, per kind, in order."""

    def __init__(self) -> None:
        self.frames: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self.results: queue.SimpleQueue[bytes] = queue.SimpleQueue()


def serve(
    security: MeshSecurity = MeshSecurity(), *, on_frame=None, on_result=None, **options
) -> tuple[TcpDataServer, Received]:
    """A started server on 127.0.0.1; ``options`` go to ``TcpDataServer``."""
    got = Received()
    server = TcpDataServer(
        "127.0.0.1",
        0,
        on_frame or got.frames.put,
        on_result or got.results.put,
        security=security,
        **options,
    ).start()
    return server, got


def endpoint(server: TcpDataServer) -> str:
    return f"127.0.0.1:{server.port}"


def frame(frame_id: int, payload: bytes = b"") -> data_pb2.Frame:
    message = data_pb2.Frame(term=3, frame_id=frame_id)
    message.hidden.data = payload
    return message


def wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.01)


def test_frames_and_results_arrive_whole_and_in_order() -> None:
    server, got = serve()
    broken: list[Exception] = []
    forward = TcpLink(endpoint(server), KIND_FORWARD, broken.append, security=MeshSecurity())
    returns = TcpLink(endpoint(server), KIND_RETURN, broken.append, security=MeshSecurity())
    try:
        sent = [frame(i, bytes([i % 251]) * (i * 9973)) for i in range(40)]
        for message in sent:
            forward.send(message)
        returns.send(data_pb2.FrameResult(term=3, frame_id=7))
        for message in sent:
            assert data_pb2.Frame.FromString(got.frames.get(timeout=10)) == message
        assert data_pb2.FrameResult.FromString(got.results.get(timeout=10)).frame_id == 7
        assert not forward.broken and not returns.broken and not broken
    finally:
        forward.close()
        returns.close()
        server.close()


def test_several_threads_sending_on_one_link_never_interleave_messages() -> None:
    server, got = serve()
    link = TcpLink(endpoint(server), KIND_FORWARD, lambda e: None, security=MeshSecurity())
    try:

        def send_many(base: int) -> None:
            for i in range(50):
                link.send(frame(base + i, bytes([base % 256]) * 50_000))

        threads = [threading.Thread(target=send_many, args=(b * 1000,)) for b in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        ids = sorted(
            data_pb2.Frame.FromString(got.frames.get(timeout=10)).frame_id for _ in range(200)
        )
        assert ids == sorted(b * 1000 + i for b in range(4) for i in range(50))
    finally:
        link.close()
        server.close()


def test_a_wrong_or_missing_join_token_is_refused_and_the_right_one_accepted() -> None:
    server, got = serve(MeshSecurity(join_token=TOKEN))
    try:
        for presented in (MeshSecurity(), MeshSecurity(join_token=TOKEN[:-1] + "X")):
            with pytest.raises(Unavailable, match="join token") as refused:
                TcpLink(endpoint(server), KIND_FORWARD, lambda e: None, security=presented)
            assert REFUSED_MESSAGE in str(refused.value)
        link = TcpLink(
            endpoint(server), KIND_FORWARD, lambda e: None, security=MeshSecurity(join_token=TOKEN)
        )
        link.send(frame(1))
        assert data_pb2.Frame.FromString(got.frames.get(timeout=10)).frame_id == 1
        link.close()
    finally:
        server.close()


def test_a_connection_that_is_not_a_mesh_link_is_refused_and_the_server_carries_on() -> None:
    server, got = serve()
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            status = sock.recv(1)
            assert status == bytes([tcp_data.REFUSED])
            (size,) = struct.unpack("<H", sock.recv(2))
            assert b"not a mesh data link" in sock.recv(size)
        link = TcpLink(endpoint(server), KIND_RETURN, lambda e: None, security=MeshSecurity())
        link.send(data_pb2.FrameResult(frame_id=5))
        assert data_pb2.FrameResult.FromString(got.results.get(timeout=10)).frame_id == 5
        link.close()
    finally:
        server.close()


def test_a_message_over_the_limit_closes_that_link_only() -> None:
    server, got = serve(max_message_bytes=10_000)
    broken: list[Exception] = []
    big = TcpLink(endpoint(server), KIND_FORWARD, broken.append, security=MeshSecurity())
    small = TcpLink(endpoint(server), KIND_FORWARD, lambda e: None, security=MeshSecurity())
    try:
        big.send(frame(1, b"x" * 20_000))
        wait_for(lambda: big.broken)
        assert broken and "ended" in str(broken[0])
        with pytest.raises(Unavailable, match="down"):
            big.send(frame(2))
        small.send(frame(3, b"y" * 100))
        assert data_pb2.Frame.FromString(got.frames.get(timeout=10)).frame_id == 3
        assert got.frames.empty()
    finally:
        big.close()
        small.close()
        server.close()


def test_a_link_notices_its_peer_going_away_without_sending() -> None:
    server, _ = serve()
    broken: list[Exception] = []
    link = TcpLink(endpoint(server), KIND_FORWARD, broken.append, security=MeshSecurity())
    server.close()
    wait_for(lambda: link.broken)
    assert len(broken) == 1
    with pytest.raises(Unavailable):
        link.send(frame(1))
    link.close()


def test_closing_a_link_is_not_reported_as_broken() -> None:
    server, _ = serve()
    broken: list[Exception] = []
    link = TcpLink(endpoint(server), KIND_FORWARD, broken.append, security=MeshSecurity())
    link.close()
    time.sleep(1.5)
    assert not broken and not link.broken
    server.close()


def test_a_peer_that_stops_reading_breaks_the_link_after_the_send_timeout(monkeypatch) -> None:
    monkeypatch.setattr(tcp_data, "SEND_TIMEOUT_S", 0.5)
    release = threading.Event()
    server, _ = serve(on_frame=lambda body: release.wait(30))
    broken: list[Exception] = []
    link = TcpLink(endpoint(server), KIND_FORWARD, broken.append, security=MeshSecurity())
    try:
        with pytest.raises(Unavailable, match="took nothing"):
            for i in range(1000):  # the socket buffers fill, then a send times out
                link.send(frame(i, b"z" * 1_000_000))
        assert link.broken and broken
    finally:
        release.set()
        link.close()
        server.close()


def test_an_injected_delay_holds_each_message_back() -> None:
    server, got = serve()
    link = TcpLink(
        endpoint(server), KIND_RETURN, lambda e: None, delay_s=0.2, security=MeshSecurity()
    )
    try:
        started = time.monotonic()
        link.send(data_pb2.FrameResult(frame_id=1))
        got.results.get(timeout=10)
        assert time.monotonic() - started >= 0.2
    finally:
        link.close()
        server.close()


def test_nothing_listens_gives_a_clear_error() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(Unavailable, match="cannot reach"):
        TcpLink(f"127.0.0.1:{port}", KIND_FORWARD, lambda e: None, security=MeshSecurity())


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> tuple[Path, Path, Path]:
    out = tmp_path_factory.mktemp("certs")
    made = generate_cluster_certs(out, ("127.0.0.1",))
    return made.ca_cert, made.nodes[0].cert, made.nodes[0].key


@pytest.mark.parametrize("mutual", [False, True])
def test_tls_links_carry_messages_and_plaintext_senders_fail(certs, mutual: bool) -> None:
    ca, cert, key = certs
    tls = MeshSecurity(join_token=TOKEN, tls_cert=cert, tls_key=key, tls_ca=ca, tls_mutual=mutual)
    server, got = serve(tls)
    assert server.tls
    try:
        link = TcpLink(endpoint(server), KIND_FORWARD, lambda e: None, tls=True, security=tls)
        link.send(frame(9, b"secret" * 1000))
        assert data_pb2.Frame.FromString(got.frames.get(timeout=10)).frame_id == 9
        link.close()
        with pytest.raises(Unavailable):
            TcpLink(
                endpoint(server),
                KIND_FORWARD,
                lambda e: None,
                security=MeshSecurity(join_token=TOKEN),
            )
        if mutual:  # no client certificate: refused by the TLS handshake
            without_cert = MeshSecurity(join_token=TOKEN, tls_ca=ca)
            with pytest.raises(Unavailable):
                probe = TcpLink(
                    endpoint(server), KIND_FORWARD, lambda e: None, tls=True, security=without_cert
                )
                probe.send(frame(10))
                time.sleep(0.5)
                probe.send(frame(11))
        assert got.frames.empty()
    finally:
        server.close()


def test_a_sender_checks_the_listener_certificate(certs, tmp_path: Path) -> None:
    ca, cert, key = certs
    server, _ = serve(MeshSecurity(tls_cert=cert, tls_key=key, tls_ca=ca))
    other = generate_cluster_certs(tmp_path / "other", ("127.0.0.1",))
    try:
        with pytest.raises(Unavailable, match="certificate"):
            TcpLink(
                endpoint(server),
                KIND_FORWARD,
                lambda e: None,
                tls=True,
                security=MeshSecurity(tls_ca=other.ca_cert),
            )
    finally:
        server.close()


def test_the_listener_reports_a_port_in_use() -> None:
    server, _ = serve()
    try:
        with pytest.raises(Unavailable, match="data-port"):
            TcpDataServer("127.0.0.1", server.port, lambda b: None, lambda b: None)
    finally:
        server.close()


@pytest.mark.parametrize("tls", [False, True])
def test_a_reachability_check_is_not_logged_as_a_link_that_ended(certs, tls: bool, caplog) -> None:
    """The coordinator checks a stage's data port with a bare connect and close before
    it plans the stage in: no link, so no "data link ... ended" line (with TLS it
    used to log an SSL EOF error at every coordinator start)."""
    ca, cert, key = certs
    security = MeshSecurity(tls_cert=cert, tls_key=key, tls_ca=ca) if tls else MeshSecurity()
    server, got = serve(security)
    try:
        with caplog.at_level("DEBUG", logger="stage.tcp_data"):
            socket.create_connection(("127.0.0.1", server.port), timeout=5).close()
            wait_for(lambda: "closed before its hello" in caplog.text)
            link = TcpLink(
                endpoint(server), KIND_RETURN, lambda e: None, tls=tls, security=security
            )
            link.send(data_pb2.FrameResult(frame_id=6))
            assert data_pb2.FrameResult.FromString(got.results.get(timeout=10)).frame_id == 6
            link.close()
            wait_for(lambda: "ended" in caplog.text)
        closed = [r for r in caplog.records if "closed before its hello" in r.getMessage()]
        assert [r.levelname for r in closed] == ["DEBUG"]
        ended = [r for r in caplog.records if "ended" in r.getMessage()]
        assert ended and all(r.levelname == "INFO" for r in ended)
    finally:
        server.close()


@pytest.mark.parametrize("tls", [False, True])
def test_ending_the_links_of_a_kind_closes_them_for_their_senders(certs, tls: bool) -> None:
    """A stage whose own Forward link broke ends the Forward links that bring it
    frames (``end_links``), so that the break travels up to stage 0 at once. With
    TLS it used to shut the raw socket down, whose descriptor the TLS socket had
    taken over: nothing closed, and stage 0 saw no break (its /health said 200)."""
    ca, cert, key = certs
    security = MeshSecurity(tls_cert=cert, tls_key=key, tls_ca=ca) if tls else MeshSecurity()
    server, got = serve(security)
    try:
        broken: queue.SimpleQueue[Exception] = queue.SimpleQueue()
        forward = TcpLink(endpoint(server), KIND_FORWARD, broken.put, tls=tls, security=security)
        returns = TcpLink(endpoint(server), KIND_RETURN, broken.put, tls=tls, security=security)
        forward.send(frame(1))
        assert data_pb2.Frame.FromString(got.frames.get(timeout=10)).frame_id == 1
        assert server.end_links(KIND_FORWARD, "the stage after this one is gone") == 1
        assert isinstance(broken.get(timeout=10), Unavailable)
        assert forward.broken and not returns.broken
        returns.send(data_pb2.FrameResult(frame_id=2))
        assert data_pb2.FrameResult.FromString(got.results.get(timeout=10)).frame_id == 2
        returns.close()
    finally:
        server.close()
