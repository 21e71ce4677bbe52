"""A stage that found its coordinator by LAN discovery finds it again when it comes
back at another address: real coordinator services over gRPC on two loopback
addresses, real discovery over UDP, the stage's membership loop."""

from __future__ import annotations

import socket
import time

import pytest
from polling import wait_until

from coordinator.driver import LoadSettings
from coordinator.model import read_model
from coordinator.server import CoordinatorService, CoordinatorSettings, serve
from mesh.codec import HeartbeatRequest, JoinRequest
from mesh.discovery import DiscoveryResponder, rediscover
from stage import membership
from stage.membership import Membership

TOKEN = "a-join-token-for-relocation-0123456789"


def free_port(hosts: tuple[str, ...]) -> int:
    """A port free for TCP and UDP on every host in ``hosts``."""
    for _ in range(50):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((hosts[0], 0))
            port = probe.getsockname()[1]
        try:
            for host in hosts:
                for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM):
                    with socket.socket(socket.AF_INET, kind) as sock:
                        sock.bind((host, port))
        except OSError:
            continue
        return port
    raise RuntimeError("no common free port")


def coordinator_at(package, host: str, port: int):
    model = read_model(str(package))
    settings = CoordinatorSettings(
        load=LoadSettings(str(package), model.manifest.sha256(), model.manifest.model_id),
        heartbeat_interval_s=0.2,
    )
    service = CoordinatorService(model, settings)
    server, bound = serve(service, f"{host}:{port}")
    assert bound == port
    responder = DiscoveryResponder(
        host, port, lambda: model.manifest.model_id, "", False, TOKEN, service.coordinator_id
    )
    assert responder.start()
    return service, server, responder


def test_a_discovered_coordinator_that_moves_is_joined_at_its_new_address(
    tiny_package_factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(membership, "RELOCATE_AFTER_S", 0.5)
    package = tiny_package_factory("llama", layers=2)
    hosts = ("127.0.0.2", "127.0.0.3")
    port = free_port(hosts)
    first, first_server, first_responder = coordinator_at(package, hosts[0], port)
    moves: list[str] = []
    searches: list[str | None] = []

    def relocate() -> str | None:
        found = rediscover(port, TOKEN, targets=list(hosts), wait_s=0.5)
        searches.append(found)
        return found

    member = Membership(
        f"{hosts[0]}:{port}",
        lambda: JoinRequest(node_id="worker", address="127.0.0.1:1", device="cpu", memory_bytes=1),
        lambda: HeartbeatRequest(node_id="worker", term=0, state="idle"),
        relocate=relocate,
        on_moved=moves.append,
    )
    member.start()
    second = None
    try:
        assert member.joined.wait(10)
        assert first.state.is_known("worker")
        # While the coordinator answers, nothing is looked for.
        time.sleep(1.0)
        assert searches == []
        # It goes away; it comes back on another address of the network.
        first_server.stop(0)
        first_responder.stop()
        second, second_server, second_responder = coordinator_at(package, hosts[1], port)
        assert wait_until(lambda: second.state.is_known("worker"), 15), searches
        assert moves == [f"{hosts[1]}:{port}"]
        assert member.coordinator == f"{hosts[1]}:{port}"
        assert searches[-1] == f"{hosts[1]}:{port}"
        # It keeps heartbeating there.
        beat = second.state.node("worker").last_heartbeat_at
        assert wait_until(lambda: second.state.node("worker").last_heartbeat_at > beat, 5)
    finally:
        member.stop()
        if second is not None:
            second_server.stop(0)
            second_responder.stop()


def test_without_discovery_a_stage_keeps_to_its_address(
    tiny_package_factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stage given --coordinator HOST:PORT never looks elsewhere, however long the
    outage (another coordinator answering discovery is not its coordinator)."""
    monkeypatch.setattr(membership, "RELOCATE_AFTER_S", 0.2)
    package = tiny_package_factory("llama", layers=2)
    hosts = ("127.0.0.2", "127.0.0.3")
    port = free_port(hosts)
    other, other_server, other_responder = coordinator_at(package, hosts[1], port)
    member = Membership(
        f"{hosts[0]}:{port}",
        lambda: JoinRequest(node_id="worker", address="127.0.0.1:1", device="cpu", memory_bytes=1),
        lambda: HeartbeatRequest(node_id="worker", term=0, state="idle"),
    )
    member.start()
    try:
        time.sleep(2.0)
        assert not member.joined.is_set() and not other.state.is_known("worker")
        assert member.coordinator == f"{hosts[0]}:{port}"
    finally:
        member.stop()
        other_server.stop(0)
        other_responder.stop()


def worker_member(coordinator: str, heartbeat) -> Membership:
    """The membership of a node "worker" that reports what ``heartbeat`` says."""
    return Membership(
        coordinator,
        lambda: JoinRequest(node_id="worker", address="127.0.0.1:1", device="cpu", memory_bytes=1),
        heartbeat,
    )


def test_a_heartbeat_that_raises_does_not_end_the_heartbeats(
    tiny_package_factory, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A bug or a race in what a beat reports (the node's tables read while a release
    runs, say) costs that beat, not the thread: before, the exception ended the
    membership thread silently and the coordinator took the live stage for dead."""
    monkeypatch.setattr(membership, "RETRY_FIRST_S", 0.1)
    package = tiny_package_factory("llama", layers=2)
    host = "127.0.0.2"
    port = free_port((host,))
    service, server, responder = coordinator_at(package, host, port)
    calls = {"n": 0}

    def heartbeat() -> HeartbeatRequest:
        calls["n"] += 1
        if calls["n"] in (2, 3):
            raise RuntimeError("dictionary changed size during iteration")
        return HeartbeatRequest(node_id="worker", term=0, state="idle")

    member = worker_member(f"{host}:{port}", heartbeat)
    member.start()
    try:
        assert member.joined.wait(10)
        assert wait_until(lambda: calls["n"] >= 6, 30), calls
        beat = service.state.node("worker").last_heartbeat_at
        assert wait_until(lambda: service.state.node("worker").last_heartbeat_at > beat, 10)
        assert "dictionary changed size during iteration" in caplog.text
    finally:
        member.stop()
        server.stop(0)
        responder.stop()


def test_pokes_however_many_do_not_turn_the_heartbeat_into_a_flood(tiny_package_factory) -> None:
    """Each frame of a newer term pokes the membership for a heartbeat now; a peer
    streaming such frames made one heartbeat per frame. At most one per
    MIN_BEAT_GAP_S follows, however many pokes come."""
    import time

    package = tiny_package_factory("llama", layers=2)
    host = "127.0.0.2"
    port = free_port((host,))
    service, server, responder = coordinator_at(package, host, port)
    beats = {"n": 0}

    def heartbeat() -> HeartbeatRequest:
        beats["n"] += 1
        return HeartbeatRequest(node_id="worker", term=0, state="idle")

    member = worker_member(f"{host}:{port}", heartbeat)
    member.start()
    try:
        assert member.joined.wait(10)
        assert wait_until(lambda: beats["n"] >= 1, 10)
        start, before = time.monotonic(), beats["n"]
        while time.monotonic() - start < 2.0:
            member.poke()
            time.sleep(0.001)
        elapsed = time.monotonic() - start
        assert beats["n"] - before <= elapsed / membership.MIN_BEAT_GAP_S + 2
        assert beats["n"] - before >= 3  # yet sooner than the 1 Hz a stage beats at unpoked
    finally:
        member.stop()
        server.stop(0)
        responder.stop()
