"""A stage node's terms, in process: errors carry the term of the frame they answer,
a stage told that the coordinator moved on releases at once, and a frame of a newer
term makes it ask the coordinator."""

from __future__ import annotations

import queue
import threading
import time

import pytest

from mesh.codec import (
    ClaimRequest,
    Frame,
    FrameResult,
    PrepareRequest,
    Segment,
    SegmentKind,
    StageLoadRequest,
    WireDType,
)
from mesh.errors import StaleTerm
from mesh.types import LayerRange, SamplingParams
from stage.node import NodeSettings, StageNode


@pytest.fixture
def node(tmp_path, tiny_package_factory, request):
    package = tiny_package_factory("llama", layers=2)
    gc_freeze = getattr(request, "param", False)
    settings = NodeSettings(node_id="n", cache_dir=tmp_path / "cache", gc_freeze=gc_freeze)
    node = StageNode(settings, "127.0.0.1:1")
    results: queue.SimpleQueue[FrameResult] = queue.SimpleQueue()
    node.set_result_sink(results.put)
    node.claim(ClaimRequest(3, "coord", "tiny-llama"))
    node.prepare(PrepareRequest(3, str(package), LayerRange(0, 2)))
    deadline = time.monotonic() + 60
    while node.inventory(3).state != "ready":
        assert time.monotonic() < deadline, node.inventory(3)
        time.sleep(0.05)
    node.load(load_request(3, package))
    node.results = results
    yield node
    node.stop()


def load_request(term: int, package, downstream=None) -> StageLoadRequest:
    """Load both layers of the tiny package as stage 0, alone or before ``downstream``."""
    return StageLoadRequest(
        term=term,
        stage_index=0,
        stage_count=1 if downstream is None else 2,
        layer_range=LayerRange(0, 2),
        package_ref=str(package),
        manifest_sha256="",
        downstream=downstream,
        return_endpoint="",
        wire_dtype=WireDType.F32,
    )


def prefill(term: int, session: str = "s") -> Frame:
    segment = Segment(
        session, session, SegmentKind.PREFILL, 0, token_ids=(1, 5, 9), sampling=SamplingParams()
    )
    return Frame(term, 1, (segment,))


def test_results_and_errors_carry_the_term_of_their_frame(node) -> None:
    node.submit(prefill(3))
    done = node.results.get(timeout=30)
    (answer,) = done.results
    assert answer.error is None and done.term == 3 and answer.pos_start == 3
    node.submit(prefill(2, "old"))
    refused = node.results.get(timeout=30)
    # The refusal answers a frame of term 2: it says term 2, not the node's 3.
    (answer,) = refused.results
    assert answer.error is not None and answer.error.code == "FAILED_PRECONDITION"
    assert refused.term == 2


@pytest.mark.parametrize("node", [True], indirect=True)
def test_a_load_freezes_what_it_leaves_alive_and_a_release_gives_it_back(node) -> None:
    """With gc_freeze (the processes' default), the objects alive after a load are out
    of the garbage collector's way (mesh/gcpause.py); a release returns them to it so
    that the dropped runtime's cycles can be freed. The stage serves as before."""
    import gc

    try:
        assert gc.get_freeze_count() > 0
        node.submit(prefill(3))
        (answer,) = node.results.get(timeout=30).results
        assert answer.error is None and answer.pos_start == 3
        node.release(3, "a test")
        assert gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()


def test_a_newer_term_frame_asks_the_coordinator(node) -> None:
    asked: list[bool] = []
    node.on_newer_term(lambda: asked.append(True))
    node.submit(prefill(4))
    refused = node.results.get(timeout=30)
    assert refused.term == 4 and refused.results[0].error is not None
    assert asked == [True]
    assert node.loaded is not None  # a frame alone never releases the stage


def test_a_stage_whose_term_is_over_releases_its_layers_and_sessions(node) -> None:
    node.submit(prefill(3))
    node.results.get(timeout=30)
    assert node.active_sessions() == 1
    node.observe_coordinator_term(3)  # the same term: nothing happens
    assert node.loaded is not None
    node.observe_coordinator_term(5)
    assert node.loaded is None and node.active_sessions() == 0 and node.state == "idle"


