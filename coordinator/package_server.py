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
QUEUE_WAIT_S = 60.0


class PackageFilesServicer(coordinator_pb2_grpc.PackageFilesServicer):
    def __init__(self, service, max_concurrent: int = MAX_CONCURRENT) -> None:
        """``service`` is the CoordinatorService: its model and current plan decide
        what a node may read."""
        self.service = service
        self._slots = threading.BoundedSemaphore(max_concurrent)

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
            if not self._slots.acquire(timeout=QUEUE_WAIT_S):
                raise CapacityExceeded("too many package transfers at once; retry shortly")
        except MeshError as error:
            abort_with(context, error)
            return
        try:
            yield from _chunks(directory / entry.path, decoded.offset, context)
        finally:
            self._slots.release()
        logger.info("sent %s to %s from offset %s", entry.path, decoded.node_id, decoded.offset)


def _chunks(path: Path, offset: int, context: grpc.ServicerContext) -> Iterator:
    with open(path, "rb") as source:
        source.seek(offset)
        while context.is_active():
            data = source.read(CHUNK_BYTES)
            if not data:
                return
            yield FileChunk(offset, data).to_proto()
            offset += len(data)
