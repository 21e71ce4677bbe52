"""Coordinator state transitions: joins, heartbeats, loads, failures, replanning."""

from __future__ import annotations

import pytest

from coordinator.planner import ModelFootprint, Plan, plan_layers
from coordinator.registry import (
    HeartbeatReceived,
    HeartbeatsChecked,
    LoadFailed,
    LoadStarted,
    LoadSucceeded,
    ModelSelected,
    NodeJoined,
    NodeLeft,
    PlanFailed,
    StageReady,
    State,
    TermObserved,
    alive_nodes,
    apply,
    frontend_idle,
    needs_replan,
    next_term,
    planner_nodes,
    undersized,
    waiting_for,
)
from mesh.errors import InvalidRequest, StaleTerm
from mesh.types import LayerRange

FOOTPRINT = ModelFootprint(
    layer_count=30, layer_bytes=1 << 20, embed_bytes=0, head_bytes=0, kv_bytes_per_layer=0
)


def joined(*node_ids: str, now: float = 0.0) -> State:
    state = apply(State(), ModelSelected(model_id="m", package_ref="pkg", layer_count=30))
    for i, node_id in enumerate(node_ids):
        state = apply(
            state,
            NodeJoined(
                node_id=node_id,
                address=f"10.0.0.{i + 1}:7071",
                device="cpu",
                memory_bytes=8 << 30,
                frontend=i == 0,
                http_url="http://10.0.0.1:8000" if i == 0 else "",
                now=now,
            ),
        )
    return state


def serving(*node_ids: str) -> tuple[State, Plan]:
    state = joined(*node_ids)
    plan = plan_layers(planner_nodes(state), FOOTPRINT)
    state = apply(state, LoadStarted(term=next_term(state), plan=plan))
    for node_id in node_ids:
        state = apply(state, StageReady(node_id=node_id, param_bytes=5 << 20, term=state.term))
    return apply(state, LoadSucceeded(term=state.term)), plan


def test_join_adds_nodes_in_order_and_wants_a_plan() -> None:
    state = joined("a", "b")
    assert [n.node_id for n in alive_nodes(state)] == ["a", "b"]
    assert state.mesh_state == "waiting"
    assert needs_replan(state)
    assert [c.node_id for c in planner_nodes(state)] == ["a", "b"]
    assert planner_nodes(state)[0].frontend
    assert state.http_url == "http://10.0.0.1:8000"
    assert (state.model_id, state.package_ref, state.layer_count) == ("m", "pkg", 30)


def test_empty_state_needs_no_plan() -> None:
    assert not needs_replan(State())


def test_rejoin_updates_address_and_revives() -> None:
    state = joined("a", "b")
    state = apply(state, HeartbeatsChecked(now=100.0, timeout_s=10.0))
    assert state.node("b").health == "dead"
    state = apply(state, NodeJoined(node_id="b", address="10.0.0.9:7071", now=101.0))
    record = state.node("b")
    assert (record.address, record.health, record.last_heartbeat_at) == (
        "10.0.0.9:7071",
        "alive",
        101.0,
    )
    assert [n.node_id for n in state.nodes] == ["a", "b"]


def test_join_without_address_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="address"):
        apply(State(), NodeJoined(node_id="a", address="", now=0.0))


def test_heartbeat_updates_stage_report() -> None:
    state = joined("a")
    state = apply(
        state,
        HeartbeatReceived(node_id="a", now=5.0, term=3, stage_state="serving", active_sessions=2),
    )
    record = state.node("a")
    assert (record.last_heartbeat_at, record.accepted_term) == (5.0, 3)
    assert (record.stage_state, record.active_sessions) == ("serving", 2)


def test_heartbeat_from_unknown_node_changes_nothing() -> None:
    state = joined("a")
    assert apply(state, HeartbeatReceived(node_id="ghost", now=1.0)) == state
    assert not state.is_known("ghost")


