"""The order in which a stage node processes the frames it receives: a frame that
arrives while the stage is idle is processed by the thread that received it (no hand-
over to the worker thread), frames that arrive while it is busy wait for the worker,
and every frame is processed once, one at a time, in arrival order."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest
import torch

from mesh.codec import (
    ClaimRequest,
    Frame,
    PrepareRequest,
    Segment,
    SegmentKind,
    StageLoadRequest,
    WireDType,
)
from mesh.codec_data import result_from_proto
from mesh.frames import FrameProgress
from mesh.types import LayerRange, SamplingParams
from stage import node as node_module
from stage.node import LoadedStage, NodeSettings, StageNode, WaitingFrame


class RecordingLink:
    """The last stage's return link: keeps what is sent and the thread that sent it;
    ``hold`` makes a send wait until it is set (the stage stays busy meanwhile)."""

    def __init__(self) -> None:
        self.address, self.name = "stage-0", "return"
        self.sent: list[tuple[int, str]] = []
        self.hold = threading.Event()
        self.hold.set()
        self.entered = threading.Event()

    @property
    def broken(self) -> bool:
        return False

    def send(self, message) -> None:
        self.entered.set()
        self.hold.wait(timeout=30)
        result = result_from_proto(message)
        self.sent.append((result.frame_id, threading.current_thread().name))

    def close(self) -> None:
        pass


@pytest.fixture
def last_stage(tmp_path, tiny_package_factory, monkeypatch):
    package = tiny_package_factory("llama", layers=2)
    link = RecordingLink()
    monkeypatch.setattr(node_module, "open_return_link", lambda *args, **kwargs: link)
    node = StageNode(NodeSettings(node_id="n1", cache_dir=tmp_path / "cache"), "127.0.0.1:1")
    node.claim(ClaimRequest(3, "coord", "tiny-llama"))
    node.prepare(PrepareRequest(3, str(package), LayerRange(1, 2)))
    deadline = time.monotonic() + 60
    while node.inventory(3).state != "ready":
        assert time.monotonic() < deadline, node.inventory(3)
        time.sleep(0.05)
    node.load(
        StageLoadRequest(
            term=3,
            stage_index=1,
            stage_count=2,
            layer_range=LayerRange(1, 2),
            package_ref=str(package),
            manifest_sha256="",
            downstream=None,
            return_endpoint="127.0.0.1:2",
            wire_dtype=WireDType.F32,
        )
    )
    yield node, link
    link.hold.set()
    node.stop()


def frame(node: StageNode, frame_id: int) -> Frame:
    hidden = node.loaded.engine.runtime.hidden_size
    segment = Segment(
        f"s{frame_id}",
        f"s{frame_id}",
        SegmentKind.PREFILL,
        0,
        token_ids=(1, 5, 9),
        sampling=SamplingParams(),
    )
    generator = torch.Generator().manual_seed(frame_id)
    return Frame(3, frame_id, (segment,), torch.randn(3, hidden, generator=generator))


def test_a_frame_that_finds_the_stage_idle_is_processed_by_its_receiver(last_stage) -> None:
    node, link = last_stage
    node.accept_frame(frame(node, 1), None)
    assert link.sent == [(1, threading.current_thread().name)]


def test_frames_that_find_the_stage_busy_wait_and_keep_their_order(last_stage) -> None:
    node, link = last_stage
    link.hold.clear()
    first = threading.Thread(target=node.accept_frame, args=(frame(node, 1), None), name="rx-1")
    first.start()
    assert link.entered.wait(timeout=30)  # frame 1 is being processed on rx-1
    others = [
        threading.Thread(target=node.accept_frame, args=(frame(node, i), None), name=f"rx-{i}")
        for i in (2, 3, 4)
    ]
    for thread in others:
        thread.start()
        thread.join(timeout=30)  # queued: the receiver does not wait for the busy stage
        assert not thread.is_alive()
    assert link.sent == []
    link.hold.set()
    first.join(timeout=30)
    deadline = time.monotonic() + 30
    while len(link.sent) < 4:
        assert time.monotonic() < deadline, link.sent
        time.sleep(0.01)
    assert [frame_id for frame_id, _ in link.sent] == [1, 2, 3, 4]
    assert link.sent[0][1] == "rx-1"
    assert all(thread == "stage-worker" for _, thread in link.sent[1:])
    # The stage is idle again: the next frame is processed by its receiver.
    node.accept_frame(frame(node, 5), None)
    assert link.sent[-1] == (5, threading.current_thread().name)


def test_only_decode_frames_count_in_the_step_time_heartbeats_carry(last_stage) -> None:
    """The rebalance compares the stages' decode steps (what their probes measure);
    a frame with prompt rows (a burst of them re-reads every request after a
    failover) is left out of ``step_ms``."""
    node, _link = last_stage
    node.accept_frame(frame(node, 1), None)  # a prompt of 3 rows
    assert node.heartbeat().step_frames == 0
    hidden = node.loaded.engine.runtime.hidden_size
    decode = Segment("s1", "s1", SegmentKind.DECODE, 3, token_ids=(4,))
    node.accept_frame(Frame(3, 2, (decode,), torch.randn(1, hidden)), None)
    beat = node.heartbeat()
    assert beat.step_frames == 1 and beat.step_ms > 0
    mixed = (
        Segment("s1", "s1", SegmentKind.DECODE, 4, token_ids=(6,)),
        Segment("s3", "s3", SegmentKind.PREFILL, 0, token_ids=(2, 3), sampling=SamplingParams()),
    )
    node.accept_frame(Frame(3, 3, mixed, torch.randn(3, hidden)), None)
    assert node.heartbeat().step_frames == 1


def frames_of(progress: FrameProgress) -> FrameProgress:
    """``progress`` without the bytes this process's data links read (a counter of
    the whole process: tests of links that ran before add to it)."""
    return replace(progress, received=0)


def test_heartbeats_carry_the_highest_frame_the_stage_has_finished(last_stage) -> None:
    """Frames that wait for this stage stay unfinished in the progress the
    coordinator's stall rule reads, a frame computed and waiting on its send is
    finished, an old term's frame never counts."""
    node, link = last_stage
    assert frames_of(node.heartbeat().progress) == FrameProgress()
    node.accept_frame(frame(node, 7), None)
    assert frames_of(node.heartbeat().progress) == FrameProgress(done=7)
    link.hold.clear()
    link.entered.clear()  # frame 7's send set it
    busy = threading.Thread(target=node.accept_frame, args=(frame(node, 8), None))
    busy.start()
    assert link.entered.wait(timeout=30)
    node.accept_frame(frame(node, 9), None)  # queued behind frame 8
    # Frame 8 is computed and waits on its send (the link, the next hop): finished
    # here. Frame 9 waits for this stage: not.
    assert node.heartbeat().progress.done == 8
    link.hold.set()
    busy.join(timeout=30)
    deadline = time.monotonic() + 30
    while node.heartbeat().progress.done != 9:
        assert time.monotonic() < deadline, node.heartbeat().progress
        time.sleep(0.01)
    stale = frame(node, 12)
    node.accept_frame(Frame(2, 12, stale.segments, stale.hidden), None)
    assert node.heartbeat().progress.done == 9
    # Only stage 0 says what it waits for: a last stage ignores a snapshot.
    node.waiting = WaitingFrame(3, 10, time.perf_counter() - 5.0, 0.5)
    assert frames_of(node.heartbeat().progress) == FrameProgress(done=9)


