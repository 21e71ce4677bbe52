"""Check a package directory against its manifest: every file present, right size,
right sha256."""

from __future__ import annotations

import logging
from pathlib import Path

from mesh.package.manifest import PackageFile, PackageManifest, sha256_file

logger = logging.getLogger(__name__)


def verify_package(directory: Path, *, quick: bool = False) -> list[str]:
    """Problems found in the package at ``directory``, one readable line each.

    An empty list means the package is intact. ``quick`` checks presence and sizes
    only (no hashing). A missing or malformed manifest raises PackageError.
    """
    directory = Path(directory)
    manifest = PackageManifest.load(directory)
    return verify_files(directory, manifest.files, quick=quick)


def verify_files(
    directory: Path, files: tuple[PackageFile, ...] | list[PackageFile], *, quick: bool = False
) -> list[str]:
    """Check the listed ``files`` under ``directory``; see verify_package."""
    problems: list[str] = []
    for entry in files:
        path = Path(directory) / entry.path
        problem = file_problem(path, entry, quick=quick)
        if problem is not None:
            problems.append(f"{entry.path}: {problem}")
    if problems:
        logger.warning("package %s: %d problem(s)", directory, len(problems))
    return problems


def file_problem(path: Path, entry: PackageFile, *, quick: bool = False) -> str | None:
    """Why ``path`` does not match ``entry``, or None when it does."""
    if not path.is_file():
        return "missing"
    size = path.stat().st_size
    if size != entry.bytes:
        return f"size {size} bytes, manifest says {entry.bytes}"
    if quick:
        return None
    try:
        digest = sha256_file(path)
    except OSError as error:
        return f"unreadable: {error}"
    if digest != entry.sha256:
        return f"sha256 {digest[:16]}... does not match the manifest's {entry.sha256[:16]}..."
    return None
