"""The coordinator's PackageFiles service and the worker's client, over real gRPC on
loopback: the manifest, only the files of the node's assigned range, resuming a
broken transfer from the bytes already on disk."""

from __future__ import annotations

import pytest

from coordinator import registry
from coordinator.driver import LoadSettings
from coordinator.model import read_model
from coordinator.planner import plan_layers
from coordinator.server import CoordinatorService, CoordinatorSettings, serve
from mesh.errors import InvalidRequest, NotFound, StaleTerm
from mesh.package.manifest import sha256_file
from stage.package_client import CoordinatorPackageSource


@pytest.fixture
def coordinator(tiny_package_factory):
    package = tiny_package_factory("llama", layers=4)
    model = read_model(str(package))
    settings = CoordinatorSettings(
        load=LoadSettings(str(package), model.manifest.sha256(), model.manifest.model_id)
    )
    service = CoordinatorService(model, settings)
    for index, node_id in enumerate(("head", "worker")):
        service.apply(
            registry.NodeJoined(
                node_id=node_id, address=f"127.0.0.1:{7100 + index}", now=0.0, frontend=index == 0
            )
        )
    server, port = serve(service, "127.0.0.1:0")
    yield service, package, f"127.0.0.1:{port}"
    server.stop(0)


def assign(service: CoordinatorService) -> None:
    from coordinator.planner import footprint_from_manifest

    footprint = footprint_from_manifest(
        service.model.manifest, dtype="float32", max_sessions=1, max_tokens_per_session=16,
        num_kv_heads=2, head_dim=16,
    )  # fmt: skip
    plan = plan_layers(registry.planner_nodes(service.state), footprint)
    service.apply(registry.LoadStarted(term=1, plan=plan))


def test_a_worker_reads_the_manifest_and_its_own_files(coordinator, tmp_path) -> None:
    service, package, address = coordinator
    source = CoordinatorPackageSource(address, "worker")
    manifest = source.manifest(str(package))
    assert manifest.sha256() == service.model.manifest.sha256()
    assign(service)
    stage = service.state.topology.stage_of("worker")
    wanted = manifest.files_for(stage.layer_range)
    seen: list[int] = []
    for entry in wanted:
        dest = tmp_path / entry.path.replace("/", "_")
        source.download(str(package), entry, dest, seen.append, lambda: False)
        assert sha256_file(dest) == entry.sha256
    assert seen and seen[-1] == wanted[-1].bytes
    # A file of the head's range is not the worker's to read.
    other = next(e for e in manifest.files if e.kind == "embed")
    assert other not in wanted
    with pytest.raises(InvalidRequest, match="assigned"):
        source.download(str(package), other, tmp_path / "embed", seen.append, lambda: False)


