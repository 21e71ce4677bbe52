"""Faults that lie, through real processes: a stage frozen (SIGSTOP) long enough to
be declared dead and then woken, a frozen middle stage, a slow stage, a killed stage,
and a coordinator killed and restarted, each during concurrent greedy and seeded
streams. Every stream that completes must equal its no-fault output; a stream may
fail only with an explicit error. `benchmarks/chaos.py` runs the same rounds with
random faults, many more of them."""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from pathlib import Path

import pytest

from coordinator.chaos import (
    ChaosRun,
    Fault,
    StreamSpec,
    default_specs,
    embedding_specs,
    feature_specs,
)
from coordinator.localmesh import MeshProcesses, wait_for
from mesh.errors import MeshError
from mesh.security import MeshSecurity

MODEL = "tiny-llama"
# The coordinator's stall timeout here: a stage that stops passing frames on for this
# long while it heartbeats is planned around.
STALL_TIMEOUT_S = 4


@pytest.fixture(scope="module")
def chaos(tmp_path_factory: pytest.TempPathFactory, tiny_package_factory):
    package = tiny_package_factory("llama", layers=6)
    mesh = MeshProcesses(
        package,
        tmp_path_factory.mktemp("chaos"),
        3,
        max_sessions=8,
        coordinator_args=("--stall-timeout", str(STALL_TIMEOUT_S)),
    )
    try:
        mesh.start().wait_serving()
        specs = default_specs(6, 160, random.Random(7)) + embedding_specs(2, 6, random.Random(5))
        specs += feature_specs(48, random.Random(3))
        run = ChaosRun(mesh, MODEL, specs, random.Random(11))
        run.baseline()
        yield run
    finally:
        mesh.close()


def long_round(run: ChaosRun, fault: Fault):
    """A round of the long greedy and seeded streams and the embeddings (not the
    short feature requests, which may end before a fault has anything to catch)."""
    plain = [i for i, spec in enumerate(run.specs) if not spec.feature]
    return run.round(fault, chosen=run.rng.sample(plain, run.streams_per_round))


def last_stage(run: ChaosRun) -> str:
    stages = [s for s in run.mesh.status().stages if s.assigned]
    return max(stages, key=lambda s: s.stage_index).node_id


def middle_stage(run: ChaosRun) -> str:
    return next(s.node_id for s in run.mesh.status().stages if s.assigned and s.stage_index == 1)


def assert_no_corruption(run: ChaosRun, record) -> None:
    assert "corrupted" not in record.outcomes, run.mismatches
    # Greedy and seeded streams here recover from every fault: none is even lost.
    assert record.outcomes == ["identical"] * len(record.outcomes), record.errors


def test_a_frozen_last_stage_that_wakes_up_corrupts_nothing(chaos: ChaosRun):
    target = last_stage(chaos)
    record = long_round(chaos, Fault("stop", target, 8.0))
    assert record.failover, "an 8 s freeze outlasts the heartbeat timeout"
    assert_no_corruption(chaos, record)
    # On waking, the stage learned from the coordinator that its term was over and
    # dropped its layers and sessions at once (it did not wait for a new plan).
    log = chaos.mesh.stage_log(target)
    assert "this stage still held term" in log and "releasing layers" in log


def test_a_frozen_middle_stage_that_wakes_up_fails_nothing(chaos: ChaosRun):
    record = long_round(chaos, Fault("stop", middle_stage(chaos), 6.0))
    assert record.failover
    assert_no_corruption(chaos, record)


def test_a_slow_stage_and_a_short_freeze_change_no_output(chaos: ChaosRun):
    record = long_round(chaos, Fault("throttle", middle_stage(chaos), 3.0))
    assert_no_corruption(chaos, record)
    record = long_round(chaos, Fault("stop", last_stage(chaos), 1.0))
    assert not record.failover, "a 1 s freeze is within the heartbeat timeout"
    assert_no_corruption(chaos, record)


def test_a_killed_stage_fails_over_and_the_mesh_grows_back(chaos: ChaosRun):
    target = middle_stage(chaos)
    record = long_round(chaos, Fault("kill", target))
    assert record.failover
    assert_no_corruption(chaos, record)
    # The restarted stage took its place back: the mesh serves on 3 stages again.
    assigned = [s.node_id for s in chaos.mesh.status().stages if s.assigned]
    assert target in assigned and len(assigned) == 3