def test_missing_heartbeats_mark_a_node_dead_only_after_the_timeout() -> None:
    state = joined("a", "b")
    state = apply(state, HeartbeatReceived(node_id="a", now=8.0))
    still = apply(state, HeartbeatsChecked(now=10.0, timeout_s=10.0))
    assert [n.health for n in still.nodes] == ["alive", "alive"]
    later = apply(state, HeartbeatsChecked(now=10.5, timeout_s=10.0))
    assert [n.health for n in later.nodes] == ["alive", "dead"]
    assert [n.node_id for n in alive_nodes(later)] == ["a"]


def test_load_walks_loading_to_serving() -> None:
    state = joined("a", "b")
    plan = plan_layers(planner_nodes(state), FOOTPRINT)
    state = apply(state, LoadStarted(term=1, plan=plan))
    assert (state.mesh_state, state.term, state.topology) == ("loading", 1, plan)
    assert state.is_assigned("a") and state.is_assigned("b")
    assert not needs_replan(state)
    state = apply(state, StageReady(node_id="b", param_bytes=123))
    assert (state.node("b").param_bytes, state.node("b").stage_state) == (123, "loaded")
    state = apply(state, LoadSucceeded(term=1))
    assert state.mesh_state == "serving"
    assert not needs_replan(state)


def test_load_term_must_increase() -> None:
    state, plan = serving("a")
    with pytest.raises(StaleTerm, match="not above the current term 1"):
        apply(state, LoadStarted(term=1, plan=plan))


def test_plan_naming_a_dead_node_is_refused() -> None:
    state = joined("a", "b")
    plan = plan_layers(planner_nodes(state), FOOTPRINT)
    state = apply(state, HeartbeatsChecked(now=60.0, timeout_s=10.0))
    with pytest.raises(InvalidRequest, match="stage 0 on node a, which is dead"):
        apply(state, LoadStarted(term=1, plan=plan))


def test_stale_load_events_change_nothing() -> None:
    state, _ = serving("a", "b")
    assert apply(state, LoadFailed(term=0, error="old")) == state
    assert apply(state, LoadSucceeded(term=0)) == state
    assert apply(state, StageReady(node_id="a", param_bytes=1, term=0)) == state


def test_load_failed_fails_the_mesh_without_a_replan_loop() -> None:
    state = joined("a", "b")
    plan = plan_layers(planner_nodes(state), FOOTPRINT)
    state = apply(state, LoadStarted(term=1, plan=plan))
    state = apply(state, LoadFailed(term=1, error="stage 1 failed to load: sha256 mismatch"))
    assert state.mesh_state == "failed"
    assert state.error == "stage 1 failed to load: sha256 mismatch"
    assert state.topology is None
    assert not needs_replan(state)
    # A node joining afterwards may be what was missing: plan again.
    state = apply(state, NodeJoined(node_id="c", address="10.0.0.3:7071", now=1.0))
    assert needs_replan(state)


def test_plan_failed_records_the_error_until_membership_changes() -> None:
    state = apply(joined("a"), PlanFailed(error="the model needs 40 GiB"))
    assert (state.mesh_state, state.error) == ("failed", "the model needs 40 GiB")
    assert not needs_replan(state)
    state = apply(state, NodeJoined(node_id="b", address="10.0.0.2:7071", now=1.0))
    assert needs_replan(state)


def test_dead_assigned_node_degrades_the_mesh_and_names_the_stage() -> None:
    state, plan = serving("a", "b")
    state = apply(state, HeartbeatReceived(node_id="a", now=20.0))
    state = apply(state, HeartbeatsChecked(now=25.0, timeout_s=10.0))
    assert state.node("b").health == "dead"
    assert state.mesh_state == "failed"
    assert state.degraded
    assert state.topology is None
    stage = plan.stage_of("b")
    assert stage.layer_range == LayerRange(15, 30)
    assert f"stage 1 (b at {stage.address}, layers [15, 30)) missed heartbeats" in state.error
    assert needs_replan(state)
    assert [c.node_id for c in planner_nodes(state)] == ["a"]


