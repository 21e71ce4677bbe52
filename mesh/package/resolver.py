"""Materialise the slice of a package that one layer range needs.

A stage owning ``[start, end)`` needs the meta files, the embed file when
``start == 0``, the head file when ``end == layer_count`` and its own layer files
(``PackageManifest.files_for``). The resolver fetches only those, from a local
package directory (plain reads), an HF repo (``hf_hub_download`` per file into
the hub cache) or, for a path this host does not have, a ``RemotePackageSource``
(the coordinator, streamed and resumable), verifies each file's sha256 and installs
it atomically under::

    <cache_dir>/<model_id>-<manifest sha256[:12]>/model-package.json
                                                 /<same relative paths as the package>

Files already there with the right digest are reused. ``start`` runs the work in a
background thread and ``inventory`` reports progress; ``materialise`` blocks.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mesh.errors import Fatal, MeshError, PackageError, Unavailable, grpc_code_name
from mesh.package import hub
from mesh.package.copying import cleanup_stale_parts, install_verified
from mesh.package.manifest import MANIFEST_NAME, PackageFile, PackageManifest, atomic_write_text
from mesh.package.remote import RemotePackageSource, looks_like_path
from mesh.package.verify import file_problem
from mesh.types import LayerRange

logger = logging.getLogger(__name__)

SLICE_STATES = ("empty", "preparing", "ready", "failed")
DOWNLOAD_SUFFIX = ".download"
FILE_STATES = ("missing", "preparing", "ready", "failed")


@dataclass(frozen=True)
class FileInventory:
    """One file a slice needs. ``state`` is one of FILE_STATES."""

    path: str
    state: str
    bytes_done: int
    bytes_total: int
    error: str | None = None


@dataclass(frozen=True)
class SliceInventory:
    """Where the current slice stands. ``state`` is one of SLICE_STATES; ``local_dir``
    is set once the slice is ready; ``error_code`` is the gRPC code name of a failure."""

    state: str
    package_ref: str | None = None
    layer_range: LayerRange | None = None
    model_id: str | None = None
    manifest_sha256: str | None = None
    bytes_done: int = 0
    bytes_total: int = 0
    files: tuple[FileInventory, ...] = ()
    error: str | None = None
    error_code: str | None = None
    local_dir: Path | None = None

    @property
    def ready(self) -> bool:
        return self.state == "ready"


@dataclass(frozen=True)
class PackageOrigin:
    """Where a package reference points: a local directory, an HF repo, or a path on
    another host that ``remote`` serves."""

    ref: str
    local_dir: Path | None = None
    repo: hub.RepoRef | None = None
    remote: RemotePackageSource | None = None

    def __str__(self) -> str:
        if self.local_dir is not None:
            return str(self.local_dir)
        if self.remote is not None:
            return f"{self.ref} from {self.remote.describe()}"
        return str(self.repo)


def resolve_ref(
    ref: str, revision: str | None = None, remote: RemotePackageSource | None = None
) -> PackageOrigin:
    """A local package directory if ``ref`` names one; a path this host lacks comes
    from ``remote`` when given; else an HF repo id (``org/name`` or
    ``org/name@revision``)."""
    path = Path(ref).expanduser()
    if path.is_dir():
        return PackageOrigin(ref=ref, local_dir=path.resolve())
    if remote is not None and looks_like_path(ref):
        return PackageOrigin(ref=ref, remote=remote)
    repo = hub.parse_repo_ref(ref, revision)
    if repo is None:
        raise PackageError(
            f"package {ref!r} is neither a local package directory nor a Hugging Face repo id "
            "(org/name[@revision])"
        )
    return PackageOrigin(ref=ref, repo=repo)


def slice_dir_name(manifest: PackageManifest) -> str:
    """``<sanitised model_id>-<manifest sha256[:12]>``."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", manifest.model_id.replace("/", "--")).strip("._")
    return f"{safe or 'package'}-{manifest.sha256()[:12]}"


class _Cancelled(Exception):
    """A newer request superseded this job."""