def test_a_stage_whose_frame_threads_hang_while_it_heartbeats_is_planned_around(
    chaos: ChaosRun,
):
    """The threads that read and process a stage's frames hang (ptrace-stopped while
    blocked, as a hung device call would leave them) and the process heartbeats on:
    no heartbeat timeout can see it. Stage 0's oldest frame goes unanswered past
    the stall timeout, the coordinator finds the stage that has not passed it on,
    plans again without it and keeps it out for a while; the streams resume on the
    new pipeline with the same text. Before, they waited for the threads (forever,
    for a hang that does not end)."""
    target = middle_stage(chaos)
    record = long_round(chaos, Fault("hang", target, 3 * STALL_TIMEOUT_S))
    assert record.failover, "a hang three times the stall timeout ends the term"
    assert_no_corruption(chaos, record)
    log = chaos.mesh.coordinator_log()
    assert f"({target} at" in log and "has not finished frame" in log
    assert "left out of plans" in log and "its stall quarantine is over" in log
    # The answers stage 0 waits for stuck on their way back (its answer reader
    # hangs): every stage passed the frame, so the last stage's return link is
    # blamed, and the new load gives stage 0 a new reader.
    record = long_round(chaos, Fault("hang", "stage-0", 3 * STALL_TIMEOUT_S))
    assert record.failover
    assert_no_corruption(chaos, record)
    assert "the return link to stage 0 is stuck" in chaos.mesh.coordinator_log()


