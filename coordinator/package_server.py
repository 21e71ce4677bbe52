"""The coordinator serves its package's files (``PackageFiles``) to workers that
cannot read the package directory: a worker may read the manifest, and the files
of the layer range it is assigned in the current plan (or in the plan whose
slices are being prepared while the current one serves), nothing else. Transfers are
streamed in chunks from any offset (a broken transfer resumes) and at most
``max_concurrent`` run at once. The join token and TLS of the coordinator's server
apply as to every other call."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc

from mesh.codec import FileChunk, PackageManifestReply, PackageManifestRequest, ReadFileRequest
from mesh.errors import CapacityExceeded, InvalidRequest, MeshError, NotFound, StaleTerm
from mesh.grpc_util import abort_with
from mesh.package.manifest import MANIFEST_NAME, PackageManifest
from mesh.proto.v1 import coordinator_pb2, coordinator_pb2_grpc

logger = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20
MAX_CONCURRENT = 4
# A transfer whose client takes no chunk for this long is cancelled: a stalled reader
# blocks the worker thread that sends it, and the coordinator's workers also answer
# the heartbeats.
TRANSFER_IDLE_S = 60.0
WATCH_EVERY_S = 1.0


class PackageFilesServicer(coordinator_pb2_grpc.PackageFilesServicer):
    def __init__(self, service, max_concurrent: int = MAX_CONCURRENT) -> None:
        """``service`` is the CoordinatorService: its model and current plan decide
        what a node may read."""
        self.service = service
        self.max_concurrent = max_concurrent
        self._slots = threading.BoundedSemaphore(max_concurrent)
        self._watch = _IdleTransfers(TRANSFER_IDLE_S)

    def _package_dir(self, ref: str) -> Path:
        model = self.service.model
        if ref != model.ref:
            raise NotFound(
                f"this coordinator serves package {model.ref!r}, not {ref!r}; prepare the "
                "package the coordinator names"
            )
        directory = Path(model.ref)
        if not (directory / MANIFEST_NAME).is_file():
            raise NotFound(f"package {ref!r} is not a directory on the coordinator's host")
        return directory

    def _allowed(self, node_id: str, path: str) -> bool:
        ranges = self.service.assigned_ranges(node_id)
        if not ranges:
            raise StaleTerm(
                f"node {node_id or '(unnamed)'} is not assigned a layer range in the current "
                "plan; it may read package files only while it is"
            )
        manifest = self.service.model.manifest
        return any(entry.path == path for r in ranges for entry in manifest.files_for(r))

    def Manifest(self, request: coordinator_pb2.PackageManifestRequest, context):
        try:
            decoded = PackageManifestRequest.from_proto(request)
            directory = self._package_dir(decoded.package_ref)
            body = PackageManifest.load(directory).to_json()
            return PackageManifestReply(json.dumps(body)).to_proto()
        except MeshError as error:
            abort_with(context, error)

    def Read(self, request: coordinator_pb2.ReadFileRequest, context) -> Iterator:
        try:
            decoded = ReadFileRequest.from_proto(request)
            directory = self._package_dir(decoded.package_ref)
            if not self._allowed(decoded.node_id, decoded.path):
                raise InvalidRequest(
                    f"{decoded.path} is not a file of the layers node {decoded.node_id} is "
                    "assigned; it may read only those"
                )
            entry = self.service.model.manifest.file(decoded.path)
            if decoded.offset > entry.bytes:
                raise InvalidRequest(f"offset {decoded.offset} is past the end of {entry.path}")
            # Refused at once rather than queued here: a call waiting for a slot would
            # hold one of the worker threads that answer the heartbeats.
            if not self._slots.acquire(blocking=False):
                raise CapacityExceeded(
                    f"all {self.max_concurrent} package transfers of the coordinator are "
                    "busy; retry in a few seconds"
                )
        except MeshError as error:
            abort_with(context, error)
            return
        key = self._watch.add(context)
        sent = False
        try:
            for chunk in _chunks(directory / entry.path, decoded.offset, context):
                yield chunk
                self._watch.touch(key)
            sent = context.is_active()
        finally:
            self._watch.remove(key)
            self._slots.release()
        if sent:
            logger.info("sent %s to %s from offset %s", entry.path, decoded.node_id, decoded.offset)
        else:
            logger.info(
                "transfer of %s to %s ended early (cancelled, or idle for %.0fs)",
                entry.path,
                decoded.node_id,
                TRANSFER_IDLE_S,
            )


class _IdleTransfers:
    """Cancels the transfers whose client has taken no chunk for ``idle_s``: the
    send of a chunk blocks while the client reads nothing, and only a cancel from
    another thread ends it."""

    def __init__(self, idle_s: float) -> None:
        self.idle_s = idle_s
        self._lock = threading.Lock()
        self._active: dict[int, tuple[grpc.ServicerContext, float]] = {}
        self._next = 0
        self._thread: threading.Thread | None = None

    def add(self, context: grpc.ServicerContext) -> int:
        with self._lock:
            self._next += 1
            self._active[self._next] = (context, time.monotonic())
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="transfer-watch", daemon=True
                )
                self._thread.start()
            return self._next

    def touch(self, key: int) -> None:
        with self._lock:
            if key in self._active:
                self._active[key] = (self._active[key][0], time.monotonic())

    def remove(self, key: int) -> None:
        with self._lock:
            self._active.pop(key, None)

    def _run(self) -> None:
        while True:
            time.sleep(WATCH_EVERY_S)
            now = time.monotonic()
            with self._lock:
                idle = [c for c, last in self._active.values() if now - last > self.idle_s]
            for context in idle:
                try:
                    context.cancel()
                except Exception:  # noqa: BLE001 - the watch must outlive one bad cancel
                    logger.exception("cannot cancel an idle package transfer")


def _chunks(path: Path, offset: int, context: grpc.ServicerContext) -> Iterator:
    with open(path, "rb") as source:
        source.seek(offset)
        while context.is_active():
            data = source.read(CHUNK_BYTES)
            if not data:
                return
            yield FileChunk(offset, data).to_proto()
            offset += len(data)
