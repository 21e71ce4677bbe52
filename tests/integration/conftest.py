"""Fixtures shared by the tests that start real meshes."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.localmesh import MeshProcesses


@pytest.fixture
def mesh_factory(tmp_path: Path):
    """Start meshes (``make(package, stages, **MeshProcesses options)``); every one
    is closed when the test ends."""
    meshes: list[MeshProcesses] = []

    def make(package: Path, stages: int, **kwargs) -> MeshProcesses:
        mesh = MeshProcesses(package, tmp_path / f"mesh{len(meshes)}", stages, **kwargs)
        meshes.append(mesh)
        return mesh.start()

    yield make
    for mesh in meshes:
        mesh.close()