def test_stage_0_stuck_in_its_own_compute_shows_in_the_status_and_clears(chaos: ChaosRun):
    """Stage 0's frame worker hangs: nothing can be planned around the frontend, but
    `status` says what is wrong while every heartbeat looks fine; when the worker
    comes back the request goes on with its text and the error clears."""
    from coordinator.chaos import run_stream

    spec = chaos.specs[0]
    errors: list[str] = []
    hang = threading.Thread(
        target=chaos.mesh.hang_threads,
        args=("stage-0", ("stage-worker",), 3 * STALL_TIMEOUT_S),
        daemon=True,
    )
    hang.start()

    def watch() -> None:
        while hang.is_alive():
            error = chaos.mesh.status().error
            if error:
                errors.append(error)
            time.sleep(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    outcome = run_stream(chaos.mesh.http_url, MODEL, spec)
    hang.join()
    watcher.join()
    assert outcome == chaos.expected[0]
    assert any(e.startswith("stage 0 is stuck: stage-0 at") for e in errors), errors
    wait_for(lambda: not chaos.mesh.status().error, 10, "the error to clear")


def test_a_paused_coordinator_fails_nothing_over(chaos: ChaosRun):
    """The coordinator stopped for 8 s (a paused VM, a starved host) heard no
    heartbeat meanwhile; the stages were fine all along. It judges their silence from
    when it runs again: no stage is taken for dead, the term stays, every stream
    keeps its text (before, it woke, saw every stage silent and failed them all
    over)."""
    term = chaos.mesh.status().term
    seen = len(chaos.mesh.coordinator_log())
    record = long_round(chaos, Fault("pause", "", 8.0))
    assert not record.failover, "nothing failed: nothing fails over"
    assert_no_corruption(chaos, record)
    since = chaos.mesh.coordinator_log()[seen:]
    assert "judging the stages' heartbeats from now on" in since
    assert "marking it dead" not in since and "is stuck" not in since
    # The term stays, unless the mesh grew back meanwhile (a stage an earlier test
    # quarantined may serve again while a slow round runs): a re-plan, not a failover.
    assert chaos.mesh.status().term == term or "planning again on" in since


def test_data_links_reset_between_live_stages_are_opened_again_by_a_new_load(chaos: ChaosRun):
    """Every process stays up and heartbeats; only the TCP connections between a
    stage and its neighbours are reset. The stage reports the broken link in its
    heartbeats, the coordinator plans again after a heartbeat timeout, and the new
    load opens new links: the streams continue with the same text (before, the
    mesh stayed on the broken links and every request timed out)."""
    for target in (middle_stage(chaos), last_stage(chaos)):
        record = long_round(chaos, Fault("reset", target))
        assert record.failover, "a broken data link ends its term"
        assert_no_corruption(chaos, record)
    assert "reports a broken data link" in chaos.mesh.coordinator_log()


def test_a_restarted_coordinator_takes_the_mesh_back_and_fails_over_later(chaos: ChaosRun):
    term = chaos.mesh.status().term
    record = long_round(chaos, Fault("coordinator", "", 2.0))
    assert_no_corruption(chaos, record)
    status = chaos.mesh.status()
    assert status.state == "serving" and status.term > term
    # The new coordinator supervises: a stage killed now fails over as before.
    record = long_round(chaos, Fault("kill", last_stage(chaos)))
    assert record.failover
    assert_no_corruption(chaos, record)


def serving_above(mesh: MeshProcesses, term: int, stages: int = 0) -> bool:
    """Whether the mesh's (restarted) coordinator serves a term above ``term`` (on
    ``stages`` stages, when given)."""
    try:
        status = mesh.status()
    except MeshError:  # the new coordinator is not listening yet
        return False
    assigned = sum(1 for s in status.stages if s.assigned)
    return status.state == "serving" and status.term > term and stages in (0, assigned)


def test_a_coordinator_restarted_without_its_state_file_still_goes_above_the_stages_term(
    tmp_path, tiny_package_factory
):
    package = tiny_package_factory("llama", layers=6)
    mesh = MeshProcesses(package, tmp_path, 2)
    try:
        mesh.start().wait_serving()
        term = mesh.status().term
        mesh.kill_coordinator()
        mesh.state_file.unlink()  # the new coordinator starts at term 0
        mesh.start_coordinator_again()

        wait_for(
            lambda: serving_above(mesh, term),
            120,
            "the new coordinator to load above the stages' term",
        )
        assert "claim with term" not in mesh.coordinator_log().split("listening on")[-1]
    finally:
        mesh.close()


def test_a_coordinator_restarted_after_a_stage_was_lost_serves_with_the_stages_alive(
    tmp_path, tiny_package_factory
):
    """The coordinator dies, a stage dies while it is down, and the coordinator is
    restarted with the same flags (--min-stages 3): once the stages alive have had
    time to join it again, it plans with them, as after a loss, and the mesh answers
    with the same text. Before, it waited for a third stage for ever (503s)."""
    from coordinator.chaos import StreamSpec, run_stream

    package = tiny_package_factory("llama", layers=6)
    mesh = MeshProcesses(package, tmp_path, 3)
    spec = StreamSpec("A restart test: the river and the", 24)
    try:
        mesh.start().wait_serving()
        term = mesh.status().term
        before = run_stream(mesh.http_url, MODEL, spec)
        assert before.error is None
        mesh.kill_coordinator()
        mesh.kill_stage("stage-2")
        mesh.start_coordinator_again()

        wait_for(
            lambda: serving_above(mesh, term, stages=2),
            120,
            "the restarted coordinator to serve on the 2 stages alive",
        )
        after = run_stream(mesh.http_url, MODEL, spec)
        assert after.error is None and after.text == before.text
    finally:
        mesh.close()


def mutual_tls(tmp_path: Path) -> tuple[tuple[str, ...], MeshSecurity]:
    """The TLS flags of a mesh with mutual TLS on 127.0.0.1, and a client's security."""
    from coordinator.certs import generate_cluster_certs

    made = generate_cluster_certs(tmp_path / "pki", ("127.0.0.1",))
    node = made.nodes[0]
    argv = ("--tls-cert", str(node.cert), "--tls-key", str(node.key))
    argv += ("--tls-ca", str(made.ca_cert), "--tls-mutual")
    security = MeshSecurity(
        tls_cert=node.cert, tls_key=node.key, tls_ca=made.ca_cert, tls_mutual=True
    )
    return argv, security


def stream_in_background(url: str, spec: StreamSpec) -> tuple[threading.Thread, list]:
    """Start ``spec``'s stream on a thread; returns once its first token came, with the
    thread and the list its outcome is appended to."""
    from coordinator.chaos import run_stream

    started = threading.Event()
    outcome: list = []
    streaming = threading.Thread(
        target=lambda: outcome.append(run_stream(url, MODEL, spec, started))
    )
    streaming.start()
    assert started.wait(60)
    return streaming, outcome


@pytest.mark.parametrize(("stages", "tls"), [(2, False), (3, False), (3, True)])
def test_health_says_503_while_stage_0s_link_is_broken_and_no_coordinator_acts(
    tmp_path, tiny_package_factory, stages: int, tls: bool
):
    """No coordinator runs and the last stage dies: nothing sent down would come
    back, so /health answers 503 with the reason (a load balancer stops sending
    clients there). Before, it said 200 "ok" for as long as no coordinator acted.
    With 3 stages the broken link is the middle stage's: it closes the link stage 0
    sends on, and the break reaches stage 0 (before, /health said 200 there even
    after stage 0's own link was seen; with mutual TLS it still did, until the
    listener shut down the TLS socket rather than the raw one). The coordinator
    restarted serves on the stages left: 200."""
    import httpx

    package = tiny_package_factory("llama", layers=6)
    argv, security = mutual_tls(tmp_path) if tls else ((), None)
    mesh = MeshProcesses(
        package, tmp_path, stages, coordinator_args=argv, stage_args=argv, security=security
    )
    try:
        mesh.start().wait_serving()
        url = mesh.http_url
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        status = mesh.status()
        last = max((s for s in status.stages if s.assigned), key=lambda s: s.stage_index)
        mesh.kill_coordinator()
        mesh.kill_stage(last.node_id)
        wait_for(
            lambda: httpx.get(url + "/health", timeout=10).status_code == 503,
            60,
            "/health to say 503",
        )
        assert "broken" in httpx.get(url + "/health", timeout=10).json()["reason"]
        mesh.start_coordinator_again()

        wait_for(
            lambda: serving_above(mesh, status.term, stages=stages - 1),
            120,
            "the restarted coordinator to serve on the stages left",
        )
        wait_for(lambda: httpx.get(url + "/health", timeout=10).status_code == 200, 60, "200")
    finally:
        mesh.close()


def test_health_says_503_while_a_hung_stage_holds_a_frame_and_no_coordinator_acts(
    tmp_path, tiny_package_factory
):
    """No coordinator runs and the last stage hangs (SIGSTOP) while a stream runs: no
    heartbeat rule and no broken link can see it, and nothing can plan around it.
    Once stage 0's oldest frame has waited past the coordinator's stall deadline
    (``--stall-timeout``, sent with the Load) /health answers 503 saying so; the
    stream keeps waiting, and when the stage wakes it ends with its no-fault text
    and /health says 200 again. Before, /health said 200 for the whole hang (up to
    the 120 s round timeout, when the stream failed)."""
    import httpx

    from coordinator.chaos import StreamSpec, classify, run_stream

    package = tiny_package_factory("llama", layers=6)
    mesh = MeshProcesses(
        package,
        tmp_path,
        2,
        coordinator_args=("--stall-timeout", "3"),
        stage_args=("--inject-delay-ms", "20"),
    )
    try:
        mesh.start().wait_serving()
        url = mesh.http_url
        spec = StreamSpec("A hung stage and no coordinator: a story about rivers", 200)
        expected = run_stream(url, MODEL, spec)
        assert expected.error is None, expected.error
        last = max((s for s in mesh.status().stages if s.assigned), key=lambda s: s.stage_index)
        streaming, outcome = stream_in_background(url, spec)
        mesh.kill_coordinator()
        mesh.signal_stage(last.node_id, signal.SIGSTOP)
        try:
            wait_for(
                lambda: httpx.get(url + "/health", timeout=10).status_code == 503,
                30,
                "/health to say 503 while the hung stage holds a frame",
            )
            reason = httpx.get(url + "/health", timeout=10).json()["reason"]
            assert "no answer from the pipeline" in reason, reason
            assert "coordinator has been unreachable" in reason, reason
            assert streaming.is_alive()
        finally:
            mesh.signal_stage(last.node_id, signal.SIGCONT)
        streaming.join(120)
        assert outcome and classify(outcome[0], expected) == "identical", outcome
        assert httpx.get(url + "/health", timeout=10).status_code == 200
    finally:
        mesh.close()


def test_health_stays_503_until_a_returning_coordinator_plans_around_a_hung_stage(
    tmp_path, tiny_package_factory
):
    """The last stage hangs (SIGSTOP) while no coordinator runs: stage 0's local stall
    rule says 503. The coordinator is then started again with the stage still hung:
    it waits for the stages to join again (its restart grace) before it plans
    without the silent one. /health keeps saying 503 until that new pipeline is
    loaded, and the stream ends with its no-fault text on it. Before, /health said
    200 from the coordinator's first answer on (about 10 s here), and new requests
    joined the stuck pipeline."""
    import httpx

    from coordinator.chaos import StreamSpec, classify, run_stream

    package = tiny_package_factory("llama", layers=6)
    mesh = MeshProcesses(
        package,
        tmp_path,
        2,
        coordinator_args=("--stall-timeout", "3"),
        stage_args=("--inject-delay-ms", "20"),
    )
    try:
        mesh.start().wait_serving()
        url = mesh.http_url
        term = mesh.status().term
        spec = StreamSpec("A hung stage and a coordinator that returns: a story about", 200)
        expected = run_stream(url, MODEL, spec)
        assert expected.error is None, expected.error
        last = max((s for s in mesh.status().stages if s.assigned), key=lambda s: s.stage_index)
        streaming, outcome = stream_in_background(url, spec)
        mesh.kill_coordinator()
        mesh.signal_stage(last.node_id, signal.SIGSTOP)
        try:
            wait_for(
                lambda: httpx.get(url + "/health", timeout=10).status_code == 503,
                30,
                "/health to say 503 while the hung stage holds a frame",
            )
            mesh.start_coordinator_again()
            reasons: list[str] = []

            def healthy() -> bool:
                health = httpx.get(url + "/health", timeout=10)
                if health.status_code == 200:
                    return True
                reasons.append(health.json()["reason"])
                time.sleep(0.2)
                return False

            wait_for(healthy, 90, "/health to say 200 once a pipeline without the stage serves")
            # The first 200 comes with the new pipeline, not with the coordinator's
            # first answer.
            assert mesh.status().term > term, reasons[-3:]
            assert any("reachable again for" in r for r in reasons), reasons[-3:]
        finally:
            mesh.signal_stage(last.node_id, signal.SIGCONT)
        streaming.join(120)
        assert outcome and classify(outcome[0], expected) == "identical", outcome
    finally:
        mesh.close()


def test_data_links_reset_while_no_coordinator_acts_are_opened_again_by_the_stages(
    tmp_path, tiny_package_factory
):
    """No coordinator runs and the data links of a live stage are reset (an RST from
    the network, every process up) during a stream: nothing would load a new
    pipeline, so the stages open the broken links again themselves on the same term
    (each once the one below it is whole), stage 0's requests read their tokens
    again, and the stream ends with its no-fault text. First the middle stage
    (stage 0's Forward link, its own Forward and Return links), then the last
    (its Return link to stage 0: it tells stage 0 that answers may have been lost).
    Before, the broken links stayed broken: /health said 503 and the stream failed
    after the 60 s recovery timeout until a coordinator came back."""
    import httpx

    from coordinator.chaos import StreamSpec, classify, run_stream

    package = tiny_package_factory("llama", layers=6)
    mesh = MeshProcesses(package, tmp_path, 3, stage_args=("--inject-delay-ms", "20"))
    try:
        mesh.start().wait_serving()
        url = mesh.http_url
        # Speculation off: a repeated request would be drafted whole and end at once.
        spec = StreamSpec(
            "",
            200,
            messages=({"role": "user", "content": "Links that reset: a story about bridges"},),
            extra=(("speculation", "false"),),
        )
        expected = run_stream(url, MODEL, spec)
        assert expected.error is None, expected.error
        stages = sorted(
            (s for s in mesh.status().stages if s.assigned), key=lambda s: s.stage_index
        )
        first, middle, last = (s.node_id for s in stages)
        mesh.kill_coordinator()
        for target, opened in ((middle, ("forward", "return")), (last, ("return",))):
            started = threading.Event()
            outcome: list = []
            streaming = threading.Thread(
                target=lambda done=outcome, flag=started: done.append(
                    run_stream(url, MODEL, spec, flag)
                )
            )
            streaming.start()
            assert started.wait(60)
            time.sleep(1.0)
            assert mesh.reset_links(target) > 0
            streaming.join(150)
            assert outcome and classify(outcome[0], expected) == "identical", outcome
            for kind in opened:
                assert f"opened the {kind} link of term" in mesh.stage_log(target), kind
        assert "opened the forward link of term" in mesh.stage_log(first)
        wait_for(lambda: httpx.get(url + "/health", timeout=10).status_code == 200, 30, "200")
        again = run_stream(url, MODEL, spec)
        assert classify(again, expected) == "identical", again
    finally:
        mesh.close()


@pytest.mark.parametrize("tls", [False, True])
def test_a_link_between_two_workers_reset_while_no_coordinator_acts_heals(
    tmp_path, tiny_package_factory, tls: bool
):
    """No coordinator runs and only the connection between the middle and the last
    stage is reset mid-stream. The middle stage opens its Forward link again and
    tells stage 0 so on its Return link; the break also travels up (the middle stage
    closes the link stage 0 sends on, which stage 0 opens again). The stream ends
    with its no-fault text, plain and with mutual TLS. Before, with TLS the break
    never reached stage 0 and nothing told it the pipeline was whole again: every
    running request failed at the 60 s recovery timeout."""
    import httpx

    from coordinator.chaos import StreamSpec, classify, run_stream

    package = tiny_package_factory("llama", layers=6)
    tls_argv, security = mutual_tls(tmp_path) if tls else ((), None)
    mesh = MeshProcesses(
        package,
        tmp_path,
        3,
        coordinator_args=tls_argv,
        stage_args=("--inject-delay-ms", "20", *tls_argv),
        security=security,
    )
    try:
        mesh.start().wait_serving()
        url = mesh.http_url
        spec = StreamSpec(
            "",
            200,
            messages=({"role": "user", "content": "A link between workers: a story"},),
            extra=(("speculation", "false"),),
        )
        expected = run_stream(url, MODEL, spec)
        assert expected.error is None, expected.error
        stages = sorted(
            (s for s in mesh.status().stages if s.assigned), key=lambda s: s.stage_index
        )
        first, middle, last = (s.node_id for s in stages)
        mesh.kill_coordinator()
        streaming, outcome = stream_in_background(url, spec)
        time.sleep(1.0)
        assert mesh.reset_links(middle, to=last) > 0
        streaming.join(150)
        assert outcome and classify(outcome[0], expected) == "identical", outcome
        assert "opened the forward link of term" in mesh.stage_log(middle)
        wait_for(lambda: httpx.get(url + "/health", timeout=10).status_code == 200, 30, "200")
    finally:
        mesh.close()


def test_requests_of_every_feature_survive_a_killed_last_stage(chaos: ChaosRun):
    """n choices, log-probabilities, a forced tool call and a JSON schema (grammars on
    the last stage), predictions and stop strings, all in flight when the last stage
    dies: each continues on the new pipeline to its no-fault answer. (Last of the
    module's rounds: the new last stage's first grammars make a round of a second or
    more, which raises the stall deadline of the hang tests for the next rounds.)"""
    featured = [i for i, spec in enumerate(chaos.specs) if spec.feature]
    assert len(featured) >= 7
    # The no-fault answers took those paths: two choices, calls, log-probabilities.
    answers = {chaos.specs[i].feature: json.loads(chaos.expected[i].text) for i in featured}
    assert len(answers["n"]) == 2
    assert answers["tools"][0]["calls"] and not answers["tools"][0]["content"]
    assert answers["logprobs"][0]["tokens"] and chaos.expected[featured[1]].logprobs
    json.loads(answers["schema"][0]["content"])
    record = chaos.round(Fault("kill", last_stage(chaos)), chosen=featured)
    assert record.failover
    assert_no_corruption(chaos, record)


def test_local_stages_do_not_outlive_up(tmp_path, tiny_package_factory):
    """`up` spawns its stages; SIGKILL of `up` takes them down too."""
    import subprocess
    import sys

    package = tiny_package_factory("llama", layers=6)
    state = tmp_path / "state.json"
    up = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "coordinator.cli",
            "up",
            "--model",
            str(package),
            "--listen",
            "127.0.0.1:0",
            "--http-port",
            "0",
            "--spawn-stages",
            "1",
            "--state-file",
            str(state),
            "--cache-dir",
            str(tmp_path / "cache"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(lambda: state.exists() and "term" in state.read_text(), 120, "serving")
        children = _children_of(up.pid)
        assert len(children) == 2
        up.send_signal(signal.SIGKILL)
        up.wait(10)
        wait_for(lambda: not any(_alive(pid) for pid in children), 30, "the stages to exit")
    finally:
        if up.poll() is None:
            up.kill()


def test_up_fails_fast_when_its_http_port_is_taken(tmp_path, tiny_package_factory):
    """Another server on the HTTP port: `up` says so and exits, rather than waiting
    forever for a stage 0 that cannot serve."""
    import socket
    import subprocess
    import sys

    package = tiny_package_factory("llama", layers=6)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        up = subprocess.run(
            [
                sys.executable,
                "-m",
                "coordinator.cli",
                "up",
                "--model",
                str(package),
                "--listen",
                "127.0.0.1:0",
                "--http-host",
                "127.0.0.1",
                "--http-port",
                str(port),
                "--cache-dir",
                str(tmp_path / "cache"),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert up.returncode != 0
    assert f"cannot listen on 127.0.0.1:{port}" in up.stderr
    assert "choose another --http-port" in up.stderr


def _read_stream(url: str, body: dict) -> tuple[threading.Thread, list[dict], threading.Event]:
    """A thread streaming ``body`` to /v1/completions: the reader, the SSE objects it
    has read so far, and an event set at the first."""
    import httpx

    pieces: list[dict] = []
    first = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as reply:
            for line in reply.iter_lines():
                if line.startswith("data: {"):
                    pieces.append(json.loads(line[6:]))
                    first.set()

    reader = threading.Thread(target=stream)
    reader.start()
    return reader, pieces, first


def _children_of(pid: int) -> list[int]:
    from pathlib import Path

    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    from pathlib import Path

    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _cmdline(pid: int) -> str:
    from pathlib import Path

    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_up_starts_a_killed_local_stage_0_again_and_serves_on_the_same_port(
    tmp_path, tiny_package_factory
):
    """`up` keeps its local stages running: SIGKILL of stage 0 (the HTTP API) and
    later of stage 1 after the mesh served; each is started again, the mesh plans
    again, and the API answers on the same port with the same greedy text."""
    import socket
    import subprocess
    import sys

    import httpx

    package = tiny_package_factory("llama", layers=6)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        http_port = probe.getsockname()[1]
    state = tmp_path / "state.json"
    up = subprocess.Popen(
        [sys.executable, "-m", "coordinator.cli", "up", "--model", str(package)]
        + ["--listen", "127.0.0.1:0", "--http-port", str(http_port), "--spawn-stages", "1"]
        + ["--state-file", str(state), "--cache-dir", str(tmp_path / "cache")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{http_port}"
    body = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}

    def answer() -> str | None:
        try:
            reply = httpx.post(url + "/v1/completions", json=body, timeout=30)
        except httpx.HTTPError:
            return None
        return reply.json()["choices"][0]["text"] if reply.status_code == 200 else None

    try:
        wait_for(lambda: answer() is not None, 180, "the mesh to serve")
        first = answer()
        for node in ("local-0", "local-1"):
            (pid,) = [p for p in _children_of(up.pid) if f"--node-id {node} " in _cmdline(p)]
            term = json.loads(state.read_text())["max_term"]
            os.kill(pid, signal.SIGKILL)
            wait_for(
                lambda pid=pid, node=node: any(
                    f"--node-id {node} " in _cmdline(p) and p != pid for p in _children_of(up.pid)
                ),
                60,
                f"{node} to be started again",
            )
            wait_for(
                lambda term=term: json.loads(state.read_text())["max_term"] > term,
                120,
                "a new term",
            )
            wait_for(lambda: answer() == first, 120, f"the same answer after {node} came back")
        assert up.poll() is None
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(30)
        except subprocess.TimeoutExpired:
            up.kill()


def test_sigterm_drains_stage_0_its_streams_finish_and_new_requests_get_503(
    tmp_path, tiny_package_factory
):
    """SIGTERM to stage 0: a stream running then goes on to its last token; meanwhile
    new generations and /health get 503 (code ``draining``) while /v1/models still
    answers; once the stream is done the process exits on its own, status 0."""

    import httpx

    package = tiny_package_factory("llama", layers=6)
    processes = MeshProcesses(
        package,
        tmp_path,
        2,
        stage0_args=("--drain-timeout", "60"),
        stage_args=("--inject-delay-ms", "15"),
    )
    try:
        processes.start().wait_serving()
        url = processes.http_url
        body = {
            "prompt": "Once upon a time",
            "max_tokens": 120,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        reader, pieces, first = _read_stream(url, body)
        assert first.wait(60)
        stage0 = processes.stages["stage-0"]
        stage0.send_signal(signal.SIGTERM)
        wait_for(lambda: httpx.get(url + "/health", timeout=10).status_code == 503, 30, "draining")
        assert httpx.get(url + "/health", timeout=10).json()["status"] == "draining"
        plain = {k: v for k, v in body.items() if not k.startswith("stream")}
        refused = httpx.post(url + "/v1/completions", json=plain, timeout=30)
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "draining" and refused.headers["retry-after"]
        assert httpx.get(url + "/v1/models", timeout=10).status_code == 200
        reader.join(120)
        finish = [c["finish_reason"] for p in pieces for c in p["choices"] if c["finish_reason"]]
        assert finish == ["length"]
        assert [p["usage"]["completion_tokens"] for p in pieces if p.get("usage")] == [120]
        assert stage0.wait(60) == 0
        assert "draining" in processes.stage_log("stage-0")
    finally:
        processes.close()


def test_a_second_sigterm_ends_the_drain_and_the_running_stream_gets_an_error(
    tmp_path, tiny_package_factory
):
    """SIGTERM twice to stage 0 (an operator's second Ctrl-C through ``up``): the
    process stops without waiting out its drain, and a stream still running ends with
    the API's error event (503, "send it again") instead of a cut connection."""

    import httpx

    package = tiny_package_factory("llama", layers=6)
    processes = MeshProcesses(
        package,
        tmp_path,
        2,
        stage0_args=("--drain-timeout", "600"),
        stage_args=("--inject-delay-ms", "100"),
    )
    try:
        processes.start().wait_serving()
        url = processes.http_url
        body = {
            "prompt": "Once upon a time",
            "max_tokens": 400,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        reader, pieces, first = _read_stream(url, body)
        assert first.wait(60)
        stage0 = processes.stages["stage-0"]
        stage0.send_signal(signal.SIGTERM)
        wait_for(lambda: httpx.get(url + "/health", timeout=10).status_code == 503, 30, "draining")
        stage0.send_signal(signal.SIGTERM)
        assert stage0.wait(60) == 0
        reader.join(60)
        assert not reader.is_alive()
        errors = [p["error"] for p in pieces if "error" in p]
        assert len(errors) == 1 and "send it again" in errors[0]["message"], pieces[-1]
        tokens = sum(1 for p in pieces for c in p.get("choices", []) if c.get("text"))
        assert 0 < tokens < 400
        assert not [c for p in pieces for c in p.get("choices", []) if c.get("finish_reason")]
        assert "signal 15 again" in processes.stage_log("stage-0")
    finally:
        processes.close()


def test_a_second_ctrl_c_on_up_stops_without_waiting_out_the_drain(tmp_path, tiny_package_factory):
    """Ctrl-C on `up` with a long stream running: stage 0 drains (up to 600 s here);
    a second Ctrl-C stops it, the stream ends with the API's error event, and `up`
    and its stages exit."""
    import socket
    import subprocess
    import sys

    import httpx

    package = tiny_package_factory("llama", layers=6)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        http_port = probe.getsockname()[1]
    up = subprocess.Popen(
        [sys.executable, "-m", "coordinator.cli", "up", "--model", str(package)]
        + ["--listen", "127.0.0.1:0", "--http-port", str(http_port), "--spawn-stages", "1"]
        + ["--cache-dir", str(tmp_path / "cache"), "--drain-timeout", "600"]
        + ["--inject-delay-ms", "100"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{http_port}"
    body = {"prompt": "Once", "max_tokens": 400, "ignore_eos": True, "stream": True}

    def serving() -> bool:
        try:
            return httpx.get(url + "/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(serving, 180, "the mesh to serve")
        stages = _children_of(up.pid)
        reader, pieces, first = _read_stream(url, body)
        assert first.wait(60)
        up.send_signal(signal.SIGINT)
        wait_for(lambda: not serving(), 30, "stage 0 to drain")
        assert reader.is_alive() and up.poll() is None
        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 0
        reader.join(30)
        errors = [p["error"] for p in pieces if "error" in p]
        assert len(errors) == 1 and "send it again" in errors[0]["message"]
        assert all(not os.path.exists(f"/proc/{pid}") for pid in stages)
    finally:
        if up.poll() is None:
            up.kill()
