"""The load driver while a stage hangs in Load (a stopped process, a swapping host,
a hung device call): the attempt ends as soon as ``abort`` names a reason, instead
of holding the fenced stages for the Load deadline (600 s), and every stage is
released at once, the hung one not delaying the others. Real gRPC servers on
loopback, whose control service answers as a stage does."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from coordinator.driver import RELEASE_DEADLINE_S, LoadDriver, LoadError, LoadSettings
from coordinator.planner import Plan, StageAssignment
from mesh.codec import ClaimReply, InventoryReply, PrepareReply, Ready, ReleaseReply
from mesh.grpc_util import bind, new_server
from mesh.proto.v1 import stage_pb2_grpc
from mesh.types import LayerRange


class FakeStage(stage_pb2_grpc.StageControlServicer):
    """A stage whose slice is always ready; ``hang`` holds Load (and Release) until
    ``wake`` is set."""

    def __init__(self, layers: LayerRange, hang: bool) -> None:
        self.layers = layers
        self.hang = hang
        self.wake = threading.Event()
        self.calls: list[str] = []
        self.refuse = ""

    def _held(self) -> None:
        if self.hang:
            self.wake.wait(60)

    def Claim(self, request, context):
        self.calls.append("Claim")
        return ClaimReply(request.term, "n").to_proto()

    def Prepare(self, request, context):
        self.calls.append("Prepare")
        return PrepareReply(request.term).to_proto()

    def Inventory(self, request, context):
        self.calls.append("Inventory")
        return InventoryReply(request.term, "ready", "pkg", self.layers).to_proto()

    def Load(self, request, context):
        self.calls.append("Load")
        if self.refuse:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, self.refuse)
        self._held()
        return Ready(request.term, "127.0.0.1:1").to_proto()

    def Release(self, request, context):
        self.calls.append("Release")
        self._held()
        return ReleaseReply(request.term).to_proto()


@pytest.fixture()
def stages():
    servers, fakes, assignments = [], [], []
    for index, (start, end) in enumerate([(0, 2), (2, 4), (4, 6)]):
        fake = FakeStage(LayerRange(start, end), hang=index == 1)
        server = new_server(4)
        stage_pb2_grpc.add_StageControlServicer_to_server(fake, server)
        port = bind(server, "127.0.0.1:0")
        server.start()
        servers.append(server)
        fakes.append(fake)
        assignments.append(
            StageAssignment(f"n{index}", f"127.0.0.1:{port}", index, LayerRange(start, end), 0)
        )
    yield fakes, Plan(tuple(assignments))
    for fake in fakes:
        fake.wake.set()
    for server in servers:
        server.stop(0)


def test_a_stage_that_hangs_in_load_ends_the_attempt_when_abort_says_so(stages) -> None:
    fakes, plan = stages
    driver = LoadDriver("coord", lambda node_id: "cpu")
    settings = LoadSettings("pkg", "", "tiny", inventory_poll_s=0.01)
    asked: list[float] = []
    started = time.monotonic()

    def abort() -> str | None:
        asked.append(time.monotonic() - started)
        # The hung stage's heartbeats stop: it is found lost after a while.
        return "node(s) n1 were lost while loading" if len(asked) >= 4 else None

    with pytest.raises(LoadError) as error:
        driver.load(plan, 7, settings, abort)
    took = time.monotonic() - started
    assert error.value.step == "Abort" and "n1 were lost" in error.value.message
    # Loads run from the last stage upstream: the last loaded, the hung one was
    # asked, stage 0 never was; every stage was released.
    assert fakes[2].calls[-2:] == ["Load", "Release"]
    assert fakes[1].calls[-2:] == ["Load", "Release"]
    assert "Load" not in fakes[0].calls and fakes[0].calls[-1] == "Release"
    # No Load deadline was waited out, and the hung stage's Release did not hold
    # the others: the attempt ended within the abort checks and one Release deadline.
    assert took < 4 * 0.25 + RELEASE_DEADLINE_S + 5.0


def test_without_a_reason_to_abort_a_slow_load_is_waited_for(stages) -> None:
    fakes, plan = stages
    driver = LoadDriver("coord", lambda node_id: "cpu")
    settings = LoadSettings("pkg", "", "tiny", inventory_poll_s=0.01)
    threading.Timer(1.0, fakes[1].wake.set).start()
    outcome = driver.load(plan, 7, settings, lambda: None)
    assert outcome.term == 7 and len(outcome.ready) == 3
    assert all(fake.calls.count("Load") == 1 for fake in fakes)


def test_a_call_that_fails_is_still_a_load_error_of_its_step(stages) -> None:
    fakes, plan = stages
    fakes[2].refuse = "dtype 'int3' is not supported"
    driver = LoadDriver("coord", lambda node_id: "cpu")
    settings = LoadSettings("pkg", "", "tiny", inventory_poll_s=0.01)
    with pytest.raises(LoadError) as error:
        driver.load(plan, 7, settings, lambda: None)
    assert error.value.step == "Load" and error.value.stage.node_id == "n2"
    assert "int3" in error.value.message
