"""The coordinator's supervision thread outlives an exception in one pass: before,
one unexpected error ended it silently, and no stage was ever found dead (or
stalled) again, no load retried."""

from __future__ import annotations

import time

import pytest

from coordinator.driver import LoadSettings
from coordinator.model import read_model
from coordinator.server import CoordinatorService, CoordinatorSettings
from mesh.codec import HeartbeatRequest, JoinRequest


def test_supervision_goes_on_after_a_pass_raises(
    tiny_package_factory, caplog: pytest.LogCaptureFixture
) -> None:
    package = tiny_package_factory("llama", layers=2)
    model = read_model(str(package))
    settings = CoordinatorSettings(
        load=LoadSettings(str(package), model.manifest.sha256(), model.manifest.model_id),
        heartbeat_timeout_s=0.5,
        supervise_interval_s=0.05,
        min_stages=2,  # one node never loads: only the heartbeat checks run
    )
    service = CoordinatorService(model, settings)
    passes = {"n": 0}
    real = service._should_load

    def flaky(state):
        passes["n"] += 1
        if passes["n"] <= 3:
            raise RuntimeError("an unexpected error in one pass")
        return real(state)

    service._should_load = flaky
    service.start()
    try:
        service.join(JoinRequest(node_id="w", address="127.0.0.1:1", device="cpu", memory_bytes=1))
        service.heartbeat(HeartbeatRequest(node_id="w", term=0, state="idle"))
        deadline = time.monotonic() + 10
        while service.state.node("w").health != "dead":
            assert time.monotonic() < deadline, (passes, service.state.node("w"))
            time.sleep(0.05)
        assert passes["n"] > 3
        assert "supervision pass failed" in caplog.text
    finally:
        service.stop()


def test_a_state_file_that_cannot_be_written_does_not_stop_a_load(
    tiny_package_factory, caplog: pytest.LogCaptureFixture
) -> None:
    """A full or read-only disk on the head: the term cannot be recorded, and the
    load goes on (before, the error ended the attempt before any stage heard of it,
    every attempt again: a mesh that lost a stage never served again)."""
    package = tiny_package_factory("llama", layers=2)
    model = read_model(str(package))
    settings = CoordinatorSettings(
        load=LoadSettings(str(package), model.manifest.sha256(), model.manifest.model_id)
    )

    def full_disk(term: int) -> None:
        raise OSError(28, "No space left on device")

    service = CoordinatorService(model, settings, on_term=full_disk)
    service._unreachable = lambda plan, state: []  # nobody listens: loaded all the same
    service.join(
        JoinRequest(
            node_id="head",
            address="127.0.0.1:1",
            device="cpu",
            memory_bytes=8 << 30,
            frontend=True,
        )
    )
    service._load_once()
    assert service.state.term == 1  # the load started (and failed: nobody listens there)
    assert "cannot record term 1 in the state file" in caplog.text


def test_the_grace_after_a_pause_covers_a_stage_s_longest_retry_wait() -> None:
    """After its own pause the coordinator waits a heartbeat timeout beyond the longest
    pause a stage makes between failed heartbeats (its heartbeats failed while the
    coordinator was stopped): the two constants must agree."""
    from coordinator import server
    from stage import membership

    assert server.STAGE_RETRY_MAX_S >= membership.RETRY_MAX_S