def test_stage_0_reports_the_frame_it_waits_on_with_the_round_it_should_take(tmp_path) -> None:
    node = StageNode(NodeSettings(node_id="n0", cache_dir=tmp_path / "cache"), "127.0.0.1:1")
    try:
        request = StageLoadRequest(
            term=4,
            stage_index=0,
            stage_count=3,
            layer_range=LayerRange(0, 1),
            package_ref="p",
            manifest_sha256="",
            downstream=None,
            return_endpoint="",
            wire_dtype=WireDType.F32,
        )
        loaded = LoadedStage(request=request, engine=None, package_dir=tmp_path)
        for frame_id, seconds in ((5, 0.2), (6, 0.4)):
            loaded.finished(frame_id, seconds)
        node.loaded = loaded
        node.waiting = WaitingFrame(4, 6, time.perf_counter() - 2.0, 1.5)
        progress = node.progress()
        assert (progress.done, progress.waiting_frame) == (6, 6)
        assert 2.0 <= progress.waiting_s < 10.0
        assert progress.waiting_compute_s == pytest.approx(0.4)  # its own compute for it
        assert progress.longest_round_s == 1.5
        # A snapshot of another term, or none: nothing is waited on.
        node.waiting = WaitingFrame(3, 6, time.perf_counter(), 1.5)
        assert frames_of(node.progress()) == FrameProgress(done=6)
        for frame_id in range(7, 7 + node_module.COMPUTE_TIMES_KEPT):
            loaded.finished(frame_id, 0.1)
        assert 5 not in loaded.compute_s and len(loaded.compute_s) == node_module.COMPUTE_TIMES_KEPT
    finally:
        node.loaded = None
        node.stop()


