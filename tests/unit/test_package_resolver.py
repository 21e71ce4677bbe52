"""SliceResolver over local package directories: only the needed files, verified,
atomic, reused, and clear errors that leave nothing partial behind."""

from __future__ import annotations

import builtins
import json
import shutil
import threading
import time
from pathlib import Path

import pytest

from mesh.errors import InvalidRequest, PackageError, UnsupportedArchitecture
from mesh.package import copying
from mesh.package.manifest import EMBED_PATH, HEAD_PATH, MANIFEST_NAME, PackageManifest, layer_path
from mesh.package.resolver import SliceInventory, SliceResolver, slice_dir_name
from mesh.types import LayerRange

META = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"}


@pytest.fixture
def package(tiny_package_factory, tmp_path) -> Path:
    """A private copy of a 6-layer tiny package (tests modify it)."""
    target = tmp_path / "source-package"
    shutil.copytree(tiny_package_factory("llama"), target)
    return target


def files_under(directory: Path) -> set[str]:
    return {p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file()}


def test_middle_range_touches_no_other_layer_file(package, tmp_path, monkeypatch):
    manifest = PackageManifest.load(package)
    for index in (0, 1, 4, 5):
        (package / layer_path(index)).unlink()
    (package / EMBED_PATH).unlink()
    (package / HEAD_PATH).unlink()
    opened: list[str] = []
    real_open = builtins.open

    def spying_open(file, *args, **kwargs):
        opened.append(str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(copying, "open", spying_open, raising=False)

    resolver = SliceResolver(tmp_path / "cache")
    local = resolver.materialise(str(package), LayerRange(2, 4))

    assert local == tmp_path / "cache" / slice_dir_name(manifest)
    expected = {MANIFEST_NAME, layer_path(2), layer_path(3)} | {
        e.path for e in manifest.files if e.kind == "meta"
    }
    assert files_under(local) == expected
    assert files_under(tmp_path / "cache") == {f"{local.name}/{p}" for p in expected}
    source_reads = {Path(p).relative_to(package).as_posix() for p in opened if str(package) in p}
    assert source_reads == expected - {MANIFEST_NAME}
    assert PackageManifest.load(local).sha256() == manifest.sha256()


def test_inventory_reports_ready_with_bytes(package, tmp_path):
    manifest = PackageManifest.load(package)
    resolver = SliceResolver(tmp_path / "cache")
    assert resolver.inventory() == SliceInventory(state="empty")

    resolver.start(str(package), LayerRange(4, 6))
    inventory = resolver.wait(timeout_s=60)

    needed = manifest.files_for(LayerRange(4, 6))
    assert inventory.state == "ready" and inventory.ready
    assert inventory.error is None and inventory.error_code is None
    assert inventory.manifest_sha256 == manifest.sha256()
    assert inventory.model_id == "tiny-llama"
    assert inventory.layer_range == LayerRange(4, 6)
    assert inventory.bytes_total == inventory.bytes_done == sum(e.bytes for e in needed)
    assert [f.path for f in inventory.files] == [e.path for e in needed]
    assert all(f.state == "ready" and f.bytes_done == f.bytes_total for f in inventory.files)
    assert HEAD_PATH in {f.path for f in inventory.files}
    assert EMBED_PATH not in {f.path for f in inventory.files}
    assert inventory.local_dir is not None and (inventory.local_dir / HEAD_PATH).is_file()


def test_start_returns_at_once_and_repeats_are_no_ops(package, tmp_path, monkeypatch):
    gate_open = threading.Event()
    real_install = copying.install_verified

    def slow_install(*args, **kwargs):
        assert gate_open.wait(30)
        return real_install(*args, **kwargs)

    monkeypatch.setattr("mesh.package.resolver.install_verified", slow_install)
    resolver = SliceResolver(tmp_path / "cache")
    began = time.monotonic()
    resolver.start(str(package), LayerRange(0, 6))
    resolver.start(str(package), LayerRange(0, 6))
    assert time.monotonic() - began < 5
    deadline = time.monotonic() + 30
    while not resolver.inventory().files and time.monotonic() < deadline:
        time.sleep(0.01)
    preparing = resolver.inventory()
    assert preparing.state == "preparing"
    assert preparing.bytes_done == 0 and preparing.bytes_total > 0
    assert {f.state for f in preparing.files} <= {"missing", "preparing"}
    gate_open.set()
    assert resolver.wait(timeout_s=60).state == "ready"


def test_present_files_are_reused_not_copied(package, tmp_path, monkeypatch):
    resolver = SliceResolver(tmp_path / "cache")
    local = resolver.materialise(str(package), LayerRange(0, 3))
    inode = (local / layer_path(1)).stat().st_ino

    copies: list[str] = []
    monkeypatch.setattr(
        "mesh.package.resolver.install_verified",
        lambda source, *a, **k: copies.append(str(source)),
    )
    again = SliceResolver(tmp_path / "cache").materialise(str(package), LayerRange(0, 3))
    assert again == local and copies == []
    assert (local / layer_path(1)).stat().st_ino == inode


def test_a_corrupt_cached_file_is_fetched_again(package, tmp_path):
    resolver = SliceResolver(tmp_path / "cache")
    local = resolver.materialise(str(package), LayerRange(2, 4))
    original = (package / layer_path(2)).read_bytes()
    (local / layer_path(2)).write_bytes(b"\0" * len(original))
    SliceResolver(tmp_path / "cache").materialise(str(package), LayerRange(2, 4))
    assert (local / layer_path(2)).read_bytes() == original


def test_sha_mismatch_fails_and_leaves_nothing_partial(package, tmp_path):
    corrupt = package / layer_path(3)
    data = bytearray(corrupt.read_bytes())
    data[-1] ^= 0xFF
    corrupt.write_bytes(bytes(data))

    resolver = SliceResolver(tmp_path / "cache", chunk_bytes=4096)
    with pytest.raises(PackageError, match=r"sha256 mismatch in layers/00003\.safetensors"):
        resolver.materialise(str(package), LayerRange(2, 4))

    inventory = resolver.inventory()
    assert inventory.state == "failed" and inventory.local_dir is None
    assert "layers/00003.safetensors" in inventory.error
    assert inventory.error_code == "INVALID_ARGUMENT"
    failed = {f.path: f for f in inventory.files}[layer_path(3)]
    assert failed.state == "failed" and "sha256 mismatch" in failed.error
    cache = tmp_path / "cache"
    assert not list(cache.rglob("*.part"))
    assert not (cache / slice_dir_name(PackageManifest.load(package)) / layer_path(3)).exists()
    assert all(not name.endswith(layer_path(3)) for name in files_under(cache))


def test_a_wrong_size_source_file_is_refused(package, tmp_path):
    with open(package / layer_path(2), "ab") as handle:
        handle.write(b"trailing garbage")
    with pytest.raises(PackageError, match="sha256 mismatch in layers/00002"):
        SliceResolver(tmp_path / "cache").materialise(str(package), LayerRange(2, 3))
    assert not list((tmp_path / "cache").rglob("*.part"))


def test_range_outside_the_model_is_invalid(package, tmp_path):
    resolver = SliceResolver(tmp_path / "cache")
    with pytest.raises(InvalidRequest, match=r"\[4, 8\) is outside \[0, 6\)"):
        resolver.materialise(str(package), LayerRange(4, 8))
    assert resolver.inventory().state == "failed"
    assert not (tmp_path / "cache").exists() or files_under(tmp_path / "cache") == set()


def test_missing_layer_file_in_source_is_named(package, tmp_path):
    (package / layer_path(4)).unlink()
    with pytest.raises(PackageError, match=r"layers/00004\.safetensors is missing"):
        SliceResolver(tmp_path / "cache").materialise(str(package), LayerRange(4, 5))


def test_missing_and_corrupt_manifests(package, tmp_path):
    resolver = SliceResolver(tmp_path / "cache")
    (package / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(PackageError, match="model-package.json is not valid JSON"):
        resolver.materialise(str(package), LayerRange(0, 1))
    (package / MANIFEST_NAME).unlink()
    with pytest.raises(PackageError, match="model-package.json not found"):
        resolver.materialise(str(package), LayerRange(0, 1))
    assert not (tmp_path / "cache").exists() or files_under(tmp_path / "cache") == set()


def test_unsupported_architecture_in_manifest(package, tmp_path):
    body = json.loads((package / MANIFEST_NAME).read_text())
    body["architecture"] = "FalconForCausalLM"
    (package / MANIFEST_NAME).write_text(json.dumps(body))
    with pytest.raises(UnsupportedArchitecture, match="FalconForCausalLM"):
        SliceResolver(tmp_path / "cache").materialise(str(package), LayerRange(0, 1))


def test_unknown_reference_is_refused(tmp_path):
    with pytest.raises(PackageError, match="neither a local package directory"):
        SliceResolver(tmp_path / "cache").materialise("no such thing", LayerRange(0, 1))


def test_a_new_request_supersedes_the_old_one(package, tmp_path):
    resolver = SliceResolver(tmp_path / "cache")
    resolver.start(str(package), LayerRange(0, 2))
    resolver.start(str(package), LayerRange(2, 6))
    inventory = resolver.wait(timeout_s=60)
    assert inventory.state == "ready" and inventory.layer_range == LayerRange(2, 6)
    assert layer_path(5) in {f.path for f in inventory.files}
    assert not list((tmp_path / "cache").rglob("*.part"))


def test_failed_request_can_be_retried(package, tmp_path):
    backup = (package / layer_path(1)).read_bytes()
    (package / layer_path(1)).unlink()
    resolver = SliceResolver(tmp_path / "cache")
    resolver.start(str(package), LayerRange(0, 2))
    assert resolver.wait(timeout_s=60).state == "failed"
    (package / layer_path(1)).write_bytes(backup)
    assert resolver.materialise(str(package), LayerRange(0, 2)).is_dir()
    assert resolver.inventory().state == "ready"


class OtherHost:
    """A ``RemotePackageSource`` serving ``directory`` (the coordinator's package) for
    any reference, counting the files it sends."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.sent: list[str] = []

    def describe(self) -> str:
        return "the coordinator at test:1"

    def manifest(self, ref: str) -> PackageManifest:
        return PackageManifest.load(self.directory)

    def download(self, ref, entry, dest, progress, cancelled) -> None:
        self.sent.append(entry.path)
        data = (self.directory / entry.path).read_bytes()
        dest.write_bytes(data)
        progress(len(data))


def test_a_stale_local_copy_is_passed_over_for_the_coordinator_s(
    package, tiny_package_factory, tmp_path, caplog
):
    """A worker holds another package at the path the coordinator names (a copy from
    before the package was rebuilt): with the coordinator's manifest to compare,
    the slice comes from the coordinator. Before, the worker prepared its stale copy,
    the coordinator refused it for its manifest, and the worker was left out."""
    served = tiny_package_factory("llama", seed=1)
    expected = PackageManifest.load(served).sha256()
    assert PackageManifest.load(package).sha256() != expected
    coordinator = OtherHost(served)
    resolver = SliceResolver(tmp_path / "cache", remote=coordinator)
    resolver.start(str(package), LayerRange(2, 4), expected=expected)
    inventory = resolver.wait(timeout_s=60)
    assert inventory.state == "ready" and inventory.manifest_sha256 == expected
    wanted = PackageManifest.load(served).files_for(LayerRange(2, 4))
    assert coordinator.sent == [e.path for e in wanted]
    for entry in wanted:
        assert (inventory.local_dir / entry.path).read_bytes() == (served / entry.path).read_bytes()
    assert "is not the coordinator's" in caplog.text

    # An empty directory at the path (a mount that is not there) is no package.
    empty = tmp_path / "empty-mount"
    empty.mkdir()
    caplog.clear()
    fetched = SliceResolver(tmp_path / "cache-3", remote=OtherHost(served))
    fetched.start(str(empty), LayerRange(2, 4), expected=expected)
    assert fetched.wait(timeout_s=60).state == "ready" and fetched.remote.sent
    assert f"{empty} holds no package this stage can read" in caplog.text
    assert "from the coordinator at test:1" in caplog.text

    # The copy that is the coordinator's is read here, as before.
    same = SliceResolver(tmp_path / "cache-2", remote=OtherHost(package))
    same.start(str(package), LayerRange(2, 4), expected=PackageManifest.load(package).sha256())
    assert same.wait(timeout_s=60).state == "ready"
    assert same.remote.sent == []
