"""The mesh-package command line: build, inspect, verify, fetch, and error exits."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from mesh.package.cli import main
from mesh.package.manifest import MANIFEST_NAME, PackageManifest, layer_path

SPECULATIVE = {
    "default": "smol-ngram",
    "strategies": {"smol-ngram": {"type": "ngram", "ngram_min": 2, "ngram_max": 6}},
}


@pytest.fixture
def package(tiny_package_factory, tmp_path):
    target = tmp_path / "pkg"
    shutil.copytree(tiny_package_factory("mistral"), target)
    return target


def test_build_with_speculative_file(tiny_model_factory, tmp_path, capsys):
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(SPECULATIVE))
    out = tmp_path / "built"
    code = main(
        [
            "build",
            str(tiny_model_factory("qwen3")),
            "--out",
            str(out),
            "--dtype",
            "bfloat16",
            "--model-id",
            "tiny-qwen3",
            "--speculative",
            f"@{spec_file}",
        ]
    )
    assert code == 0
    manifest = PackageManifest.load(out)
    assert manifest.model_id == "tiny-qwen3" and manifest.dtype == "bfloat16"
    assert manifest.generation == {"speculative_decoding": SPECULATIVE}
    assert "tiny-qwen3: 6 layers, bfloat16" in capsys.readouterr().out


def test_build_inline_speculative_json(tiny_model_factory, tmp_path):
    out = tmp_path / "built"
    args = ["build", str(tiny_model_factory("llama")), "--out", str(out)]
    assert main([*args, "--speculative", json.dumps(SPECULATIVE)]) == 0
    assert PackageManifest.load(out).generation["speculative_decoding"] == SPECULATIVE


@pytest.mark.parametrize(
    "speculative, message",
    [
        ("{oops", "not valid JSON"),
        ('{"default": "x"}', "lacks strategies"),
        ("@/nope.json", "cannot read"),
    ],
)
def test_build_bad_speculative_exits_2(speculative, message, tiny_model_factory, tmp_path, capsys):
    args = ["build", str(tiny_model_factory("llama")), "--out", str(tmp_path / "o")]
    assert main([*args, "--speculative", speculative]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_inspect_prints_summary_and_file_table(package, capsys):
    assert main(["inspect", str(package)]) == 0
    out = capsys.readouterr().out
    manifest = PackageManifest.load(package)
    for expected in (
        "model         tiny-mistral",
        "architecture  MistralForCausalLM (mistral)",
        "layers        6",
        "hidden        64",
        "dtype         float32",
        "tied          no",
        "source        kind=hf-dir",
    ):
        assert expected in out
    row = next(line for line in out.splitlines() if line.startswith(layer_path(4)))
    entry = manifest.file(layer_path(4))
    assert row.split() == [entry.path, "layer", "4", str(entry.bytes), entry.sha256[:12]]
    total = sum(e.bytes for e in manifest.files)
    assert f"total    {len(manifest.files)} file(s)" in out and str(total) in out


def test_verify_ok_then_reports_each_problem(package, capsys):
    assert main(["verify", str(package)]) == 0
    assert capsys.readouterr().out.startswith("OK ")

    (package / layer_path(1)).unlink()
    damaged = package / layer_path(2)
    damaged.write_bytes(b"\0" * damaged.stat().st_size)
    with open(package / "config.json", "a") as handle:
        handle.write(" ")
    assert main(["verify", str(package)]) == 1
    out = capsys.readouterr().out
    assert "FAIL layers/00001.safetensors: missing" in out
    assert "FAIL layers/00002.safetensors: sha256" in out
    assert "FAIL config.json: size" in out
    assert "3 problem(s)" in out


def test_verify_quick_checks_sizes_only(package, capsys):
    damaged = package / layer_path(2)
    damaged.write_bytes(b"\0" * damaged.stat().st_size)
    assert main(["verify", "--quick", str(package)]) == 0
    assert main(["verify", str(package)]) == 1


def test_fetch_materialises_a_slice(package, tmp_path, capsys):
    code = main(["fetch", str(package), "--layers", "0:2", "--cache-dir", str(tmp_path / "c")])
    assert code == 0
    assert "slice [0, 2) ready" in capsys.readouterr().out
    (slice_dir,) = (tmp_path / "c").iterdir()
    assert (slice_dir / "shared" / "embed.safetensors").is_file()
    assert not (slice_dir / "shared" / "head.safetensors").exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["inspect", "{tmp}/nothing"], "model-package.json not found"),
        (["verify", "{tmp}/nothing"], "model-package.json not found"),
        (["build", "{tmp}/nothing", "--out", "{tmp}/o"], "not found"),
        (["build", "some/repo"], "--out DIR is required"),
        (["fetch", "{pkg}", "--layers", "4:9", "--cache-dir", "{tmp}/c"], "[4, 9) is outside"),
        (["fetch", "{pkg}", "--layers", "x", "--cache-dir", "{tmp}/c"], "cannot parse"),
    ],
)
def test_errors_exit_2_with_a_message(argv, message, package, tmp_path, capsys):
    args = [a.format(tmp=tmp_path, pkg=package) for a in argv]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_corrupt_manifest_via_console_entry_point(package):
    (package / MANIFEST_NAME).write_text('{"schema_version": 1}')
    result = subprocess.run(
        [sys.executable, "-m", "mesh.package.cli", "verify", str(package)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "missing field(s)" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("change", ["duplicate", "negative"])
def test_a_manifest_listing_a_file_twice_or_a_negative_size_is_refused(package, capsys, change):
    path = package / MANIFEST_NAME
    body = json.loads(path.read_text())
    if change == "duplicate":
        body["files"].append(dict(body["files"][0]))
    else:
        body["files"][0]["bytes"] = -5
    path.write_text(json.dumps(body))
    assert main(["verify", str(package)]) == 2
    err = capsys.readouterr().err
    assert ("listed twice" if change == "duplicate" else "negative size") in err