def test_a_heartbeat_never_waits_for_a_step(last_stage) -> None:
    """A long prompt chunk holds the runtime for seconds: a heartbeat (or a metrics
    scrape) that waited for it made the coordinator take a busy stage for dead, fail
    it over, re-read the prompt and time out again (seen with a 4,160-token tools
    prompt on a loaded 2-core machine). It reports the last figures instead."""
    node, _ = last_stage
    node.accept_frame(frame(node, 1), None)
    before = node.heartbeat()
    assert before.active_sessions == 1 and before.kv_bytes > 0
    runtime = node.loaded.engine.runtime
    held = threading.Event()
    release = threading.Event()

    def long_step() -> None:
        with runtime._lock:  # what forward_batch holds for a whole step
            held.set()
            release.wait(timeout=30)

    stepper = threading.Thread(target=long_step)
    stepper.start()
    try:
        assert held.wait(timeout=10)
        beat: list = []
        reader = threading.Thread(target=lambda: beat.append(node.heartbeat()))
        reader.start()
        reader.join(timeout=5)
        assert beat, "the heartbeat waited for the step"
        assert (beat[0].active_sessions, beat[0].kv_bytes) == (1, before.kv_bytes)
        assert node.active_sessions() == 1
    finally:
        release.set()
        stepper.join(timeout=10)


def test_a_stage_whose_frame_is_stuck_past_the_limit_exits_to_be_restarted(last_stage) -> None:
    """A frame that never finishes (a hung device call, a deadlock) is cleared only by
    a restart: past ``--stuck-exit-after`` the stage exits with status 70, and its
    service manager (or ``up``) starts it again. A frame that finishes in time, or a
    limit of 0, changes nothing."""
    from dataclasses import replace as replaced

    node, link = last_stage
    exits: list[int] = []
    node._exit = exits.append
    # A limit no busy machine reaches between the frame's start and the check.
    node.settings = replaced(node.settings, stuck_exit_after_s=60.0)
    link.hold.clear()
    link.entered.clear()
    stuck = threading.Thread(target=node.accept_frame, args=(frame(node, 1), None))
    stuck.start()
    assert link.entered.wait(timeout=30)
    node._check_stuck()
    assert exits == []  # not yet past the limit
    time.sleep(0.4)
    node.settings = replaced(node.settings, stuck_exit_after_s=0.0)
    node._check_stuck()
    assert exits == []  # the watchdog off
    node.settings = replaced(node.settings, stuck_exit_after_s=0.3)
    node._check_stuck()
    assert exits == [node_module.STUCK_EXIT_STATUS]
    link.hold.set()
    stuck.join(timeout=30)
    node._check_stuck()
    assert exits == [node_module.STUCK_EXIT_STATUS]  # nothing processing now


