"""Reading a package from the coordinator (``PackageFiles``), for a worker that cannot
read the package directory itself: no shared file system with the head.

Each file streams in chunks into a local partial file; a broken transfer is retried
from the bytes already there (up to ``ATTEMPTS`` times, with a growing wait). The
resolver verifies the sha256 of the whole file afterwards, as for any source.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

import grpc

from mesh.codec import FileChunk, PackageManifestReply, PackageManifestRequest, ReadFileRequest
from mesh.errors import CapacityExceeded, MeshError, PackageError, Unavailable
from mesh.grpc_util import CONTROL_DEADLINE_S, channel, error_from_rpc
from mesh.package.manifest import PackageFile, PackageManifest
from mesh.proto.v1 import coordinator_pb2_grpc

logger = logging.getLogger(__name__)

ATTEMPTS = 5
RETRY_FIRST_S = 1.0
# While every transfer slot of the coordinator is busy (other stages fetching), a
# stage waits its turn this long at most, asking again every few seconds.
BUSY_WAIT_S = 900.0
BUSY_RETRY_MAX_S = 10.0
# A transfer that makes no progress for this long is broken.
READ_IDLE_TIMEOUT_S = 60.0


class CoordinatorPackageSource:
    """A ``RemotePackageSource`` backed by the coordinator's PackageFiles service."""

    def __init__(self, coordinator: str, node_id: str) -> None:
        self.coordinator = coordinator
        self.node_id = node_id

    def describe(self) -> str:
        return f"the coordinator at {self.coordinator}"

    def manifest(self, ref: str) -> PackageManifest:
        ch = channel(self.coordinator, bulk=True)
        try:
            reply = coordinator_pb2_grpc.PackageFilesStub(ch).Manifest(
                PackageManifestRequest(ref, self.node_id).to_proto(), timeout=CONTROL_DEADLINE_S
            )
        except grpc.RpcError as error:
            raise error_from_rpc(error, f"package manifest from {self.describe()}") from None
        finally:
            ch.close()
        try:
            body = json.loads(PackageManifestReply.from_proto(reply).manifest_json)
        except ValueError as error:
            where = self.describe()
            raise PackageError(f"the manifest from {where} is not JSON: {error}") from None
        return PackageManifest.from_json(body, origin=f"{ref} on {self.describe()}")

    def download(
        self,
        ref: str,
        entry: PackageFile,
        dest: Path,
        progress: Callable[[int], None],
        cancelled: Callable[[], bool],
    ) -> None:
        wait_s = RETRY_FIRST_S
        busy_until = time.monotonic() + BUSY_WAIT_S
        busy_wait_s = RETRY_FIRST_S
        attempt = 0
        while attempt < ATTEMPTS:
            attempt += 1
            have = dest.stat().st_size if dest.exists() else 0
            if have > entry.bytes:  # not this file: start over
                dest.unlink()
                have = 0
            if have == entry.bytes:
                progress(have)
                return
            try:
                self._read(ref, entry, dest, have, progress)
                return
            except CapacityExceeded as error:
                # The coordinator's transfer slots are taken: a turn to wait for, not
                # a broken transfer.
                if cancelled() or time.monotonic() + busy_wait_s > busy_until:
                    raise CapacityExceeded(
                        f"cannot fetch {entry.path} from {self.describe()}: its transfers "
                        f"stayed busy for {BUSY_WAIT_S:.0f}s ({error.message})"
                    ) from None
                attempt -= 1
                time.sleep(busy_wait_s)
                busy_wait_s = min(BUSY_RETRY_MAX_S, busy_wait_s * 2)
            except Unavailable as error:
                if attempt == ATTEMPTS or cancelled():
                    raise Unavailable(
                        f"cannot fetch {entry.path} from {self.describe()} after {attempt} "
                        f"attempts: {error.message}"
                    ) from None
                logger.warning(
                    "fetching %s broke at %s of %s bytes (%s); resuming in %.0fs",
                    entry.path,
                    dest.stat().st_size if dest.exists() else 0,
                    entry.bytes,
                    error.message,
                    wait_s,
                )
                time.sleep(wait_s)
                wait_s *= 2

    def _read(
        self,
        ref: str,
        entry: PackageFile,
        dest: Path,
        offset: int,
        progress: Callable[[int], None],
    ) -> None:
        ch = channel(self.coordinator, bulk=True)
        request = ReadFileRequest(ref, entry.path, offset, self.node_id).to_proto()
        # The deadline scales with the size: a slow link is not a broken one.
        deadline_s = READ_IDLE_TIMEOUT_S + (entry.bytes - offset) / (1 << 20)
        try:
            with open(dest, "ab") as out:
                for pb in coordinator_pb2_grpc.PackageFilesStub(ch).Read(
                    request, timeout=deadline_s
                ):
                    chunk = FileChunk.from_proto(pb)
                    if chunk.offset != offset:
                        raise Unavailable(f"chunk at {chunk.offset}, expected {offset}")
                    out.write(chunk.data)
                    offset += len(chunk.data)
                    progress(offset)
            if offset != entry.bytes:
                raise Unavailable(f"the stream ended at {offset} of {entry.bytes} bytes")
        except grpc.RpcError as error:
            # Unavailable (and deadlines) are retried by download(); a refusal (not
            # assigned, unknown file) is final.
            raise error_from_rpc(error, f"{entry.path} from {self.describe()}") from None
        except OSError as error:
            raise MeshError(f"cannot write {dest}: {error}") from error
        finally:
            ch.close()
