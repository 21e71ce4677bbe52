"""`mesh-stage doctor` against a real coordinator (`mesh-coordinator up`, waiting for
its stages): reachable with the right token, refused with a wrong one, a memory
offer too small for one layer, the cached slice of a package this host does not
hold; and `mesh-coordinator doctor` sees the running coordinator's port taken."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator.localmesh import MeshProcesses
from mesh.codec import StatusReply
from mesh.package.manifest import PackageManifest, layer_path
from mesh.package.resolver import slice_dir_name
from stage.doctor import CoordinatorView, check_served_package

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
TOKEN = "doctor-test-token"


@pytest.fixture(scope="module")
def package(tiny_package_factory, tmp_path_factory) -> Path:
    target = tmp_path_factory.mktemp("doctor-package") / "pkg"
    shutil.copytree(tiny_package_factory("llama", layers=2), target)
    return target


@pytest.fixture(scope="module")
def coordinator(package, tmp_path_factory):
    """A coordinator that requires a join token and waits for one stage."""
    mesh = MeshProcesses(
        package, tmp_path_factory.mktemp("doctor-mesh"), 1, env={"MESH_JOIN_TOKEN": TOKEN}
    )
    try:
        mesh.wait_address()
        yield mesh
    finally:
        mesh.close()


def stage_doctor(address: str, cache: Path, *extra: str, token: str = TOKEN):
    env = {**os.environ, "MESH_JOIN_TOKEN": token}
    argv = ["--coordinator", address, "--listen", "127.0.0.1:0", "--cache-dir", str(cache)]
    return subprocess.run(
        [BIN / "mesh-stage", "doctor", *argv, *extra],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def line_of(stdout: str, check: str) -> str:
    (line,) = [line for line in stdout.splitlines() if line.split()[1:2] == [check]]
    return line


def test_stage_doctor_reaches_the_coordinator(coordinator, package, tmp_path):
    args = ("--frontend", "--http-port", "0", "--prefix-cache-mb", "64")
    result = stage_doctor(coordinator.wait_address(), tmp_path / "cache", *args)
    assert result.returncode == 0, result.stdout + result.stderr
    reached = line_of(result.stdout, "coordinator")
    assert reached.startswith("PASS")
    assert f"model tiny-llama, package {package}" in reached
    assert line_of(result.stdout, "package").startswith("PASS")
    assert "sha256 and safetensors headers verified" in line_of(result.stdout, "package")
    assert line_of(result.stdout, "memory").startswith("PASS")


def test_stage_doctor_with_a_wrong_token(coordinator, tmp_path):
    result = stage_doctor(coordinator.wait_address(), tmp_path / "cache", token="not-it")
    assert result.returncode == 1
    reached = line_of(result.stdout, "coordinator")
    assert reached.startswith("FAIL") and "answered UNAUTHENTICATED" in reached
    assert "same join token" in reached


def test_stage_doctor_memory_too_small_for_a_layer(coordinator, tmp_path):
    result = stage_doctor(coordinator.wait_address(), tmp_path / "cache", "--memory", "1KiB")
    assert result.returncode == 1
    memory = line_of(result.stdout, "memory")
    assert memory.startswith("FAIL")
    assert "--memory 1.0 KiB cannot hold one layer" in memory and "leaves this stage out" in memory


def test_coordinator_doctor_sees_the_port_taken(coordinator, package):
    address = coordinator.wait_address()
    result = subprocess.run(
        [BIN / "mesh-coordinator", "doctor", "--model", package, "--listen", address],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1
    taken = next(line for line in result.stdout.splitlines() if "--listen" in line)
    assert taken.startswith("FAIL")
    assert f"--listen {address} is in use by pid {coordinator.coordinator.pid}" in taken


def test_cached_slice_of_a_package_elsewhere(package, tmp_path):
    """A stage that does not see the package path checks the files cached for it."""
    cache = tmp_path / "cache"
    subprocess.run(
        [BIN / "mesh-package", "fetch", package, "--layers", "0:1", "--cache-dir", cache],
        check=True,
        capture_output=True,
        timeout=300,
    )
    manifest = PackageManifest.load(package)
    view = CoordinatorView(StatusReply("c", "serving", package_ref="/elsewhere/pkg"), manifest)
    result = check_served_package(view, cache)
    assert result.status == "PASS" and "file(s) cached in" in result.detail
    damaged = cache / slice_dir_name(manifest) / layer_path(0)
    damaged.write_bytes(damaged.read_bytes()[:-8])
    result = check_served_package(view, cache)
    assert result.status == "WARN"
    assert f"{layer_path(0)}: size" in result.detail and "fetches them again" in result.fix
