"""Install one package file into a slice cache: copy (or hard-link) to a ``.part``
file, check its size and sha256, then rename into place. A file that fails the
check never appears under its real name, and its ``.part`` is removed."""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from mesh.errors import PackageError, Unavailable
from mesh.package.manifest import PackageFile

logger = logging.getLogger(__name__)

PART_SUFFIX = ".part"
STALE_PART_S = 3600.0


def install_verified(
    source: Path,
    target: Path,
    entry: PackageFile,
    *,
    origin: str,
    link: bool = False,
    chunk_bytes: int = 8 << 20,
    progress: Callable[[int], None] | None = None,
    cancelled: Callable[[], bool] | None = None,
    cancel_error: type[Exception] = InterruptedError,
) -> None:
    """Put a verified copy of ``source`` at ``target``.

    ``link`` tries a hard link first (for immutable hub-cache blobs) and falls back
    to copying. Raises PackageError when the source is missing, unreadable or does
    not match ``entry``; Unavailable when the cache cannot be written.
    """
    source = Path(source)
    if not source.is_file():
        raise PackageError(f"{entry.path} is missing from the package at {origin}")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        handle, temp_name = tempfile.mkstemp(
            dir=target.parent, prefix=f".{target.name}.", suffix=PART_SUFFIX
        )
        os.close(handle)
    except OSError as error:
        raise Unavailable(f"cannot write to the slice cache {target.parent}: {error}") from error
    temp = Path(temp_name)
    try:
        if not (link and _try_link(source, temp)):
            digest, size = _copy_hashing(
                source, temp, entry, origin, chunk_bytes, progress, cancelled, cancel_error
            )
        else:
            digest, size = _hash(temp, chunk_bytes)
        if size != entry.bytes or digest != entry.sha256:
            raise PackageError(
                f"sha256 mismatch in {entry.path} from {origin}: got {size} bytes with "
                f"sha256 {digest[:16]}..., the manifest says {entry.bytes} bytes with "
                f"{entry.sha256[:16]}...; the package is corrupt: rebuild it with "
                "mesh-package build or fetch it again"
            )
        os.chmod(temp, 0o644)  # mkstemp creates 0600; cached slices are shared read-only files
        os.replace(temp, target)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    if progress is not None:
        progress(entry.bytes)


def _try_link(source: Path, temp: Path) -> bool:
    try:
        temp.unlink()
        os.link(source, temp)
    except OSError:
        return False
    return True


def _hash(path: Path, chunk_bytes: int) -> tuple[str, int]:
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(chunk_bytes):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


def _copy_hashing(
    source: Path,
    temp: Path,
    entry: PackageFile,
    origin: str,
    chunk_bytes: int,
    progress: Callable[[int], None] | None,
    cancelled: Callable[[], bool] | None,
    cancel_error: type[Exception],
) -> tuple[str, int]:
    digest = hashlib.sha256()
    size = 0
    try:
        reader = open(source, "rb")
    except OSError as error:
        raise PackageError(f"cannot read {entry.path} from {origin}: {error}") from error
    try:
        writer = open(temp, "wb")
    except OSError as error:
        reader.close()
        raise Unavailable(f"cannot write {temp}: {error}") from error
    with reader, writer:
        while True:
            if cancelled is not None and cancelled():
                raise cancel_error()
            try:
                chunk = reader.read(chunk_bytes)
            except OSError as error:
                raise PackageError(f"cannot read {entry.path} from {origin}: {error}") from error
            if not chunk:
                break
            digest.update(chunk)
            size += len(chunk)
            if size > entry.bytes:
                break
            try:
                writer.write(chunk)
            except OSError as error:
                raise Unavailable(f"cannot write {temp}: {error}; check free space") from error
            if progress is not None:
                progress(size)
        writer.flush()
        os.fsync(writer.fileno())
    return digest.hexdigest(), size


def cleanup_stale_parts(directory: Path, older_than_s: float = STALE_PART_S) -> int:
    """Remove ``.part`` files left by crashed writers (older than ``older_than_s``)."""
    removed = 0
    now = time.time()
    for part in Path(directory).rglob(f"*{PART_SUFFIX}"):
        try:
            if now - part.stat().st_mtime > older_than_s:
                part.unlink()
                removed += 1
        except OSError:
            continue
    if removed:
        logger.info("removed %d stale partial file(s) under %s", removed, directory)
    return removed
