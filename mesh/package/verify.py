"""Check a package directory against its manifest: every file present, right size,
right sha256, and every safetensors file's header sound and as the manifest implies
(mesh/package/safetensors_header.py)."""

from __future__ import annotations

import logging
from pathlib import Path

from mesh.package.manifest import PackageFile, PackageManifest, sha256_file
from mesh.package.safetensors_header import TensorExpectation, expectation, header_problem

logger = logging.getLogger(__name__)


def verify_package(directory: Path, *, quick: bool = False) -> list[str]:
    """Problems found in the package at ``directory``, one readable line each.

    An empty list means the package is intact. ``quick`` checks presence and sizes
    only (no hashing, no headers). A missing or malformed manifest raises PackageError.
    """
    directory = Path(directory)
    manifest = PackageManifest.load(directory)
    return verify_files(directory, manifest.files, quick=quick, manifest=manifest)


def verify_files(
    directory: Path,
    files: tuple[PackageFile, ...] | list[PackageFile],
    *,
    quick: bool = False,
    manifest: PackageManifest | None = None,
) -> list[str]:
    """Check the listed ``files`` under ``directory``; see verify_package. With
    ``manifest``, tensor headers are also compared with what it implies."""
    problems: list[str] = []
    for entry in files:
        path = Path(directory) / entry.path
        expected = expectation(manifest, entry) if manifest is not None else None
        problem = file_problem(path, entry, quick=quick, expected=expected)
        if problem is not None:
            problems.append(f"{entry.path}: {problem}")
    if problems:
        logger.warning("package %s: %d problem(s)", directory, len(problems))
    return problems


def file_problem(
    path: Path,
    entry: PackageFile,
    *,
    quick: bool = False,
    expected: TensorExpectation | None = None,
) -> str | None:
    """Why ``path`` does not match ``entry``, or None when it does: missing, another
    size, another sha256, or (not ``quick``) a safetensors header that does not
    describe the file (or not the tensors ``expected`` names)."""
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
    if entry.path.endswith(".safetensors"):
        return header_problem(path, expected)
    return None