def test_a_stale_claim_reports_the_term_the_node_holds(node) -> None:
    with pytest.raises(StaleTerm) as refused:
        node.claim(ClaimRequest(2, "old-coordinator", "tiny-llama"))
    assert refused.value.held_term == 3


def test_a_refused_claim_names_the_held_term_over_grpc(node) -> None:
    import grpc

    from mesh.grpc_util import bind, channel, error_from_rpc, new_server
    from mesh.proto.v1 import stage_pb2_grpc
    from stage.servicers import ControlServicer

    server = new_server(2)
    stage_pb2_grpc.add_StageControlServicer_to_server(ControlServicer(node), server)
    port = bind(server, "127.0.0.1:0")
    server.start()
    ch = channel(f"127.0.0.1:{port}")
    try:
        stub = stage_pb2_grpc.StageControlStub(ch)
        with pytest.raises(grpc.RpcError) as refused:
            stub.Claim(ClaimRequest(1, "old", "tiny-llama").to_proto(), timeout=10)
        error = error_from_rpc(refused.value, "Claim")
        assert isinstance(error, StaleTerm) and error.held_term == 3
    finally:
        ch.close()
        server.stop(0)


def test_the_heartbeat_reports_sessions_and_the_kv_they_hold(node) -> None:
    idle = node.heartbeat()
    assert (idle.node_id, idle.term, idle.state) == ("n", 3, "serving")
    assert (idle.active_sessions, idle.kv_bytes, idle.prefix_bytes) == (0, 0, 0)
    node.submit(prefill(3))
    node.results.get(timeout=30)
    busy = node.heartbeat()
    assert busy.active_sessions == 1
    assert busy.kv_bytes >= 3 * node.loaded.engine.runtime.kv_bytes_per_token
    assert busy.prefix_bytes == 0
    # The session ends keeping its positions for later prompts: its KV moves over.
    end = Segment("s", "s", SegmentKind.END, 2, keep_prefix=True)
    node.submit(Frame(3, 2, (end,)))
    deadline = time.monotonic() + 30
    while node.heartbeat().active_sessions:
        assert time.monotonic() < deadline, node.heartbeat()
        time.sleep(0.05)
    kept = node.heartbeat()
    assert kept.kv_bytes == 0 and kept.prefix_bytes > 0


def test_a_queued_frame_of_stage_0_takes_more_segments_until_the_worker_starts_it(
    node,
) -> None:
    """``amend`` adds segments to a frame of stage 0's engine core while it waits in
    the queue; once the worker has taken it, the frame is as it was and the callback is
    not called."""
    release = threading.Event()
    answered: queue.SimpleQueue[FrameResult] = queue.SimpleQueue()

    def slow_sink(result: FrameResult) -> None:
        answered.put(result)
        release.wait(timeout=30)  # the worker stays on the first frame until released

    node.set_result_sink(slow_sink)
    node.submit(prefill(3, "first"))
    first = answered.get(timeout=30)  # the worker is inside the first frame now
    assert first.results[0].error is None
    node.submit(Frame(3, 2, prefill(3, "second").segments))
    extra = prefill(3, "third").segments
    assert node.amend(2, lambda: extra)
    release.set()
    second = answered.get(timeout=30)
    assert second.frame_id == 2
    assert [r.session_id for r in second.results] == ["second", "third"]
    assert all(r.error is None and len(r.token_ids) == 1 for r in second.results)
    # The same prompt in the same frame gives the same token.
    assert second.results[0].token_ids == second.results[1].token_ids
    called: list[bool] = []
    assert not node.amend(2, lambda: called.append(True) or extra)
    assert called == []


@pytest.mark.parametrize(
    ("change", "message"),
    [({"torch_dtype": "int3"}, "dtype 'int3'"), ({"device": "cuda:99"}, "cuda:99")],
)
def test_a_load_it_would_refuse_leaves_the_served_layers_alone(
    node, tiny_package_factory, change: dict, message: str
) -> None:
    """A Load whose dtype or device cannot be used is refused before the layers being
    served are released: the stage serves on."""
    from dataclasses import replace

    from mesh.errors import InvalidRequest

    served = node.loaded
    bad = replace(served.request, **change)
    with pytest.raises(InvalidRequest, match=message):
        node.load(bad)
    assert node.loaded is served and node.state == "serving"
    node.submit(prefill(3))
    (answer,) = node.results.get(timeout=30).results
    assert answer.error is None


