"""The stall rule: a stage that still heartbeats but whose data path is stuck (a hung
thread or device, a port that drops the data links' packets) is found from stage 0's
oldest unanswered frame and the stages' progress, planned around and kept out of
plans for a quarantine that doubles with each stall."""

from __future__ import annotations

from coordinator.planner import ModelFootprint, plan_layers
from coordinator.registry import (
    STALL_MEMORY_S,
    STALL_QUARANTINE_S,
    STALL_ROUND_FACTOR,
    HeartbeatReceived,
    HeartbeatsChecked,
    LoadStarted,
    LoadSucceeded,
    ModelSelected,
    NodeJoined,
    StageReady,
    State,
    apply,
    needs_replan,
    next_term,
    planner_nodes,
    undersized,
)
from mesh.frames import FrameProgress

FOOTPRINT = ModelFootprint(
    layer_count=30, layer_bytes=1 << 20, embed_bytes=0, head_bytes=0, kv_bytes_per_layer=0
)
STALL_S = 20.0


def serving(*node_ids: str) -> State:
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
                now=-1000.0,  # long before the checks below
            ),
        )
    plan = plan_layers(planner_nodes(state), FOOTPRINT)
    state = apply(state, LoadStarted(term=next_term(state), plan=plan))
    for node_id in node_ids:
        state = apply(state, StageReady(node_id=node_id, param_bytes=1, term=state.term))
    return apply(state, LoadSucceeded(term=state.term))


def beats(state: State, now: float, progress: dict[str, FrameProgress]) -> State:
    """Every node of ``progress`` heartbeats at ``now`` with its progress."""
    for node_id, step in progress.items():
        state = apply(
            state,
            HeartbeatReceived(
                node_id=node_id,
                now=now,
                term=state.term,
                stage_state="serving",
                progress=step,
            ),
        )
    return state


def check(state: State, now: float, stall_s: float = STALL_S) -> State:
    return apply(state, HeartbeatsChecked(now=now, timeout_s=3.0, stall_timeout_s=stall_s))


def waiting(frame: int, waited_s: float, done: int | None = None, **rounds: float) -> FrameProgress:
    """Stage 0's progress: it finished ``done`` (default ``frame``) and waits for
    ``frame``'s answer."""
    return FrameProgress(
        done=frame if done is None else done, waiting_frame=frame, waiting_s=waited_s, **rounds
    )


def test_the_first_stage_that_has_not_passed_the_overdue_frame_is_stalled() -> None:
    state = serving("a", "b", "c")
    stuck = {"a": waiting(42, 25.0), "b": FrameProgress(done=42), "c": FrameProgress(done=41)}
    state = check(beats(state, 100.0, stuck), 100.5)
    assert (state.mesh_state, state.degraded, state.topology) == ("failed", True, None)
    assert "stage 2 (c at" in state.error and "has not finished frame 42" in state.error
    assert "which stage 1 passed on; stage 0 has waited 25.5 s" in state.error
    record = state.node("c")
    assert record.health == "stalled" and record.stalls == 1
    assert record.stalled_until == 100.5 + STALL_QUARANTINE_S
    # The next plan leaves it out; the others are planned again.
    assert needs_replan(state)
    assert [c.node_id for c in planner_nodes(state)] == ["a", "b"]


def test_an_answer_stuck_on_its_way_back_blames_the_last_stage() -> None:
    state = serving("a", "b")
    state = check(beats(state, 50.0, {"a": waiting(7, 30.0), "b": FrameProgress(done=9)}), 50.0)
    assert state.node("b").health == "stalled"
    assert "finished frame 7, but stage 0 has waited 30.0 s" in state.error
    assert "the return link to stage 0 is stuck" in state.error