def beat(state: State, node_id: str, now: float, link_error: str = "", term: int = 0) -> State:
    event = HeartbeatReceived(
        node_id=node_id, now=now, term=term or state.term, link_error=link_error
    )
    return apply(state, event)


def test_a_broken_data_link_between_live_stages_degrades_the_mesh_after_the_timeout() -> None:
    state, plan = serving("a", "b")
    broken = "stage 1 is unreachable from stage 0: connection reset"
    state = beat(beat(state, "a", 20.0, broken), "b", 20.0)
    state = apply(state, HeartbeatsChecked(now=21.0, timeout_s=3.0))
    assert state.mesh_state == "serving"  # within the timeout: a dying peer goes first
    for now in (21.0, 22.0, 23.0):
        state = beat(beat(state, "a", now, broken), "b", now)
    state = apply(state, HeartbeatsChecked(now=23.5, timeout_s=3.0))
    assert (state.mesh_state, state.degraded, state.topology) == ("failed", True, None)
    assert "stage 0 (a at" in state.error and "reports a broken data link" in state.error
    assert broken in state.error
    # Both nodes are alive: the next plan uses them again, and a new load forgets it.
    assert needs_replan(state) and [c.node_id for c in planner_nodes(state)] == ["a", "b"]
    state = apply(state, LoadStarted(term=next_term(state), plan=plan))
    assert state.node("a").link_error == ""


def test_a_serving_stage_fenced_off_by_another_claim_fails_the_mesh_over() -> None:
    """Another coordinator's Claim (a higher term) took a stage of the serving pipeline:
    its layers are gone, so the mesh is planned again above that term (before, it
    went on serving on paper while every request waited on that stage)."""
    state, _ = serving("a", "b")
    term = state.term
    state = beat(state, "a", 20.0)
    assert state.mesh_state == "serving"
    state = beat(state, "b", 20.0, term=term + 5)
    assert (state.mesh_state, state.degraded, state.topology) == ("failed", True, None)
    assert f"took a claim of term {term + 5}" in state.error
    assert needs_replan(state) and next_term(state) == term + 6


def test_a_link_that_works_again_or_an_old_term_s_report_changes_nothing() -> None:
    state, _ = serving("a", "b")
    state = beat(state, "a", 20.0, "stage 1 is unreachable from stage 0: reset")
    state = beat(state, "a", 21.0)  # the report is gone
    state = beat(state, "b", 21.0, "stage 1 cannot reach stage 0: reset", term=state.term - 1)
    for node_id in "ab":
        state = beat(state, node_id, 30.0)
    state = apply(state, HeartbeatsChecked(now=30.0, timeout_s=3.0))
    assert state.mesh_state == "serving"
    assert state.node("a").link_error == "" and state.node("b").link_error == ""


def test_a_dead_peer_is_the_failure_reported_not_the_link_to_it() -> None:
    state, _ = serving("a", "b")
    for now in (20.0, 22.0, 24.0):
        state = beat(state, "a", now, "stage 1 is unreachable from stage 0: reset")
    state = apply(state, HeartbeatsChecked(now=24.0, timeout_s=3.0))
    assert state.node("b").health == "dead"
    assert "missed heartbeats" in state.error and "data link" not in state.error


def test_late_heartbeat_revives_a_dead_node_unassigned() -> None:
    state, _ = serving("a", "b")
    state = apply(state, HeartbeatReceived(node_id="a", now=20.0))
    state = apply(state, HeartbeatsChecked(now=25.0, timeout_s=10.0))
    state = apply(state, HeartbeatReceived(node_id="b", now=26.0, term=1, stage_state="loaded"))
    record = state.node("b")
    assert record.health == "alive"
    assert not state.is_assigned("b")
    assert state.mesh_state == "failed"
    assert needs_replan(state)
    assert [c.node_id for c in planner_nodes(state)] == ["a", "b"]


