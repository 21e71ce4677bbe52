"""A package that lives on another host, read through a ``RemotePackageSource``.

A worker without a shared file system cannot read the head's package directory;
the coordinator serves the package's files instead (see ``stage/package_client.py``
for the gRPC client and ``coordinator/package_server.py`` for the server). The
resolver only needs the manifest and a way to make a local file hold one package
file's bytes; it verifies the sha256 itself, as for every other source.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from mesh.package.manifest import PackageFile, PackageManifest


class RemotePackageSource(Protocol):
    """Where packages that are not on this host come from."""

    def describe(self) -> str:
        """Where the files come from, for messages ("the coordinator at host:port")."""
        ...

    def manifest(self, ref: str) -> PackageManifest:
        """The manifest of package ``ref``; raises a MeshError when it cannot be had."""
        ...

    def download(
        self,
        ref: str,
        entry: PackageFile,
        dest: Path,
        progress: Callable[[int], None],
        cancelled: Callable[[], bool],
    ) -> None:
        """Make ``dest`` hold all ``entry.bytes`` bytes of the file, resuming from the
        bytes ``dest`` already holds. Calls ``progress(bytes_so_far)``; raises a
        MeshError when the transfer fails for good."""
        ...


def looks_like_path(ref: str) -> bool:
    """A package reference written as a file system path (not an HF repo id)."""
    return ref.startswith(("/", "./", "../", "~"))