def test_a_claim_only_if_idle_is_refused_while_the_frontend_serves(node) -> None:
    """A reload that only pays while stage 0 is idle (a rebalance) asks stage 0 at the
    Claim itself: refused over gRPC (nothing fenced, the term and layers stay) while
    it serves requests, taken once it serves none. A plain Claim fences as before."""
    from coordinator.driver import LoadDriver, LoadError, LoadSettings
    from coordinator.planner import StageAssignment
    from mesh.grpc_util import bind, new_server
    from mesh.proto.v1 import stage_pb2_grpc
    from stage.servicers import ControlServicer

    server = new_server(2)
    stage_pb2_grpc.add_StageControlServicer_to_server(ControlServicer(node), server)
    port = bind(server, "127.0.0.1:0")
    server.start()
    stage0 = StageAssignment("n", f"127.0.0.1:{port}", 0, LayerRange(0, 2), 0)
    driver = LoadDriver("coord", lambda node_id: "cpu")
    settings = LoadSettings("pkg", "", "tiny-llama")
    running = {"n": 2}
    node.busy = lambda: running["n"]
    try:
        with pytest.raises(LoadError) as refused:
            driver.claim_if_idle(stage0, 4, settings)
        assert refused.value.busy and "serves 2 request(s)" in refused.value.message
        assert node.term == 3 and node.loaded is not None
        running["n"] = 0
        driver.claim_if_idle(stage0, 4, settings)
        assert node.term == 4 and node.loaded is None
    finally:
        server.stop(0)


def test_a_plain_claim_fences_a_busy_stage(node) -> None:
    node.busy = lambda: 5
    node.claim(ClaimRequest(4, "coord", "tiny-llama"))
    assert node.term == 4 and node.loaded is None


def test_a_release_with_a_term_no_coordinator_sends_is_refused(node) -> None:
    """Terms count loads (at most 2^52): a Release beyond that is INVALID_ARGUMENT and
    the stage keeps its layers (it dropped them before)."""
    from mesh.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match="beyond"):
        node.release(2**64 - 1, "hostile")
    assert node.loaded is not None


@pytest.mark.parametrize("ends_it", ["release", "newer claim"])
def test_a_load_waiting_for_a_neighbour_that_died_is_given_up_by_a_release(
    node, tiny_package_factory, ends_it: str
) -> None:
    """A stage killed just after its Load answered ready: the stage above it waits
    for it to answer (up to 10 s) while holding the node's lock. The coordinator's
    Release (or its next attempt's Claim) ends that wait at once: the Load fails as
    given up, not as a link that could not be opened (which would blame the node it
    goes to), and the Release is not held for the link's 10 s."""
    import socket

    from mesh.codec import PeerRef
    from mesh.errors import LoadCancelled

    free = socket.create_server(("127.0.0.1", 0))
    dead = f"127.0.0.1:{free.getsockname()[1]}"
    free.close()  # nothing answers there: a stage that was killed
    package = tiny_package_factory("llama", layers=2)
    node.claim(ClaimRequest(4, "coord", "tiny-llama"))
    node.prepare(PrepareRequest(4, str(package), LayerRange(0, 2)))
    request = load_request(4, package, PeerRef("dead", dead))
    failed: list[BaseException] = []

    def load() -> None:
        try:
            node.load(request)
        except BaseException as error:  # noqa: BLE001 - the test reads it
            failed.append(error)

    loading = threading.Thread(target=load)
    loading.start()
    deadline = time.monotonic() + 60
    while node._loading_term != 4:  # the Load holds the lock, waiting for the dead peer
        assert time.monotonic() < deadline and loading.is_alive(), failed
        time.sleep(0.01)
    if ends_it == "release":
        node.release(4, "the attempt was given up")
    else:
        node.claim(ClaimRequest(5, "coord", "tiny-llama"))
    loading.join(30)
    assert not loading.is_alive()
    assert len(failed) == 1 and isinstance(failed[0], LoadCancelled), failed
    assert node.loaded is None and node.state != "serving"