def test_the_stuck_frame_watch_runs_on_a_thread_of_its_own(tmp_path, monkeypatch) -> None:
    """Not on the idle sweep, which waits for the runtime a stuck step holds."""
    monkeypatch.setattr(node_module, "IDLE_SWEEP_S", 0.05)
    settings = NodeSettings(node_id="n9", cache_dir=tmp_path / "cache", stuck_exit_after_s=0.2)
    node = StageNode(settings, "127.0.0.1:1")
    exits: list[int] = []
    node._exit = exits.append
    try:
        names = {t.name for t in threading.enumerate()}
        assert "stuck-watch" in names
        node._processing = (5, time.monotonic() - 10.0)
        deadline = time.monotonic() + 10
        while not exits:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert exits[0] == node_module.STUCK_EXIT_STATUS
    finally:
        node._processing = None
        node.stop()


def test_a_stage_that_lets_go_of_its_layers_closes_the_links_that_bring_it_frames(
    last_stage,
) -> None:
    """Released (the coordinator planned without the stage above, or fenced this
    one), a stage closes the framed TCP Forward links into it, not its other links:
    an upstream stage still serving the term would otherwise send frames nobody
    answers (the refusals go back on a Return link closed too) and stage 0's requests
    would wait for their round timeout behind a /health that says 200. A link opened
    later is closed by the first frame of a term the stage let go of; a frame of a
    term it has not seen yet leaves it open (its Load may be on the way)."""
    from mesh.proto.v1 import data_pb2
    from mesh.security import MeshSecurity
    from stage.servicers import DataServicer
    from stage.tcp_data import KIND_FORWARD, KIND_RETURN, TcpDataServer, TcpLink

    node, _ = last_stage
    servicer = DataServicer(node, lambda result: None)
    server = TcpDataServer("127.0.0.1", 0, servicer.frame_bytes, servicer.result_bytes)
    servicer.tcp = server.start()
    address = f"127.0.0.1:{server.port}"
    broken: list[str] = []
    links = []

    def link(kind: int) -> TcpLink:
        opened = TcpLink(address, kind, lambda e: broken.append(str(e)), security=MeshSecurity())
        links.append(opened)
        return opened

    def sent_on(opened: TcpLink, term: int, frame_id: int) -> None:
        opened.send(data_pb2.Frame(term=term, frame_id=frame_id))

    try:
        forward, returns = link(KIND_FORWARD), link(KIND_RETURN)
        sent_on(forward, 2, 1)  # an older term: refused, and its link is over
        wait_for_condition(lambda: forward.broken)
        forward = link(KIND_FORWARD)
        sent_on(forward, 3, 2)  # the term served: refused as undecodable, kept open
        time.sleep(1.0)
        assert not forward.broken
        node.release(3, "released by the coordinator")
        # A link is marked broken just before its callback reports it.
        wait_for_condition(lambda: forward.broken and len(broken) == 2)
        assert not returns.broken
        later = link(KIND_FORWARD)
        sent_on(later, 4, 3)  # not seen yet: refused, the link stays
        time.sleep(1.0)
        assert not later.broken
        sent_on(later, 3, 4)
        wait_for_condition(lambda: later.broken)
    finally:
        for opened in links:
            opened.close()
        server.close()


def test_a_released_stage_ends_the_grpc_forward_streams_into_it(last_stage) -> None:
    from mesh.grpc_util import bind, channel, new_server
    from mesh.proto.v1 import data_pb2_grpc
    from mesh.security import MeshSecurity
    from stage.servicers import DataServicer

    node, _ = last_stage
    server = new_server(16, MeshSecurity())
    data = DataServicer(node, lambda result: None)
    data_pb2_grpc.add_StageDataServicer_to_server(data, server)
    port = bind(server, "127.0.0.1:0", MeshSecurity())
    server.start()
    held = threading.Event()

    def frames():
        held.wait(timeout=60)
        return
        yield

    ch = channel(f"127.0.0.1:{port}", MeshSecurity())
    try:
        answers = data_pb2_grpc.StageDataStub(ch).Forward(frames(), timeout=60)
        wait_for_condition(lambda: data._open["Forward"] == 1)
        node.release(3, "released by the coordinator")
        assert list(answers) == []  # the stream ended without waiting for the client
        assert not held.is_set()
    finally:
        held.set()
        ch.close()
        server.stop(None)


