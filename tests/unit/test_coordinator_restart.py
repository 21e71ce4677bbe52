"""A coordinator restarted after its mesh served plans with the stages alive once they
have had time to join it again, as after a loss: ``--min-stages`` gates a mesh's
first load only. Before, a restarted coordinator that found fewer stages alive than
``--min-stages`` (one was lost while it was down) waited for ever, and every request
failed with 503."""

from __future__ import annotations

from pathlib import Path

from coordinator.driver import LoadSettings
from coordinator.model import read_model
from coordinator.server import CoordinatorService, CoordinatorSettings
from coordinator.state_file import served_before, served_http, update_state
from mesh.codec import HeartbeatRequest, JoinRequest


def _restarted(tiny_package_factory, stage_state: str, **settings) -> CoordinatorService:
    """A coordinator (min_stages 3) that two of the mesh's three nodes join, holding
    term 26 in ``stage_state``."""
    package = tiny_package_factory("llama", layers=2)
    model = read_model(str(package))
    load = LoadSettings(str(package), model.manifest.sha256(), model.manifest.model_id)
    service = CoordinatorService(model, CoordinatorSettings(load=load, min_stages=3, **settings))
    memory = dict(device="cpu", memory_bytes=8 << 30)
    for node_id, port, frontend in (("head", 1, True), ("w1", 2, False)):
        service.join(
            JoinRequest(
                node_id=node_id, address=f"127.0.0.1:{port}", frontend=frontend, term=26, **memory
            )
        )
        service.heartbeat(HeartbeatRequest(node_id=node_id, term=26, state=stage_state))
    return service


def test_a_restarted_coordinator_plans_with_the_stages_alive_after_the_grace(
    tiny_package_factory,
) -> None:
    service = _restarted(tiny_package_factory, "idle", served_before=True, restart_grace_s=60)
    # Within the grace the stages may still be joining: it waits for --min-stages.
    assert not service._should_load(service.state)
    assert "1 more stage(s) to join (2 alive, --min-stages 3)" in service.status().waiting_for
    service._started -= 61
    assert service._should_load(service.state)
    assert "more stage(s) to join" not in service.status().waiting_for
    # And it no longer gives up after --load-attempts failures: the mesh served.
    for _ in range(5):
        service._failed("a passing failure")
    assert service.gave_up is None


def test_a_stage_serving_a_pipeline_tells_a_coordinator_without_a_state_file(
    tiny_package_factory,
) -> None:
    service = _restarted(tiny_package_factory, "serving", restart_grace_s=0)
    assert service._should_load(service.state)


def test_a_first_mesh_still_waits_for_min_stages(tiny_package_factory) -> None:
    service = _restarted(tiny_package_factory, "idle", restart_grace_s=0)
    assert not service._should_load(service.state)
    for _ in range(3):
        service._failed("cannot load")
    assert service.gave_up is not None and "after 3 attempts" in service.gave_up


def test_the_state_file_says_whether_this_model_served(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    assert not served_before(path, "m")
    update_state(path, max_term=4)  # terms were used, nothing served
    assert not served_before(path, "m")
    update_state(path, term=3, model_id="m")
    assert served_before(path, "m")
    assert not served_before(path, "another-model")
    path.write_text("not json")
    assert not served_before(path, "m")


def test_a_restarted_coordinator_waits_for_the_frontend_when_its_mesh_served_http(
    tiny_package_factory,
) -> None:
    """Its grace is over and a worker joins first (stages that find a moved
    coordinator by discovery join within milliseconds of one another, in any
    order): a pipeline on that worker alone would have no frontend. Before, it was
    loaded, tearing down the pipeline the stages still served, and replaced a few
    seconds later once the frontend node had joined too."""
    package = tiny_package_factory("llama", layers=2)
    model = read_model(str(package))
    load = LoadSettings(str(package), model.manifest.sha256(), model.manifest.model_id)
    settings = CoordinatorSettings(
        load=load, min_stages=3, served_before=True, restart_grace_s=0, expect_frontend=True
    )
    service = CoordinatorService(model, settings)
    memory = dict(device="cpu", memory_bytes=8 << 30)
    service.join(JoinRequest(node_id="w2", address="127.0.0.1:2", term=26, **memory))
    service.heartbeat(HeartbeatRequest(node_id="w2", term=26, state="serving"))
    assert not service._should_load(service.state)
    assert "the frontend stage (stage 0) to join" in service.status().waiting_for
    service.join(JoinRequest(node_id="w1", address="127.0.0.1:1", frontend=True, term=26, **memory))
    service.heartbeat(HeartbeatRequest(node_id="w1", term=26, state="serving"))
    assert service._should_load(service.state)
    # Without the expectation (a mesh not known to have served HTTP) a worker alone
    # may still be planned, as before.
    alone = CoordinatorService(
        model, CoordinatorSettings(load=load, min_stages=1, served_before=True, restart_grace_s=0)
    )
    alone.join(JoinRequest(node_id="w2", address="127.0.0.1:2", term=26, **memory))
    assert alone._should_load(alone.state)


def test_the_state_file_says_whether_the_mesh_served_http(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    update_state(path, term=3, model_id="m", http_url="")
    assert served_before(path, "m") and not served_http(path, "m")
    update_state(path, http_url="http://10.0.0.2:8000")
    assert served_http(path, "m")
    assert not served_http(path, "another-model")