def test_a_broken_transfer_resumes_from_the_bytes_on_disk(coordinator, tmp_path) -> None:
    service, package, address = coordinator
    assign(service)
    source = CoordinatorPackageSource(address, "worker")
    stage = service.state.topology.stage_of("worker")
    entry = max(service.model.manifest.files_for(stage.layer_range), key=lambda e: e.bytes)
    original = (package / entry.path).read_bytes()
    dest = tmp_path / "partial"
    dest.write_bytes(original[: entry.bytes // 3])  # what a broken transfer left
    offsets: list[int] = []
    source.download(str(package), entry, dest, offsets.append, lambda: False)
    assert dest.read_bytes() == original
    assert offsets[0] > entry.bytes // 3  # the first chunk continued, not restarted


def test_unassigned_nodes_and_other_packages_are_refused(coordinator, tmp_path) -> None:
    service, package, address = coordinator
    entry = service.model.manifest.files[0]
    with pytest.raises(StaleTerm, match="not assigned"):
        CoordinatorPackageSource(address, "worker").download(
            str(package), entry, tmp_path / "x", lambda _: None, lambda: False
        )
    with pytest.raises(NotFound, match="serves package"):
        CoordinatorPackageSource(address, "worker").manifest("/some/other/package")


def test_a_node_prepared_ahead_of_a_load_reads_its_next_range(coordinator, tmp_path) -> None:
    """While the coordinator prepares a new plan's slices with the current pipeline
    still serving, a node may read the files of its range in that plan too (a
    newcomer is in no current plan yet); nothing else."""
    service, package, address = coordinator
    source = CoordinatorPackageSource(address, "newcomer")
    manifest = service.model.manifest
    embed = next(e for e in manifest.files if e.kind == "embed")
    with pytest.raises(StaleTerm, match="not assigned"):
        source.download(str(package), embed, tmp_path / "embed", lambda n: None, lambda: False)
    first_layer = next(e for e in manifest.files if e.kind == "layer" and e.layer_index == 0)
    head = service.state.node("head")
    assert head is not None
    from coordinator.planner import Plan, StageAssignment
    from mesh.types import LayerRange

    service._preparing = Plan(
        stages=(
            StageAssignment("head", head.address, 0, LayerRange(0, 2), 0),
            StageAssignment("newcomer", "127.0.0.1:9", 1, LayerRange(2, 4), 0),
        )
    )
    wanted = manifest.files_for(LayerRange(2, 4))
    entry = next(e for e in wanted if e.kind == "layer")
    source.download(str(package), entry, tmp_path / "layer", lambda n: None, lambda: False)
    assert sha256_file(tmp_path / "layer") == entry.sha256
    assert first_layer not in wanted
    with pytest.raises(InvalidRequest, match="assigned"):
        source.download(str(package), first_layer, tmp_path / "l0", lambda n: None, lambda: False)


def head_only(tiny_package_factory) -> tuple[CoordinatorService, object]:
    """A coordinator of a tiny package with one node, "head", joined (not served)."""
    package = tiny_package_factory("llama", layers=4)
    model = read_model(str(package))
    settings = CoordinatorSettings(
        load=LoadSettings(str(package), model.manifest.sha256(), model.manifest.model_id)
    )
    service = CoordinatorService(model, settings)
    service.apply(
        registry.NodeJoined(node_id="head", address="127.0.0.1:7100", now=0.0, frontend=True)
    )
    return service, package


def test_stalled_readers_neither_starve_the_coordinator_nor_hold_a_slot(
    tiny_package_factory, monkeypatch
) -> None:
    """Clients that open transfers and read nothing: a fifth transfer is refused at
    once (none waits for a slot inside one of the worker threads that answer the
    heartbeats), Status keeps answering, and the stalled transfers are cancelled
    after the idle limit, freeing their slots."""
    import time

    import grpc

    from coordinator import package_server
    from mesh.codec import ReadFileRequest
    from mesh.grpc_util import BULK_CHANNEL_OPTIONS
    from mesh.proto.v1 import coordinator_pb2, coordinator_pb2_grpc

    monkeypatch.setattr(package_server, "TRANSFER_IDLE_S", 2.0)
    monkeypatch.setattr(package_server, "WATCH_EVERY_S", 0.2)
    service, package = head_only(tiny_package_factory)
    model = service.model
    server, port = serve(service, "127.0.0.1:0", workers=6)
    # A reader that takes nothing: without BDP probing the receive window stays at
    # gRPC's initial 64 KiB per stream, so the stalled streams cannot take the whole
    # file whatever the machine's speed (with probing the window can grow past it).
    ch = grpc.insecure_channel(
        f"127.0.0.1:{port}",
        options=[
            *BULK_CHANNEL_OPTIONS,
            ("grpc.http2.bdp_probe", 0),
            ("grpc.http2.lookahead_bytes", 64 * 1024),
        ],
    )
    try:
        assign(service)
        embed = next(e for e in model.manifest.files if e.kind == "embed")
        assert embed.bytes > 4 * package_server.CHUNK_BYTES  # more than flow control holds
        files = coordinator_pb2_grpc.PackageFilesStub(ch)
        request = ReadFileRequest(str(package), embed.path, 0, "head").to_proto()
        stalled = [files.Read(request, timeout=60) for _ in range(package_server.MAX_CONCURRENT)]
        for stream in stalled:
            next(stream)  # one chunk, then nothing
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as refused:
            next(files.Read(request, timeout=60))
        assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "busy; retry" in refused.value.details()
        assert time.monotonic() - started < 10  # refused, not queued
        status = coordinator_pb2_grpc.CoordinatorStub(ch).Status(
            coordinator_pb2.StatusRequest(), timeout=5
        )
        assert status.model_id == model.manifest.model_id
        time.sleep(package_server.TRANSFER_IDLE_S + 2.0)
        cancelled = 0
        for stream in stalled:
            try:
                for _ in stream:  # what had reached this end before the cancel
                    pass
            except grpc.RpcError as error:
                assert error.code() is grpc.StatusCode.CANCELLED
                cancelled += 1
        # The streams share one connection's flow-control window: the whole file
        # cannot have fit in it for all of them, so some sends blocked until cancelled.
        assert cancelled >= 1
        whole = b"".join(c.data for c in files.Read(request, timeout=60))
        assert len(whole) == embed.bytes
    finally:
        ch.close()
        server.stop(0)


def test_a_worker_waits_its_turn_while_every_transfer_is_busy(
    tiny_package_factory, tmp_path, monkeypatch
) -> None:
    """RESOURCE_EXHAUSTED (every transfer slot taken, here by stalled readers) is a
    turn to wait for: the worker asks again and fetches the file once a slot frees."""
    import threading

    from coordinator import package_server
    from mesh.codec import ReadFileRequest
    from mesh.grpc_util import channel
    from mesh.proto.v1 import coordinator_pb2_grpc
    from stage import package_client

    monkeypatch.setattr(package_server, "TRANSFER_IDLE_S", 2.0)
    monkeypatch.setattr(package_server, "WATCH_EVERY_S", 0.2)
    monkeypatch.setattr(package_client, "RETRY_FIRST_S", 0.2)
    service, package = head_only(tiny_package_factory)
    model = service.model
    server, port = serve(service, "127.0.0.1:0")
    ch = channel(f"127.0.0.1:{port}", bulk=True)
    try:
        assign(service)
        embed = next(e for e in model.manifest.files if e.kind == "embed")
        files = coordinator_pb2_grpc.PackageFilesStub(ch)
        request = ReadFileRequest(str(package), embed.path, 0, "head").to_proto()
        stalled = [files.Read(request, timeout=60) for _ in range(package_server.MAX_CONCURRENT)]
        for stream in stalled:
            next(stream)
        dest = tmp_path / "embed"
        errors: list[BaseException] = []

        def fetch() -> None:
            try:
                CoordinatorPackageSource(f"127.0.0.1:{port}", "head").download(
                    str(package), embed, dest, lambda n: None, lambda: False
                )
            except BaseException as error:  # noqa: BLE001 - reported below
                errors.append(error)

        worker = threading.Thread(target=fetch)
        worker.start()
        worker.join(timeout=60)
        assert not worker.is_alive() and not errors, errors
        assert sha256_file(dest) == embed.sha256
    finally:
        ch.close()
        server.stop(0)