def test_dead_unassigned_node_does_not_fail_the_mesh() -> None:
    state, _ = serving("a", "b")
    state = apply(state, NodeJoined(node_id="spare", address="10.0.0.7:7071", now=0.0))
    for node_id in ("a", "b"):
        state = apply(state, HeartbeatReceived(node_id=node_id, now=30.0))
    state = apply(state, HeartbeatsChecked(now=31.0, timeout_s=10.0))
    assert state.node("spare").health == "dead"
    assert state.mesh_state == "serving"
    assert not needs_replan(state)


def test_node_left_removes_it_and_degrades_when_assigned() -> None:
    state, _ = serving("a", "b")
    state = apply(state, NodeLeft(node_id="b"))
    assert not state.is_known("b")
    assert state.mesh_state == "failed" and state.degraded
    assert "stage 1 (b at 10.0.0.2:7071, layers [15, 30)) left the mesh" in state.error
    assert apply(state, NodeLeft(node_id="b")) == state


def test_rejoin_of_an_assigned_node_degrades_the_mesh() -> None:
    state, _ = serving("a", "b")
    state = apply(state, NodeJoined(node_id="a", address="10.0.0.1:7071", now=3.0))
    assert state.mesh_state == "failed" and state.degraded
    assert "stage 0 (a at 10.0.0.1:7071, layers [0, 15)) joined again" in state.error
    assert state.node("a").param_bytes == 0
    assert needs_replan(state)


def test_replan_after_degradation_serves_again() -> None:
    state, _ = serving("a", "b")
    state = apply(state, NodeLeft(node_id="b"))
    plan = plan_layers(planner_nodes(state), FOOTPRINT)
    state = apply(state, LoadStarted(term=next_term(state), plan=plan))
    assert (state.term, state.error, state.degraded) == (2, "", False)
    state = apply(state, LoadSucceeded(term=2))
    assert state.mesh_state == "serving"
    assert state.topology.stages[0].layer_range == LayerRange(0, 30)


def test_plan_for_wrong_layer_count_is_refused() -> None:
    state = joined("a")
    plan = plan_layers(planner_nodes(state), ModelFootprint(12, 1, 0, 0, 0))
    with pytest.raises(InvalidRequest, match="covers 12 layers but the model has 30"):
        apply(state, LoadStarted(term=1, plan=plan))


def test_terms_go_above_every_term_a_node_reports_and_the_floor() -> None:
    state = joined("a")
    assert next_term(state) == 1
    # A node that served a previous coordinator's term 7 joins this one.
    state = apply(state, NodeJoined(node_id="b", address="10.0.0.2:7071", now=0.0, term=7))
    assert state.node("b").accepted_term == 7
    assert next_term(state) == 8
    # A persisted or refused term raises the floor; the floor never goes down.
    state = apply(state, TermObserved(term=12))
    state = apply(state, TermObserved(term=3))
    assert next_term(state) == 13
    # Heartbeats keep the reported term current.
    state = apply(state, HeartbeatReceived(node_id="a", now=1.0, term=20))
    assert next_term(state) == 21


def test_a_rejoining_node_keeps_the_term_it_reports() -> None:
    state = joined("a", "b")
    state = apply(state, NodeJoined(node_id="b", address="10.0.0.2:7071", now=2.0, term=4))
    assert state.node("b").accepted_term == 4


def test_undersized_only_while_serving_with_spare_alive_nodes() -> None:
    state, _ = serving("a", "b")
    assert not undersized(state, 3)  # two nodes, two stages: nothing to grow into
    state = apply(state, NodeJoined(node_id="c", address="10.0.0.3:7071", now=1.0))
    assert undersized(state, 3)
    assert not undersized(state, 2)  # the operator asked for two stages
    state = apply(state, HeartbeatsChecked(now=100.0, timeout_s=10.0))
    assert not undersized(state, 3)  # every node timed out: the mesh failed