def test_nothing_happens_before_the_deadline_or_with_the_rule_off() -> None:
    state = serving("a", "b")
    slow = {"a": waiting(7, 18.0), "b": FrameProgress(done=6)}
    # 18 s reported plus 1.9 s since that heartbeat: still under 20 s.
    assert check(beats(state, 50.0, slow), 51.9).mesh_state == "serving"
    assert check(beats(state, 50.0, slow), 52.1).mesh_state == "failed"
    assert check(beats(state, 50.0, slow), 52.1, stall_s=0.0).mesh_state == "serving"
    # No frame waiting, or a frame stage 0 has not finished itself: nothing to blame.
    idle = {"a": FrameProgress(done=9), "b": FrameProgress(done=9)}
    assert check(beats(state, 50.0, idle), 50.0).mesh_state == "serving"
    own = {"a": waiting(7, 300.0, done=6), "b": FrameProgress(done=6)}
    assert check(beats(state, 50.0, own), 50.0).mesh_state == "serving"


def test_the_deadline_grows_with_the_round_the_frame_should_take() -> None:
    state = serving("a", "b")
    # A long prompt chunk: stage 0 took 3 s for its part, so the round should take
    # 6 s on two stages, and the frame gets 10 times that.
    assert 6.0 * STALL_ROUND_FACTOR == 60.0
    long_chunk = {"a": waiting(7, 59.0, waiting_compute_s=3.0), "b": FrameProgress(done=6)}
    assert check(beats(state, 50.0, long_chunk), 50.0).mesh_state == "serving"
    assert check(beats(state, 50.0, long_chunk), 51.5).mesh_state == "failed"
    # So does the longest recent round (4 s: 40 s).
    slow_rounds = {"a": waiting(7, 39.0, longest_round_s=4.0), "b": FrameProgress(done=6)}
    assert check(beats(state, 50.0, slow_rounds), 50.0).mesh_state == "serving"
    assert check(beats(state, 50.0, slow_rounds), 51.5).mesh_state == "failed"


def test_progress_of_another_term_is_not_taken_for_this_one() -> None:
    state = serving("a", "b")
    state = beats(state, 50.0, {"a": waiting(7, 30.0)})
    old = HeartbeatReceived(
        node_id="b",
        now=50.0,
        term=state.term - 1,
        stage_state="serving",
        progress=FrameProgress(done=99),
    )
    state = check(apply(state, old), 50.0)
    # b's figure is of an old term: it counts as having finished nothing of this one.
    assert state.node("b").health == "stalled"


def test_the_quarantine_ends_after_its_time_and_doubles_on_the_next_stall() -> None:
    state = serving("a", "b", "c")
    stuck = {"a": waiting(42, 25.0), "b": FrameProgress(done=41), "c": FrameProgress(done=41)}
    state = check(beats(state, 100.0, stuck), 100.0)
    assert state.node("b").health == "stalled"
    # It keeps heartbeating: stalled until the quarantine is over, then alive again
    # (unassigned), and the mesh may grow back onto it.
    state = beats(state, 120.0, {"a": FrameProgress(), "b": FrameProgress(), "c": FrameProgress()})
    assert state.node("b").health == "stalled"
    assert [c.node_id for c in planner_nodes(state)] == ["a", "c"]
    plan = plan_layers(planner_nodes(state), FOOTPRINT)
    state = apply(state, LoadStarted(term=next_term(state), plan=plan))
    for node_id in ("a", "c"):
        state = apply(state, StageReady(node_id=node_id, param_bytes=1, term=state.term))
    state = apply(state, LoadSucceeded(term=state.term))
    later = 100.0 + STALL_QUARANTINE_S + 1.0
    state = beats(state, later, {"a": FrameProgress(), "b": FrameProgress(), "c": FrameProgress()})
    assert state.node("b").health == "alive" and state.membership_changed
    assert undersized(state, 3)
    # Planned in again and stuck again: twice the quarantine.
    plan = plan_layers(planner_nodes(state), FOOTPRINT)
    state = apply(state, LoadStarted(term=next_term(state), plan=plan))
    for node_id in ("a", "b", "c"):
        state = apply(state, StageReady(node_id=node_id, param_bytes=1, term=state.term))
    state = apply(state, LoadSucceeded(term=state.term))
    stuck = {"a": waiting(90, 25.0), "b": FrameProgress(done=80), "c": FrameProgress(done=80)}
    state = check(beats(state, 200.0, stuck), 200.0)
    record = state.node("b")
    assert (record.health, record.stalls) == ("stalled", 2)
    assert record.stalled_until == 200.0 + 2 * STALL_QUARANTINE_S
    # Back in, and clean for longer than the stall memory: the next stall starts over.
    free = record.stalled_until + 1.0
    state = beats(state, free, {"a": FrameProgress(), "b": FrameProgress(), "c": FrameProgress()})
    plan = plan_layers(planner_nodes(state), FOOTPRINT)
    state = apply(state, LoadStarted(term=next_term(state), plan=plan))
    for node_id in ("a", "b", "c"):
        state = apply(state, StageReady(node_id=node_id, param_bytes=1, term=state.term))
    state = apply(state, LoadSucceeded(term=state.term))
    much_later = record.stalled_until + STALL_MEMORY_S + 10.0
    stuck = {"a": waiting(300, 25.0), "b": FrameProgress(done=290), "c": FrameProgress(done=290)}
    state = check(beats(state, much_later, stuck), much_later)
    record = state.node("b")
    assert (record.health, record.stalls) == ("stalled", 1)
    assert record.stalled_until == much_later + STALL_QUARANTINE_S


