"""The coordinator's rebalance decision on a serving mesh whose stages report their
probes and step times: plan again when it pays, say why not when it does not, and
stop after a rebalance that did not help. The stages' addresses refuse connections,
so a decided rebalance fails where it first calls a stage (a real gRPC failure): at
the Prepare of the moved stages' new slices, made before anything is fenced, so the
pipeline of the serving term is left as it is."""

from __future__ import annotations

import logging
import socket

import pytest

from coordinator import registry
from coordinator.driver import LoadSettings
from coordinator.model import read_model
from coordinator.planner import Plan, StageAssignment
from coordinator.server import CoordinatorService, CoordinatorSettings
from mesh.types import LayerRange

NODES = ("a", "b", "c")


@pytest.fixture
def refusing_ports():
    """Three loopback ports bound but never listening: connections are refused."""
    sockets = [socket.socket() for _ in NODES]
    for sock in sockets:
        sock.bind(("127.0.0.1", 0))
    yield [sock.getsockname()[1] for sock in sockets]
    for sock in sockets:
        sock.close()


@pytest.fixture
def service(tiny_package_factory, refusing_ports):
    package = tiny_package_factory("llama", layers=6)
    model = read_model(str(package))
    settings = CoordinatorSettings(
        load=LoadSettings(str(package), model.manifest.sha256(), model.manifest.model_id),
        min_stages=3,
        rebalance_check_s=0.0,
        retry_backoff_s=0.0,
    )
    service = CoordinatorService(model, settings)
    for index, (node_id, port) in enumerate(zip(NODES, refusing_ports, strict=True)):
        service.apply(
            registry.NodeJoined(
                node_id=node_id, address=f"127.0.0.1:{port}", now=0.0, frontend=index == 0
            )
        )
    stages = tuple(
        StageAssignment(node_id, f"127.0.0.1:{port}", i, LayerRange(2 * i, 2 * i + 2), 0)
        for i, (node_id, port) in enumerate(zip(NODES, refusing_ports, strict=True))
    )
    service.apply(registry.LoadStarted(term=1, plan=Plan(stages)))
    for node_id in NODES:
        head_ms = 4.0 if node_id == "c" else 0.0
        service.apply(
            registry.StageReady(
                node_id=node_id, param_bytes=1, term=1, layer_ms=1.0, head_ms=head_ms
            )
        )
    service.apply(registry.LoadSucceeded(term=1))
    return service


def measured(service: CoordinatorService, steps: dict[str, float]) -> registry.State:
    for node_id, step_ms in steps.items():
        service.apply(
            registry.HeartbeatReceived(
                node_id=node_id,
                now=1.0,
                term=service.state.term,
                stage_state="serving",
                step_ms=step_ms,
                step_frames=128,
            )
        )
    return service.state


def test_a_rebalance_that_pays_loads_a_new_term(service, caplog) -> None:
    state = measured(service, {"a": 10.0, "b": 10.0, "c": 40.0})
    assert service._should_rebalance(state)
    with caplog.at_level(logging.INFO, logger="coordinator.rebalance"):
        service._rebalance(state)
    assert "planning again (slowest stage 40.00 ms measured" in caplog.text
    # The new plan's slices were asked for (and the refused Prepare failed it) while
    # term 1 went on serving: nothing was fenced, the failure is counted.
    assert service.state.term == 1
    assert service.state.mesh_state == "serving"
    assert service._failures == 1
    # Nothing was loaded, so the rebalance counts as not tried.
    assert not service.rebalancer.stopped


def test_no_rebalance_when_no_plan_is_estimated_faster(service, caplog) -> None:
    state = measured(service, {"a": 10.0, "b": 10.0, "c": 20.0})
    assert service._should_rebalance(state)  # 100% apart
    with caplog.at_level(logging.INFO, logger="coordinator.rebalance"):
        service._rebalance(state)
    assert "but no plan is estimated 5% faster" in caplog.text
    assert service.state.term == 1 and service.state.mesh_state == "serving"


def test_rebalancing_stops_after_one_that_did_not_help(service, caplog) -> None:
    plan = service.state.topology
    # A rebalance whose new plan is loaded (term 3, the old plan again, as if the
    # layers had not moved): its slowest stage is no faster than 40 ms.
    service._slices_ready = lambda plan, term, state: True
    service._stage0_idle = lambda plan, term: True
    service._rebalance(measured(service, {"a": 10.0, "b": 10.0, "c": 40.0}))
    assert service.state.term == 2  # tried (and failed at the refused Claim)
    service.apply(registry.LoadStarted(term=3, plan=plan))
    for node_id in NODES:
        service.apply(registry.StageReady(node_id=node_id, param_bytes=1, term=3))
    service.apply(registry.LoadSucceeded(term=3))
    state = measured(service, {"a": 10.0, "b": 10.0, "c": 45.0})
    assert service._should_rebalance(state)
    with caplog.at_level(logging.INFO, logger="coordinator.rebalance"):
        service._rebalance(state)
    assert "the last rebalance did not make the slowest stage faster" in caplog.text
    assert service.state.term == 3
    assert service.rebalancer.stopped
    assert not service._should_rebalance(service.state)