def test_frontend_idle_follows_stage_zero_heartbeats() -> None:
    state, _ = serving("a", "b")
    assert frontend_idle(state)
    state = apply(state, HeartbeatReceived(node_id="a", now=1.0, term=1, active_sessions=2))
    assert not frontend_idle(state)
    state = apply(state, HeartbeatReceived(node_id="b", now=1.0, term=1, active_sessions=0))
    assert not frontend_idle(state)  # only stage 0's sessions count


def test_a_ready_reply_counts_as_a_heartbeat() -> None:
    """A stage busy loading may miss beats; its Ready reply proves it alive."""
    state = joined("a", "b", now=0.0)
    plan = plan_layers(planner_nodes(state), FOOTPRINT)
    state = apply(state, LoadStarted(term=next_term(state), plan=plan))
    state = apply(state, StageReady(node_id="a", param_bytes=1, term=1, now=9.5))
    state = apply(state, StageReady(node_id="b", param_bytes=1, term=1))
    state = apply(state, LoadSucceeded(term=1))
    state = apply(state, HeartbeatsChecked(now=10.0, timeout_s=3.0))
    assert state.node("a").health == "alive"
    assert state.node("b").health == "dead"  # no reply time given, no beat since 0.0


def test_dead_nodes_are_forgotten_after_a_while() -> None:
    state, _ = serving("a", "b")
    state = apply(state, NodeJoined(node_id="spare", address="10.0.0.9:7071", now=0.0))
    for now in (5.0, 50.0):
        for node_id in ("a", "b"):
            state = apply(state, HeartbeatReceived(node_id=node_id, now=now, term=1))
        state = apply(state, HeartbeatsChecked(now=now, timeout_s=3.0, forget_after_s=30.0))
    assert state.node("spare") is None  # dead at 5 s, forgotten once silent > 30 s
    assert [n.node_id for n in state.nodes] == ["a", "b"]
    assert state.mesh_state == "serving"
    # forget_after_s == 0 keeps dead nodes for good.
    state = apply(state, NodeJoined(node_id="old", address="10.0.0.8:7071", now=50.0))
    state = apply(state, HeartbeatsChecked(now=5000.0, timeout_s=3.0))
    assert state.node("old") is not None and state.node("old").health == "dead"


def test_waiting_for_says_what_the_mesh_waits_for() -> None:
    state = joined("a")
    assert "2 more stage(s) to join (1 alive, --min-stages 3)" in waiting_for(
        state, min_stages=3, served_once=False
    )
    state, _ = serving("a", "b")
    assert waiting_for(state, min_stages=2, served_once=True) == ""
    state = apply(state, NodeJoined(node_id="c", address="10.0.0.3:7071", now=1.0))
    assert "stage 0 to be idle" in waiting_for(state, min_stages=3, served_once=True)
    state = apply(state, LoadFailed(term=1, error="boom"))
    assert waiting_for(state, min_stages=3, served_once=True, retry_in_s=4.2) == (
        "the next load attempt in 4 s"
    )
    assert "gave up" in waiting_for(state, min_stages=3, served_once=True, gave_up="x")
    state = apply(state, HeartbeatsChecked(now=100.0, timeout_s=3.0))
    assert waiting_for(state, min_stages=3, served_once=True) == (
        "the frontend stage (stage 0) to rejoin"
    )


def test_a_dead_node_holds_no_sessions_or_kv() -> None:
    """Its last report says nothing of now: status and the metrics showed a dead
    node's sessions and KV until it came back."""
    state = joined("a", "b")
    report = HeartbeatReceived(
        node_id="b", now=1.0, active_sessions=3, kv_bytes=5 << 20, prefix_bytes=1 << 20
    )
    state = apply(state, report)
    assert (state.node("b").active_sessions, state.node("b").kv_bytes) == (3, 5 << 20)
    state = apply(state, HeartbeatsChecked(now=100.0, timeout_s=10.0))
    record = state.node("b")
    assert record.health == "dead"
    assert (record.active_sessions, record.kv_bytes, record.prefix_bytes) == (0, 0, 0)


