"""Helpers for tests that damage a built package on purpose."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from mesh.package.manifest import PackageManifest, sha256_file


def rehash(package: Path, relative: str) -> None:
    """Make the manifest describe the file as it is now (size and sha256), so only
    checks beyond the hash can tell the file was damaged."""
    manifest = PackageManifest.load(package)
    path = package / relative
    files = tuple(
        dataclasses.replace(f, bytes=path.stat().st_size, sha256=sha256_file(path))
        if f.path == relative
        else f
        for f in manifest.files
    )
    dataclasses.replace(manifest, files=files).save(package)