class _Job:
    """One materialisation; mutable, guarded by its lock, read through snapshot()."""

    def __init__(
        self,
        ref: str,
        revision: str | None,
        layer_range: LayerRange,
        cache_dir: Path,
        chunk_bytes: int,
        remote: RemotePackageSource | None = None,
        expected: str = "",
    ) -> None:
        self.key = (ref, revision, layer_range, expected)
        self.remote = remote
        self.expected = expected
        self.ref, self.revision, self.layer_range = ref, revision, layer_range
        self.cache_dir = cache_dir
        self.chunk_bytes = chunk_bytes
        self.cancelled = threading.Event()
        self.done = threading.Event()
        self.exception: MeshError | None = None
        self._lock = threading.Lock()
        self._state = "preparing"
        self._model_id: str | None = None
        self._manifest_sha: str | None = None
        self._local_dir: Path | None = None
        self._error: str | None = None
        self._files: dict[str, FileInventory] = {}

    # ---- reporting -------------------------------------------------------------

    @property
    def state(self) -> str:
        with self._lock:
            return self._state

    def snapshot(self) -> SliceInventory:
        with self._lock:
            files = tuple(self._files.values())
            return SliceInventory(
                state=self._state,
                package_ref=self.ref if self.revision is None else f"{self.ref}@{self.revision}",
                layer_range=self.layer_range,
                model_id=self._model_id,
                manifest_sha256=self._manifest_sha,
                bytes_done=sum(f.bytes_done for f in files),
                bytes_total=sum(f.bytes_total for f in files),
                files=files,
                error=self._error,
                error_code=None if self.exception is None else grpc_code_name(self.exception),
                local_dir=self._local_dir,
            )

    def _set_file(
        self, entry: PackageFile, state: str, done: int, error: str | None = None
    ) -> None:
        with self._lock:
            self._files[entry.path] = FileInventory(entry.path, state, done, entry.bytes, error)

    # ---- work --------------------------------------------------------------------

    def run(self) -> None:
        try:
            local_dir = self._materialise()
        except _Cancelled:
            logger.info(
                "materialising %s %s superseded by a newer request", self.ref, self.layer_range
            )
            self._finish("failed", error=MeshError("superseded by a newer prepare request"))
        except MeshError as error:
            logger.warning("materialising %s %s failed: %s", self.ref, self.layer_range, error)
            self._finish("failed", error=error)
        except Exception as error:  # a bug: report it rather than lose the thread silently
            logger.exception("materialising %s %s crashed", self.ref, self.layer_range)
            self._finish("failed", error=Fatal(f"{type(error).__name__}: {error}"))
        else:
            logger.info("slice %s of %s ready at %s", self.layer_range, self.ref, local_dir)
            self._finish("ready", local_dir=local_dir)

    def _finish(
        self, state: str, *, error: MeshError | None = None, local_dir: Path | None = None
    ) -> None:
        with self._lock:
            self._state = state
            self.exception = error
            self._error = None if error is None else error.message
            self._local_dir = local_dir
        self.done.set()

    def _materialise(self) -> Path:
        origin = self._passed_over(resolve_ref(self.ref, self.revision, self.remote))
        if origin.remote is not None:
            logger.info("fetching slice %s of %s", self.layer_range, origin)
        manifest, fetch = _open_package(origin)
        needed = manifest.files_for(self.layer_range)
        slice_dir = self.cache_dir / slice_dir_name(manifest)
        with self._lock:
            self._model_id = manifest.model_id
            self._manifest_sha = manifest.sha256()
            for entry in needed:
                self._files[entry.path] = FileInventory(entry.path, "missing", 0, entry.bytes)
        try:
            slice_dir.mkdir(parents=True, exist_ok=True)
            _write_manifest(slice_dir, manifest)
        except OSError as error:
            raise Unavailable(f"cannot write the slice cache at {slice_dir}: {error}") from error
        cleanup_stale_parts(slice_dir)
        for entry in needed:
            if self.cancelled.is_set():
                raise _Cancelled()
            try:
                self._materialise_file(entry, slice_dir, fetch, origin)
            except MeshError as error:
                self._set_file(entry, "failed", 0, error.message)
                raise
        return slice_dir

    def _passed_over(self, origin: PackageOrigin) -> PackageOrigin:
        """``origin``, or the coordinator's copy where ``origin`` is a local directory
        holding another package than the expected one (a stale copy on this host)."""
        if origin.local_dir is None or not self.expected or self.remote is None:
            return origin
        try:
            found = PackageManifest.load(origin.local_dir).sha256()
        except PackageError as error:
            logger.warning(
                "%s holds no package this stage can read (%s): fetching the slice from %s",
                origin.local_dir,
                error,
                self.remote.describe(),
            )
            return PackageOrigin(ref=self.ref, remote=self.remote)
        if found == self.expected:
            return origin
        logger.warning(
            "the package at %s is not the coordinator's (manifest %s, the coordinator "
            "serves %s): fetching the slice from %s instead",
            origin.local_dir,
            found[:12],
            self.expected[:12],
            self.remote.describe(),
        )
        return PackageOrigin(ref=self.ref, remote=self.remote)

    def _materialise_file(
        self,
        entry: PackageFile,
        slice_dir: Path,
        fetch: Callable[[PackageFile], Path],
        origin: PackageOrigin,
    ) -> None:
        target = slice_dir / entry.path
        self._set_file(entry, "preparing", 0)
        if target.is_file():
            problem = file_problem(target, entry)
            if problem is None:
                logger.debug("reusing %s", target)
                self._set_file(entry, "ready", entry.bytes)
                return
            logger.warning("cached %s is stale (%s); fetching it again", target, problem)
            target.unlink(missing_ok=True)
        if origin.remote is not None:
            self._install_remote(entry, target, origin)
            return
        source = fetch(entry)
        install_verified(
            source,
            target,
            entry,
            origin=str(origin),
            link=origin.repo is not None,
            chunk_bytes=self.chunk_bytes,
            progress=lambda done: self._set_file(entry, "preparing", done),
            cancelled=self.cancelled.is_set,
            cancel_error=_Cancelled,
        )
        self._set_file(entry, "ready", entry.bytes)

    def _install_remote(self, entry: PackageFile, target: Path, origin: PackageOrigin) -> None:
        """Download into a hidden file next to ``target`` (kept across failures, so
        the next attempt resumes), then verify and install it like a local file."""
        partial = target.with_name(f".{target.name}{DOWNLOAD_SUFFIX}")
        try:
            partial.parent.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise Unavailable(f"cannot write the slice cache {partial.parent}: {error}") from error

        def progress(done: int) -> None:
            if self.cancelled.is_set():
                raise _Cancelled()
            self._set_file(entry, "preparing", done)

        origin.remote.download(origin.ref, entry, partial, progress, self.cancelled.is_set)
        try:
            install_verified(
                partial, target, entry, origin=str(origin), link=True, chunk_bytes=self.chunk_bytes
            )
        except PackageError:
            partial.unlink(missing_ok=True)  # corrupt: the next attempt starts over
            raise
        partial.unlink(missing_ok=True)
        logger.info("fetched %s (%s bytes) of %s", entry.path, entry.bytes, origin)
        self._set_file(entry, "ready", entry.bytes)