def test_a_node_id_taken_by_another_live_process_is_said_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Two stages started with one --node-id: the second join is not a restart of the
    first (whose process still beats), and the log says what to do."""
    state, _ = serving("a", "b")
    with caplog.at_level("INFO", logger="coordinator.registry"):
        state = apply(state, NodeJoined(node_id="b", address="10.0.0.9:7071", now=1.0))
    assert "while the process at 10.0.0.2:7071 still held this node id" in caplog.text
    assert "give each its own --node-id" in caplog.text
    assert "taken by a process at 10.0.0.9:7071" in state.error
    caplog.clear()
    # A process that comes back at another address after the old one died moved.
    state = apply(state, HeartbeatsChecked(now=100.0, timeout_s=10.0))
    with caplog.at_level("INFO", logger="coordinator.registry"):
        apply(state, NodeJoined(node_id="b", address="10.0.0.7:7071", now=101.0))
    assert "joined again from 10.0.0.7:7071" in caplog.text
    assert "still held" not in caplog.text


@pytest.mark.parametrize("health", ["dead", "alive"])
def test_a_new_node_id_at_a_dead_node_s_address_replaces_it(health: str) -> None:
    """A stage restarted with another --node-id joins from the address of its old,
    dead record: the old one is forgotten at once (before, ``status`` listed it as a
    dead row beside the live one until --forget-dead-after). A live node at the same
    address is left alone (two stages that advertise one address are a setup error
    the links report, not something a join may decide)."""
    state = joined("a", "b")
    if health == "dead":
        state = apply(state, HeartbeatsChecked(now=100.0, timeout_s=10.0))
        state = apply(state, HeartbeatReceived(node_id="a", now=100.0))
    assert state.node("b").health == health
    state = apply(state, NodeJoined(node_id="b2", address="10.0.0.2:7071", now=101.0))
    ids = [n.node_id for n in state.nodes]
    assert ids == (["a", "b2"] if health == "dead" else ["a", "b", "b2"])
    assert state.node("b2").alive


def test_a_replaced_node_that_was_assigned_degrades_the_mesh() -> None:
    state, _ = serving("a", "b")
    state = apply(state, HeartbeatsChecked(now=100.0, timeout_s=10.0))
    state = apply(state, HeartbeatReceived(node_id="a", now=100.0))
    assert state.degraded and state.node("b").health == "dead"
    state = apply(state, NodeJoined(node_id="b2", address="10.0.0.2:7071", now=101.0))
    assert not state.is_known("b")
    assert [c.node_id for c in planner_nodes(state)] == ["a", "b2"]
    assert needs_replan(state)


def test_a_dead_frontend_node_is_not_forgotten() -> None:
    """Stage 0 (the frontend) dies and stays away past forget_after_s: it is kept, so
    the mesh keeps waiting for it. Forgotten, it let the coordinator plan any node as
    a stage 0 with no API and report the mesh as serving (found on namespace hosts
    with --forget-dead-after 20)."""
    state, _ = serving("a", "b", "c")
    for now in (5.0, 50.0):
        for node_id in ("b", "c"):
            state = apply(state, HeartbeatReceived(node_id=node_id, now=now, term=1))
        state = apply(state, HeartbeatsChecked(now=now, timeout_s=3.0, forget_after_s=30.0))
    assert state.node("a") is not None and state.node("a").health == "dead"
    assert waiting_for(state, min_stages=3, served_once=True) == (
        "the frontend stage (stage 0) to rejoin"
    )
    # Restarted with another node id from its address, it replaces the old record.
    state = apply(state, NodeJoined(node_id="a2", address="10.0.0.1:7071", frontend=True, now=51.0))
    assert not state.is_known("a") and state.node("a2").alive