def test_a_node_the_coordinator_cannot_reach_is_left_out_before_anything_is_claimed(
    tiny_package_factory, caplog: pytest.LogCaptureFixture
) -> None:
    """A node whose advertised address nobody can connect to (a wrong --advertise, a
    firewall): the load that would claim every other stage first never starts; the
    node is quarantined out of plans like a stalled stage. A node that answers is
    loaded onto."""
    from mesh.grpc_util import bind, new_server

    package = tiny_package_factory("llama", layers=2)
    model = read_model(str(package))
    settings = CoordinatorSettings(
        load=LoadSettings(str(package), model.manifest.sha256(), model.manifest.model_id)
    )
    service = CoordinatorService(model, settings)
    join = dict(device="cpu", memory_bytes=8 << 30, frontend=True)
    service.join(JoinRequest(node_id="far", address="127.0.0.1:9", **join))
    service._load_once()
    assert service.state.term == 0  # nothing was claimed
    assert service.state.node("far").health == "stalled"
    assert "node far is left out of plans: cannot connect to its address 127.0.0.1:9" in (
        caplog.text
    )
    server = new_server(1)
    port = bind(server, "127.0.0.1:0")
    server.start()
    try:
        service.join(JoinRequest(node_id="near", address=f"127.0.0.1:{port}", **join))
        service._load_once()
        # The plan skipped the quarantined node; the load started (and failed at
        # Claim: this server has no stage service).
        assert service.state.term == 1
        assert "near" in service.state.error and "far" not in service.state.error
    finally:
        server.stop(0)