def test_a_stalled_node_that_goes_silent_is_dead() -> None:
    state = serving("a", "b", "c")
    stuck = {"a": waiting(42, 25.0), "b": FrameProgress(done=41), "c": FrameProgress(done=41)}
    state = check(beats(state, 100.0, stuck), 100.0)
    state = beats(state, 110.0, {"a": FrameProgress(), "c": FrameProgress()})
    state = check(state, 110.0)
    assert state.node("b").health == "dead"


def test_a_coordinator_that_was_stopped_judges_silence_from_when_it_resumed() -> None:
    """Stopped for 30 s (SIGSTOP, a paused VM), the coordinator heard nobody, and
    neither stage 0's wait nor the stages' silence over that time is theirs: from
    ``judged_from`` on they get a heartbeat timeout (or stall deadline) again."""
    state = serving("a", "b", "c")
    busy = {"a": waiting(42, 0.5), "b": FrameProgress(done=41), "c": FrameProgress(done=41)}
    state = beats(state, 100.0, busy)
    resumed = 130.0
    checked = apply(
        state,
        HeartbeatsChecked(now=resumed, timeout_s=3.0, stall_timeout_s=STALL_S, judged_from=resumed),
    )
    assert checked.mesh_state == "serving"
    assert all(n.health == "alive" for n in checked.nodes)
    # Without it, every stage would have been taken for dead.
    assert check(state, resumed).mesh_state == "failed"
    # The grace is a heartbeat timeout: a stage still silent then is dead.
    later = apply(
        checked,
        HeartbeatsChecked(now=resumed + 3.5, timeout_s=3.0, judged_from=resumed),
    )
    assert later.node("b").health == "dead"


def test_a_frame_still_arriving_over_a_slow_link_is_not_a_stall() -> None:
    """A big prompt chunk crossing a slow link takes longer than the deadline: the
    stage that has not finished it is reading its bytes all along (its ``received``
    grows), so it is not blamed; once the bytes stop for a deadline, it is."""
    state = serving("a", "b")
    arriving = 0
    for now in range(30, 61, 2):
        arriving += 1 << 20
        state = beats(
            state,
            float(now),
            {"a": waiting(7, now - 29.0), "b": FrameProgress(done=6, received=arriving)},
        )
        state = check(state, now + 0.5)
        assert state.mesh_state == "serving", now
    # The bytes stop: the deadline runs from the last time they grew.
    for now in range(62, 100, 2):
        state = beats(
            state,
            float(now),
            {"a": waiting(7, now - 29.0), "b": FrameProgress(done=6, received=arriving)},
        )
        state = check(state, now + 0.5)
        if state.mesh_state != "serving":
            break
    assert state.node("b").health == "stalled" and now >= 60 + STALL_S
    # The same for an answer on its way back: stage 0's own bytes.
    state = serving("a", "b")
    for now, read in ((40, 1), (42, 2), (44, 3)):
        state = beats(
            state,
            float(now),
            {"a": waiting(7, 25.0 + now - 40, received=read), "b": FrameProgress(done=9)},
        )
        assert check(state, now + 0.5).mesh_state == "serving"


