"""One node id, two processes: the id belongs to the process that joined last, and
goes back to the other once that one is dead. A real coordinator service over gRPC
and two stages' membership loops."""

from __future__ import annotations

import time

from polling import wait_until

from coordinator import registry
from coordinator.driver import LoadSettings
from coordinator.model import read_model
from coordinator.server import CoordinatorService, CoordinatorSettings, serve
from mesh.codec import HeartbeatRequest, JoinRequest
from stage.membership import Membership


def member(coordinator: str, address: str, taken: list[str]) -> Membership:
    return Membership(
        coordinator,
        lambda: JoinRequest(node_id="worker", address=address, device="cpu", memory_bytes=1),
        lambda: HeartbeatRequest(node_id="worker", term=0, state="idle"),
        on_superseded=taken.append,
    )


def test_a_second_process_with_the_same_node_id_takes_it_and_gives_it_back_at_death(
    tiny_package_factory,
) -> None:
    package = tiny_package_factory("llama", layers=2)
    model = read_model(str(package))
    settings = CoordinatorSettings(
        load=LoadSettings(str(package), model.manifest.sha256(), model.manifest.model_id),
        heartbeat_interval_s=0.1,
    )
    service = CoordinatorService(model, settings)
    server, port = serve(service, "127.0.0.1:0")
    first_taken: list[str] = []
    second_taken: list[str] = []
    first = member(f"127.0.0.1:{port}", "127.0.0.1:1111", first_taken)
    second = member(f"127.0.0.1:{port}", "127.0.0.1:2222", second_taken)
    try:
        first.start()
        assert first.joined.wait(10)
        assert service.state.node("worker").address == "127.0.0.1:1111"
        second.start()
        assert second.joined.wait(10)
        # The first learns from its next heartbeat that the id was taken (once).
        assert wait_until(lambda: first.superseded_by == "127.0.0.1:2222", 10)
        time.sleep(0.5)
        assert first_taken == ["127.0.0.1:2222"] and not second_taken
        # The node is the second process's; the first's beats are answered, not
        # counted: with the second stopped, the node's last heartbeat stays put.
        assert service.state.node("worker").address == "127.0.0.1:2222"
        second.stop()
        assert wait_until(lambda: not second._thread.is_alive(), 5)  # noqa: SLF001
        before = service.state.node("worker").last_heartbeat_at
        time.sleep(0.5)
        assert service.state.node("worker").last_heartbeat_at == before
        assert service.state.node("worker").health == "alive"
        # Once the coordinator finds the node dead, the first joins again and the
        # node is its own.
        service.apply(registry.HeartbeatsChecked(now=time.monotonic(), timeout_s=0.25))
        assert wait_until(lambda: service.state.node("worker").address == "127.0.0.1:1111", 10)
        assert wait_until(lambda: service.state.node("worker").health == "alive", 5)
        assert wait_until(lambda: first.superseded_by == "", 5)
        # A beat that names no address (an older stage) is counted as before.
        reply = service.heartbeat(HeartbeatRequest(node_id="worker", term=0, state="idle"))
        assert reply.known and not reply.superseded_by
    finally:
        first.stop()
        second.stop()
        server.stop(0)