def _open_package(
    origin: PackageOrigin,
) -> tuple[PackageManifest, Callable[[PackageFile], Path]]:
    """The manifest of ``origin`` and a function that gives a readable local path for a file."""
    if origin.local_dir is not None:
        directory = origin.local_dir
        return PackageManifest.load(directory), lambda entry: directory / entry.path
    if origin.remote is not None:
        return origin.remote.manifest(origin.ref), _no_local_path
    repo = origin.repo
    local_manifest = hub.download_file(repo, MANIFEST_NAME)
    commit = hub.snapshot_commit(local_manifest, MANIFEST_NAME)
    pinned = hub.RepoRef(repo.repo_id, commit or repo.revision)
    where = f"{repo}/{MANIFEST_NAME}"
    try:
        body = json.loads(local_manifest.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise PackageError(f"{where} is not valid JSON: {error}") from error
    manifest = PackageManifest.from_json(body, origin=where)
    return manifest, lambda entry: hub.download_file(pinned, entry.path)


def _no_local_path(entry: PackageFile) -> Path:
    raise Fatal(f"{entry.path} of a remote package has no local path; it is downloaded")


def _write_manifest(slice_dir: Path, manifest: PackageManifest) -> None:
    path = slice_dir / MANIFEST_NAME
    if path.is_file():
        try:
            if PackageManifest.load(slice_dir).sha256() == manifest.sha256():
                return
        except PackageError:
            pass
    atomic_write_text(path, json.dumps(manifest.to_json(), indent=2) + "\n")


class SliceResolver:
    """Fetches package slices into ``cache_dir``; one current request at a time.

    ``start`` returns at once and works in a background thread; a new ``start`` with
    a different request supersedes the old one. ``inventory`` reports progress.
    """

    def __init__(
        self,
        cache_dir: Path,
        *,
        chunk_bytes: int = 8 << 20,
        remote: RemotePackageSource | None = None,
    ) -> None:
        """``remote`` serves packages named by a path this host does not have."""
        self.cache_dir = Path(cache_dir).expanduser()
        self.chunk_bytes = chunk_bytes
        self.remote = remote
        self._lock = threading.Lock()
        self._job: _Job | None = None

    def start(
        self,
        ref: str,
        layer_range: LayerRange,
        revision: str | None = None,
        expected: str = "",
    ) -> None:
        """Begin materialising ``layer_range`` of ``ref``; a no-op if that exact request
        is already in progress or ready. ``expected``: the manifest sha256 the
        coordinator serves (a local copy with another is passed over for the
        coordinator's, where this resolver has one)."""
        self._start(ref, layer_range, revision, expected)

    def _start(
        self, ref: str, layer_range: LayerRange, revision: str | None, expected: str = ""
    ) -> _Job:
        if not isinstance(layer_range, LayerRange):
            raise TypeError(f"layer_range must be a LayerRange, got {type(layer_range).__name__}")
        key = (ref, revision, layer_range, expected)
        with self._lock:
            current = self._job
            if current is not None and current.key == key and current.state != "failed":
                return current
            if current is not None:
                current.cancelled.set()
            job = _Job(
                ref, revision, layer_range, self.cache_dir, self.chunk_bytes, self.remote, expected
            )
            self._job = job
        thread = threading.Thread(target=job.run, name=f"slice-{layer_range}", daemon=True)
        thread.start()
        return job

    def inventory(self) -> SliceInventory:
        """A snapshot of the current request (state ``empty`` before any)."""
        with self._lock:
            job = self._job
        return SliceInventory(state="empty") if job is None else job.snapshot()

    def wait(self, timeout_s: float | None = None) -> SliceInventory:
        """Block until the current request finishes (or ``timeout_s`` passes)."""
        with self._lock:
            job = self._job
        if job is not None:
            job.done.wait(timeout_s)
        return self.inventory()

    def cancel(self) -> None:
        """Stop the current request at the next chunk boundary and forget it."""
        with self._lock:
            job, self._job = self._job, None
        if job is not None:
            job.cancelled.set()

    def materialise(
        self,
        ref: str,
        layer_range: LayerRange,
        revision: str | None = None,
        timeout_s: float | None = None,
    ) -> Path:
        """Fetch and verify the slice, blocking; returns the local slice directory.

        Raises the PackageError / InvalidRequest / Unavailable that failed it.
        """
        job = self._start(ref, layer_range, revision)
        if not job.done.wait(timeout_s):
            raise Unavailable(f"materialising {layer_range} of {ref} took longer than {timeout_s}s")
        if job.exception is not None:
            raise job.exception
        return job.snapshot().local_dir