@pytest.mark.parametrize(
    ("step", "cause"),
    [
        ("Prepare", "sha256 mismatch in layers/00002.safetensors"),
        ("Claim", "UNIMPLEMENTED: Method not found!"),
    ],
)
def test_a_worker_that_cannot_take_its_slice_is_planned_around_at_once(
    step: str, cause: str, tiny_package_factory, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker's Prepare fails (a corrupt local copy of the package), or its Claim
    (another gRPC service at the address it advertised): the worker is
    quarantined and the next attempt, at once, plans without it (before, the same
    plan was tried again and again with backoff while the mesh served nothing)."""
    from coordinator.driver import LoadError, LoadOutcome
    from mesh.codec import Ready

    package = tiny_package_factory("llama", layers=4)
    model = read_model(str(package))
    settings = CoordinatorSettings(
        load=LoadSettings(str(package), model.manifest.sha256(), model.manifest.model_id)
    )
    service = CoordinatorService(model, settings)
    service._unreachable = lambda plan, state: []
    plans: list[tuple[str, ...]] = []

    class Driver:
        def load(self, plan, term, load, abort=None):
            plans.append(tuple(s.node_id for s in plan.stages))
            bad = [s for s in plan.stages if s.node_id == "corrupt"]
            if bad:
                raise LoadError(bad[0], step, cause)
            return LoadOutcome(term, tuple(Ready(term, "x:1") for _ in plan.stages))

    service._driver = Driver()
    memory = dict(device="cpu", memory_bytes=8 << 30)
    service.join(JoinRequest(node_id="head", address="127.0.0.1:1", frontend=True, **memory))
    service.join(JoinRequest(node_id="corrupt", address="127.0.0.1:2", **memory))
    service._load_once()
    assert plans == [("head", "corrupt")]
    assert service.state.node("corrupt").health == "stalled"
    assert f"node corrupt is left out of plans: its load failed at {step}" in caplog.text
    assert service._last_attempt == 0.0  # the next attempt comes at once
    service._load_once()
    assert plans[-1] == ("head",) and service.state.mesh_state == "serving"


def _service(tiny_package_factory, **settings) -> CoordinatorService:
    """A coordinator service over a 6-layer tiny package that reaches every node."""
    package = tiny_package_factory("llama", layers=6)
    model = read_model(str(package))
    load = LoadSettings(str(package), model.manifest.sha256(), model.manifest.model_id)
    service = CoordinatorService(model, CoordinatorSettings(load=load, **settings))
    service._unreachable = lambda plan, state: []
    return service


@pytest.mark.parametrize(("link", "blamed"), [("forward", "w1"), ("return", "w2")])
def test_a_data_link_that_cannot_be_opened_is_held_against_the_node_it_was_to_reach(
    link: str, blamed: str, tiny_package_factory, caplog: pytest.LogCaptureFixture
) -> None:
    """A firewall drops a worker's data port while its control port answers. Stage 0
    fails at Load because its forward link cannot reach w1: w1 is left out, not the
    stage that could not reach it (stage 0 is never left out, and the same plan would
    fail again for as long as the firewall stays). A last stage that cannot reach
    stage 0 is itself left out. ``--min-stages`` counts the quarantined node as
    joined, so the first load goes ahead without it."""
    from coordinator.driver import LoadError, LoadOutcome
    from mesh.codec import Ready

    service = _service(tiny_package_factory, min_stages=3)
    plans: list[tuple[str, ...]] = []

    class Driver:
        def load(self, plan, term, load, abort=None):
            nodes = tuple(s.node_id for s in plan.stages)
            plans.append(nodes)
            if blamed in nodes:
                failing = plan.stages[0] if link == "forward" else plan.stages[-1]
                cause = "forward link: cannot reach 10.0.0.2:7072 within 10s: timed out"
                raise LoadError(failing, "Load", cause, unreachable_link=link)
            return LoadOutcome(term, tuple(Ready(term, "x:1") for _ in plan.stages))

    service._driver = Driver()
    memory = dict(device="cpu", memory_bytes=8 << 30)
    service.join(JoinRequest(node_id="head", address="127.0.0.1:1", frontend=True, **memory))
    service.join(JoinRequest(node_id="w1", address="127.0.0.1:2", **memory))
    service.join(JoinRequest(node_id="w2", address="127.0.0.1:3", **memory))
    service._load_once()
    assert plans == [("head", "w1", "w2")]
    assert service.state.node(blamed).health == "stalled"
    assert service.state.node("head").health == "alive"
    if link == "forward":
        assert "node w1 is left out of plans: stage 0 could not open its data link" in caplog.text
    assert service._last_attempt == 0.0
    assert service._should_load(service.state)  # 2 alive + 1 quarantined: --min-stages 3
    service._load_once()
    assert blamed not in plans[-1] and service.state.mesh_state == "serving"


class _Driver:
    """Records the load driver's calls; ``ahead`` decides what stage_ahead does."""

    def __init__(self, ahead=None) -> None:
        self.calls: list[tuple] = []
        self.ahead = ahead
        self.busy = False

    def load(self, plan, term, load, abort=None):
        from coordinator.driver import LoadOutcome
        from mesh.codec import Ready

        self.calls.append(("load", term, plan.node_ids()))
        return LoadOutcome(term, tuple(Ready(term, "x:1") for _ in plan.stages))

    def claim_if_idle(self, stage0, term, load):
        from coordinator.driver import LoadError

        self.calls.append(("claim_if_idle", term))
        if self.busy:
            raise LoadError(stage0, "Claim", "node head serves 1 request(s)", busy=True)

    def stage_ahead(self, newcomers, term, moved, serving_term, load, abort):
        self.calls.append(
            ("ahead", term, [s.node_id for s in newcomers], [s.node_id for s in moved])
        )
        if self.ahead is not None:
            self.ahead(newcomers, abort)


def _serving_on_two(tiny_package_factory, driver: _Driver, **settings) -> CoordinatorService:
    package = tiny_package_factory("llama", layers=4)
    model = read_model(str(package))
    load = LoadSettings(str(package), model.manifest.sha256(), model.manifest.model_id)
    service = CoordinatorService(model, CoordinatorSettings(load=load, **settings))
    service._unreachable = lambda plan, state: []
    service._driver = driver
    memory = dict(device="cpu", memory_bytes=8 << 30)
    service.join(JoinRequest(node_id="head", address="127.0.0.1:1", frontend=True, **memory))
    service.join(JoinRequest(node_id="w1", address="127.0.0.1:2", **memory))
    service._load_once()
    assert service.state.mesh_state == "serving" and len(service.state.topology.stages) == 2
    service.join(JoinRequest(node_id="w2", address="127.0.0.1:3", **memory))
    return service


def test_growing_prepares_the_newcomer_s_slice_before_fencing_the_serving_stages(
    tiny_package_factory,
) -> None:
    """A node joins a serving mesh: its slice (and the serving stages' new ranges) are
    prepared first, without a claim on the serving stages; only then the load."""
    driver = _Driver()
    service = _serving_on_two(tiny_package_factory, driver)
    service._load_once(grow_from=2)
    assert [c[0] for c in driver.calls] == ["load", "ahead", "load"]
    _, term, newcomers, moved = driver.calls[1]
    assert term == 2 and newcomers == ["w2"] and "w1" in moved
    assert driver.calls[2] == ("load", 2, ("head", "w1", "w2"))
    assert service.state.term == 2 and service.state.mesh_state == "serving"
    assert service._preparing is None


def test_a_newcomer_that_cannot_prepare_leaves_the_serving_pipeline_untouched(
    tiny_package_factory, caplog: pytest.LogCaptureFixture
) -> None:
    from coordinator.driver import LoadError

    def fail(newcomers, abort):
        raise LoadError(newcomers[0], "Prepare", "sha256 mismatch in layers/00003.safetensors")

    driver = _Driver(fail)
    service = _serving_on_two(tiny_package_factory, driver)
    service._load_once(grow_from=2)
    assert [c[0] for c in driver.calls] == ["load", "ahead"]  # no load: nothing fenced
    assert service.state.term == 1 and service.state.mesh_state == "serving"
    assert service.state.node("w2").health == "stalled"
    assert "node w2 is left out of plans: it could not prepare its slice" in caplog.text
    assert service._preparing is None
    # w2 may hold term 2 (or, restarted, report nothing): it is never used again.
    from coordinator.registry import next_term

    assert next_term(service.state) == 3


def test_losing_a_serving_stage_while_a_newcomer_prepares_ends_the_attempt(
    tiny_package_factory,
) -> None:
    """The wait for a newcomer's slice may be long: the serving stages' heartbeats are
    judged meanwhile, and a lost one ends the attempt at once (its survivors are
    released; the next pass plans from who is left)."""
    from coordinator.driver import LoadError

    def beat(*node_ids: str) -> None:
        for node_id in node_ids:
            service.heartbeat(HeartbeatRequest(node_id=node_id, term=1, state="serving"))

    def lose_w1(newcomers, abort):
        beat("head", "w1", "w2")
        assert abort() is None  # every stage heard from: the wait goes on
        deadline = time.monotonic() + 5
        while (reason := abort()) is None:  # w1 falls silent
            assert time.monotonic() < deadline
            beat("head", "w2")
            time.sleep(0.05)
        reasons.append(reason)
        raise LoadError(None, "Abort", reason)

    reasons: list[str] = []
    driver = _Driver(lose_w1)
    service = _serving_on_two(tiny_package_factory, driver, heartbeat_timeout_s=0.3)
    service._load_once(grow_from=2)
    assert [c[0] for c in driver.calls] == ["load", "ahead"]
    assert service.state.node("w1").health == "dead"
    assert service.state.topology is None  # the next pass plans again
    assert reasons == ["the pipeline of term 1 stopped serving meanwhile"]
    assert service._failures == 0 and service._last_attempt == 0.0


def test_a_reload_that_waits_for_an_idle_stage_0_is_put_off_while_it_is_busy(
    tiny_package_factory,
) -> None:
    """A rebalance (or a regrow that has not waited out a busy stage 0) claims stage 0
    only if it serves nothing at that moment: refused, nothing is loaded or fenced,
    the serving term stays, no failure is counted and the term is not used again."""
    driver = _Driver()
    service = _serving_on_two(tiny_package_factory, driver)
    driver.busy = True
    service._load_once(grow_from=2, if_idle=True)
    assert [c[0] for c in driver.calls] == ["load", "ahead", "claim_if_idle"]
    assert service.state.term == 1 and service.state.mesh_state == "serving"
    assert service._failures == 0
    driver.busy = False
    service._load_once(grow_from=2, if_idle=True)
    assert [c[0] for c in driver.calls][3:] == ["ahead", "claim_if_idle", "load"]
    assert driver.calls[-1][1] == 3  # term 2 was not used again
    assert service.state.term == 3 and len(service.state.topology.stages) == 3


def test_a_restarted_coordinator_prepares_a_newcomer_while_the_old_pipeline_serves(
    tiny_package_factory,
) -> None:
    """A coordinator restarted while a pipeline serves (term 2 on head and w1) and a
    newcomer (w2) joins: its first plan takes all three, and the newcomer's slice is
    prepared, with the serving nodes' ranges at the term they serve, before the load
    fences them. Before, the restarted coordinator fenced the serving pipeline at
    once and it answered nothing for as long as the newcomer took to fetch its slice.
    A pipeline that stops serving meanwhile ends the wait."""
    driver = _Driver()
    package = tiny_package_factory("llama", layers=4)
    model = read_model(str(package))
    load = LoadSettings(str(package), model.manifest.sha256(), model.manifest.model_id)
    service = CoordinatorService(model, CoordinatorSettings(load=load, min_stages=3))
    service._unreachable = lambda plan, state: []
    service._driver = driver
    memory = dict(device="cpu", memory_bytes=8 << 30)
    nodes = {"head": ("127.0.0.1:1", True), "w1": ("127.0.0.1:2", False)}
    for node_id, (address, frontend) in nodes.items():
        service.join(
            JoinRequest(node_id=node_id, address=address, frontend=frontend, term=2, **memory)
        )
        service.heartbeat(HeartbeatRequest(node_id=node_id, term=2, state="serving"))
    service.join(JoinRequest(node_id="w2", address="127.0.0.1:3", term=1, **memory))
    seen: list[str | None] = []
    driver.ahead = lambda newcomers, abort: seen.append(abort())
    service._load_once()
    assert [c[0] for c in driver.calls] == ["ahead", "load"]
    _, term, newcomers, moved = driver.calls[0]
    assert term == 3 and newcomers == ["w2"] and sorted(moved) == ["head", "w1"]
    assert seen == [None]
    assert driver.calls[1] == ("load", 3, ("head", "w1", "w2"))
    # Once this coordinator has loaded a pipeline, only its own topology counts.
    assert service.state.mesh_state == "serving" and service._served_once

    # A restarted coordinator whose serving pipeline stops serving while it waits.
    driver = _Driver()
    service = CoordinatorService(model, CoordinatorSettings(load=load, min_stages=3))
    service._unreachable = lambda plan, state: []
    service._driver = driver
    for node_id, (address, frontend) in nodes.items():
        service.join(
            JoinRequest(node_id=node_id, address=address, frontend=frontend, term=2, **memory)
        )
        service.heartbeat(HeartbeatRequest(node_id=node_id, term=2, state="serving"))
    service.join(JoinRequest(node_id="w2", address="127.0.0.1:3", term=1, **memory))

    def released(newcomers, abort):
        service.heartbeat(HeartbeatRequest(node_id="w1", term=2, state="idle"))
        seen.append(abort())
        from coordinator.driver import LoadError

        raise LoadError(None, "Abort", seen[-1])

    driver.ahead = released
    service._load_once()
    assert [c[0] for c in driver.calls] == ["ahead"]
    assert seen[-1] == "the pipeline of term 2 stopped serving meanwhile"


def test_a_stage_lost_while_the_pipeline_loads_ends_the_attempt_at_once(
    tiny_package_factory, caplog: pytest.LogCaptureFixture
) -> None:
    """A stage stops (SIGSTOP, a swapping host) while the stages load: its heartbeats
    are judged during the load, the attempt ends as soon as it is found dead (before,
    the fenced mesh waited for it up to the 600 s Load deadline), and the next
    attempt, at once and not counted as a failure, plans without it."""
    from coordinator.driver import LoadError, LoadOutcome
    from mesh.codec import Ready

    service = _service(tiny_package_factory, heartbeat_timeout_s=0.3)
    plans: list[tuple[str, ...]] = []

    class Driver:
        def load(self, plan, term, load, abort=None):
            plans.append(plan.node_ids())
            if "w1" not in plan.node_ids():
                return LoadOutcome(term, tuple(Ready(term, "x:1") for _ in plan.stages))
            deadline = time.monotonic() + 5
            while (reason := abort()) is None:  # w1 hangs in Load: its beats stop
                assert time.monotonic() < deadline
                for node_id in ("head", "w2"):
                    service.heartbeat(HeartbeatRequest(node_id=node_id, term=term, state="loaded"))
                time.sleep(0.05)
            raise LoadError(None, "Abort", reason)

    service._driver = Driver()
    memory = dict(device="cpu", memory_bytes=8 << 30)
    for node_id, port in (("head", 1), ("w1", 2), ("w2", 3)):
        frontend = node_id == "head"
        service.join(
            JoinRequest(node_id=node_id, address=f"127.0.0.1:{port}", frontend=frontend, **memory)
        )
    service._load_once()
    assert plans == [("head", "w1", "w2")]
    assert service.state.node("w1").health == "dead"
    assert "node(s) w1 were lost while loading" in caplog.text
    assert service._failures == 0 and service._last_attempt == 0.0
    service._load_once()
    assert plans[-1] == ("head", "w2") and service.state.mesh_state == "serving"


def test_a_node_whose_data_port_does_not_answer_is_found_before_a_load() -> None:
    """Before a load, the coordinator also dials the data port a node names over gRPC
    (a firewall that opens only the control port): found there, the node is left out
    before anything is fenced, instead of a load that fails at its link after the
    serving stages were released (each time its quarantine ended)."""
    import socket

    from coordinator.server import _data_port_problem
    from mesh.grpc_util import bind, channel, new_server
    from mesh.proto.v1 import data_pb2, data_pb2_grpc

    listening = socket.create_server(("127.0.0.1", 0))
    closed = socket.create_server(("127.0.0.1", 0))
    closed_port = closed.getsockname()[1]
    closed.close()  # nothing accepts here any more

    class Data(data_pb2_grpc.StageDataServicer):
        tcp = ""

        def Endpoint(self, request, context):
            return data_pb2.EndpointReply(tcp=self.tcp, tls=False)

    data = Data()
    server = new_server(2)
    data_pb2_grpc.add_StageDataServicer_to_server(data, server)
    address = f"127.0.0.1:{bind(server, '127.0.0.1:0')}"
    server.start()
    ch = channel(address)
    try:
        data.tcp = f"127.0.0.1:{listening.getsockname()[1]}"
        assert _data_port_problem(ch) is None
        data.tcp = f"127.0.0.1:{closed_port}"
        problem = _data_port_problem(ch)
        assert problem is not None and f"data port 127.0.0.1:{closed_port}" in problem
        data.tcp = ""  # data over gRPC: nothing to dial
        assert _data_port_problem(ch) is None
    finally:
        ch.close()
        server.stop(0)
        listening.close()


def test_a_coordinator_that_hears_no_stage_at_all_judges_none_of_them(
    tiny_package_factory,
) -> None:
    """Every node of a serving mesh falls silent at once: the coordinator's own
    network is the likelier fault, and the stages serve on. Nothing is judged until
    one is heard again, and the others then get UNHEARD_GRACE_S (before, it declared
    them all dead, released them when they came back and fenced the pipeline that
    served: 7-10 s without an answer after a 30 s cut on namespace hosts). One silent
    node among nodes heard is judged as before."""
    from coordinator import registry
    from coordinator.server import UNHEARD_GRACE_S

    service = _serving_on_two(tiny_package_factory, _Driver())

    def beats(**ages: float) -> None:
        now = time.monotonic()
        for node_id, age in ages.items():
            service.apply(registry.HeartbeatReceived(node_id=node_id, now=now - age, term=1))

    beats(head=2.5, w1=3.5, w2=2.0)
    after = service._check_heartbeats()
    assert after.mesh_state == "serving" and all(n.alive for n in after.nodes)
    beats(head=0.0)  # heard again
    after = service._check_heartbeats()
    assert after.mesh_state == "serving" and after.node("w1").alive
    assert service._judged_from > time.monotonic() + UNHEARD_GRACE_S - 5.0
    service._judged_from = float("-inf")  # the grace is over
    beats(head=0.0, w2=0.0)
    after = service._check_heartbeats()
    assert after.node("w1").health == "dead" and after.mesh_state == "failed"