def test_stage_0_stuck_in_its_own_compute_is_an_error_not_a_failover() -> None:
    """Stage 0 is the frontend: it cannot be planned away. The status says so (the
    mesh looks fine from every heartbeat), and stops saying so once it computes
    again."""
    state = serving("a", "b")
    own = {"a": waiting(7, 30.0, done=6), "b": FrameProgress(done=6)}
    stuck = check(beats(state, 50.0, own), 50.0)
    assert stuck.mesh_state == "serving" and stuck.topology is not None
    assert stuck.error.startswith("stage 0 is stuck: a at 10.0.0.1:7071 has not computed frame 7")
    assert all(n.health == "alive" for n in stuck.nodes)
    assert check(stuck, 50.5).error == stuck.error
    moving = {"a": waiting(9, 0.2, done=9), "b": FrameProgress(done=8)}
    assert check(beats(stuck, 51.0, moving), 51.0).error == ""


def test_a_slower_stage_gets_the_time_its_step_times_say() -> None:
    """Stage 0 on a fast device took 3 s for its part of a frame; stage 1 takes ten
    times as long per frame (a CPU behind a GPU, a split memory forced): the round
    should take 3 + 30 s, and the frame gets ten times that."""
    state = serving("a", "b")

    def beat(state: State, now: float, waited_s: float) -> State:
        progress = {"a": waiting(7, waited_s, waiting_compute_s=3.0), "b": FrameProgress(done=6)}
        for node_id, step_ms in (("a", 5.0), ("b", 50.0)):
            event = HeartbeatReceived(
                node_id=node_id,
                now=now,
                term=state.term,
                stage_state="serving",
                step_ms=step_ms,
                progress=progress[node_id],
            )
            state = apply(state, event)
        return state

    assert check(beat(state, 50.0, 329.0), 50.0).mesh_state == "serving"  # 10 x 33 s
    late = check(beat(state, 50.0, 331.0), 50.0)
    assert late.mesh_state == "failed" and "has not finished frame 7" in late.error
    assert "stall deadline 330 s" in late.error or "stall deadline 330.0 s" in late.error


def test_before_any_step_time_the_load_probes_say_what_a_stage_costs() -> None:
    """The first long prompt after a load: no step time is measured yet, but every
    stage timed a layer (and the head) on its device when it loaded."""
    state = apply(State(), ModelSelected(model_id="m", package_ref="pkg", layer_count=30))
    for i, node_id in enumerate(("a", "b")):
        joined = NodeJoined(
            node_id=node_id,
            address=f"10.0.0.{i + 1}:7071",
            device="cpu",
            memory_bytes=8 << 30,
            frontend=i == 0,
            now=-1000.0,
        )
        state = apply(state, joined)
    plan = plan_layers(planner_nodes(state), FOOTPRINT)  # 15 + 15 layers
    state = apply(state, LoadStarted(term=next_term(state), plan=plan))
    for node_id, layer_ms in (("a", 1.0), ("b", 10.0)):
        ready = StageReady(
            node_id=node_id, param_bytes=1, term=state.term, layer_ms=layer_ms, head_ms=5.0
        )
        state = apply(state, ready)
    state = apply(state, LoadSucceeded(term=state.term))
    # Stage 1 costs 15 x 10 + 5 = 155 ms against stage 0's 15 ms: a round of 1 s of
    # stage 0 compute should take 1 + 10.3 s, and gets ten times that.
    slow = {"a": waiting(7, 110.0, waiting_compute_s=1.0), "b": FrameProgress(done=6)}
    assert check(beats(state, 50.0, slow), 50.0).mesh_state == "serving"
    slower = {"a": waiting(7, 115.0, waiting_compute_s=1.0), "b": FrameProgress(done=6)}
    assert check(beats(state, 50.0, slower), 50.0).mesh_state == "failed"
