"""Packages and slices from Hugging Face repos, offline, through a hub cache laid out
the way huggingface_hub writes it (models--org--name/snapshots/<commit>, refs/main)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from mesh.errors import PackageError
from mesh.package.builder import build_package
from mesh.package.hub import hub_cache_dir, parse_repo_ref, snapshot_commit
from mesh.package.manifest import MANIFEST_NAME, PackageManifest, layer_path
from mesh.package.resolver import SliceResolver
from mesh.package.tensors import load_hf_state_dict
from mesh.types import LayerRange

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def populate_hub_cache(cache: Path, repo_id: str, source: Path, commit: str = COMMIT) -> Path:
    """Copy ``source`` into ``cache`` as snapshot ``commit`` of ``repo_id`` (refs/main)."""
    repo_dir = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo_dir / "snapshots" / commit
    shutil.copytree(source, snapshot)
    (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
    (repo_dir / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture
def offline_hub(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "hf-home" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_hub_environment_is_read_at_call_time(offline_hub, tmp_path, monkeypatch):
    assert hub_cache_dir() == offline_hub
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    assert hub_cache_dir() == tmp_path / "elsewhere"


def test_repo_refs():
    assert str(parse_repo_ref("org/name")) == "org/name"
    assert parse_repo_ref("org/name@v1.0").revision == "v1.0"
    assert parse_repo_ref("org/name@v1", revision="main").revision == "main"
    assert parse_repo_ref("just-a-name") is None
    assert parse_repo_ref("/abs/path/x") is None
    with pytest.raises(PackageError, match="not a valid branch"):
        parse_repo_ref("org/name@bad rev")


def test_build_from_a_cached_repo_offline(offline_hub, tiny_model_factory, tmp_path):
    source = tiny_model_factory("qwen2", shards=3)
    populate_hub_cache(offline_hub, "tiny-org/tiny-qwen2", source)

    manifest = build_package("tiny-org/tiny-qwen2", tmp_path / "pkg")
    assert manifest.model_id == "tiny-org/tiny-qwen2"
    assert manifest.source == {"kind": "hf-repo", "repo": "tiny-org/tiny-qwen2", "revision": COMMIT}
    pinned = build_package(f"tiny-org/tiny-qwen2@{COMMIT}", tmp_path / "pinned")
    assert pinned.files == manifest.files

    from transformers import AutoModelForCausalLM

    expected = AutoModelForCausalLM.from_pretrained(source).state_dict()
    rebuilt = load_hf_state_dict(tmp_path / "pkg")
    assert sorted(rebuilt) == sorted(expected)
    assert all(torch.equal(rebuilt[name], expected[name]) for name in expected)


def test_uncached_repo_offline_is_a_clear_error(offline_hub, tmp_path):
    with pytest.raises(PackageError, match="HF_HUB_OFFLINE=1"):
        build_package("tiny-org/not-cached", tmp_path / "pkg")
    assert not (tmp_path / "pkg").exists()


def test_slice_from_a_cached_package_repo(offline_hub, tiny_package_factory, tmp_path):
    package = tiny_package_factory("qwen3")
    snapshot = populate_hub_cache(offline_hub, "tiny-org/tiny-qwen3-package", package)
    for index in (0, 1, 4, 5):  # a range's fetch must not need them
        (snapshot / layer_path(index)).unlink()

    resolver = SliceResolver(tmp_path / "slices")
    local = resolver.materialise("tiny-org/tiny-qwen3-package", LayerRange(2, 4))

    manifest = PackageManifest.load(package)
    expected = {MANIFEST_NAME, layer_path(2), layer_path(3)}
    expected |= {e.path for e in manifest.files if e.kind == "meta"}
    assert {p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file()} == expected
    assert (local / layer_path(2)).read_bytes() == (package / layer_path(2)).read_bytes()
    inventory = resolver.inventory()
    assert inventory.state == "ready" and inventory.manifest_sha256 == manifest.sha256()
    assert inventory.package_ref == "tiny-org/tiny-qwen3-package"


def test_slice_from_a_corrupt_repo_file_fails_cleanly(offline_hub, tiny_package_factory, tmp_path):
    package = tiny_package_factory("llama")
    snapshot = populate_hub_cache(offline_hub, "tiny-org/corrupt", package)
    layer = snapshot / layer_path(1)
    layer.write_bytes(b"\x01" * layer.stat().st_size)

    resolver = SliceResolver(tmp_path / "slices")
    with pytest.raises(PackageError, match=r"sha256 mismatch in layers/00001\.safetensors"):
        resolver.materialise("tiny-org/corrupt", LayerRange(0, 2))
    assert not list((tmp_path / "slices").rglob("*.part"))
    assert not list((tmp_path / "slices").rglob(layer_path(1)))
    assert resolver.inventory().state == "failed"


def test_missing_package_repo_offline(offline_hub, tmp_path):
    with pytest.raises(PackageError, match="not in the local Hugging Face cache"):
        SliceResolver(tmp_path / "slices").materialise("tiny-org/absent", LayerRange(0, 1))


def test_snapshot_commit_of_nested_paths(tmp_path):
    base = tmp_path / "models--a--b" / "snapshots" / COMMIT
    assert snapshot_commit(base / "model-package.json", "model-package.json") == COMMIT
    assert snapshot_commit(base / "layers" / "00001.safetensors", "layers/00001.safetensors") == (
        COMMIT
    )
    assert snapshot_commit(tmp_path / "x" / "model-package.json", "model-package.json") is None