class BrokenAtOnce(RecordingLink):
    """A link that broke as soon as it was opened (a flapping connection)."""

    @property
    def broken(self) -> bool:
        return True

    def send(self, message) -> None:
        from mesh.errors import Unavailable

        raise Unavailable("return link to stage-0 is down: reset again")


def test_a_broken_link_is_opened_again_only_while_no_coordinator_acts_and_the_peer_serves_the_term(
    last_stage, monkeypatch, caplog
) -> None:
    """The last stage's Return link breaks. While the coordinator answers, it is its
    call (it plans a new pipeline); once it cannot be reached the stage opens the
    link again itself, but only to a stage 0 that still serves the same term. The
    new link first carries the note that answers may have been lost (frame 0,
    ``reopened``), and the heartbeat no longer reports a broken link. A link that
    breaks again before the stage has taken it is opened once more."""
    from mesh.errors import Unavailable

    node, _ = last_stage
    loaded = node.loaded
    monkeypatch.setattr(node_module, "REPAIR_INTERVAL_S", 0.05)
    serving = {"term": 2}
    monkeypatch.setattr(
        node_module, "peer_serving", lambda address, timeout: (serving["term"], False)
    )
    again = RecordingLink()
    opened = [BrokenAtOnce(), again]  # the first breaks before the stage takes it
    monkeypatch.setattr(node_module, "open_return_link", lambda *args, **kwargs: opened.pop(0))
    reopened: list[str] = []
    node.on_link_reopened(lambda of, kind: reopened.append(kind))
    outage = {"s": 0.0}
    node.coordinator_outage = lambda: outage["s"]
    caplog.set_level("INFO", logger="stage.node")
    node._return_broken(loaded, Unavailable("connection reset"))
    assert "cannot reach stage 0" in node.heartbeat().link_error
    time.sleep(0.5)
    assert not reopened  # the coordinator answers: it plans around the break
    outage["s"] = 5.0
    wait_for_condition(lambda: "serves term 2, not term 3" in caplog.text)
    assert not reopened and loaded.returns is not again
    serving["term"] = 3
    wait_for_condition(lambda: reopened == ["return", "return"])
    assert node.loaded.returns is again and node.heartbeat().link_error == ""
    assert [frame_id for frame_id, _ in again.sent] == [0]
    assert not opened
    wait_for_condition(lambda: not loaded.repairing)  # its thread ended
    sample = node.metrics.registry.get_sample_value
    # The fake link that broke at once never reported its break.
    assert sample("mesh_link_breaks_total", {"link": "return"}) == 1
    assert sample("mesh_link_reopened_total", {"link": "return"}) == 2


def test_a_middle_stage_that_opens_its_forward_link_again_tells_stage_0(
    last_stage, monkeypatch
) -> None:
    """A stage after stage 0 whose Forward link broke while no coordinator acts opens
    it again, then sends stage 0 a note on its Return link (``reopened_link``
    "forward", frame 0: nothing was lost on that link): the requests the break
    failed may read their tokens again even if the break never reached stage 0's
    own link (before, they waited until the recovery timeout failed them)."""
    from dataclasses import replace

    from mesh.codec_control import PeerRef
    from mesh.errors import Unavailable

    node, returns = last_stage
    loaded = node.loaded
    # The stage as a middle one: a stage after it.
    loaded.request = replace(loaded.request, downstream=PeerRef("n2", "127.0.0.1:3"))
    monkeypatch.setattr(node_module, "REPAIR_INTERVAL_S", 0.05)
    monkeypatch.setattr(node_module, "peer_serving", lambda address, timeout: (3, False))
    forward = RecordingLink()
    monkeypatch.setattr(node_module, "open_forward_link", lambda *args, **kwargs: forward)
    notes: list = []
    returns.send = lambda message: notes.append(result_from_proto(message))
    node.coordinator_outage = lambda: 5.0
    node._downstream_broken(loaded, Unavailable("connection reset"))
    wait_for_condition(lambda: loaded.forward is forward)
    wait_for_condition(lambda: any(n.reopened for n in notes))
    note = next(n for n in notes if n.reopened)
    assert (note.term, note.frame_id, note.reopened_link) == (3, 0, "forward")
    assert node.heartbeat().link_error == ""


def wait_for_condition(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)
