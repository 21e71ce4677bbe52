"""Safetensors headers in `mesh-package verify`: a file whose hash matches the manifest
but which cannot be loaded (truncated and re-hashed, a header that lies) is caught."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from package_support import rehash

from mesh.package.cli import main
from mesh.package.manifest import (
    EMBED_PATH,
    HEAD_PATH,
    layer_path,
)
from mesh.package.safetensors_header import header_problem, read_header
from mesh.package.verify import verify_package


@pytest.fixture
def package(tiny_package_factory, tmp_path) -> Path:
    target = tmp_path / "pkg"
    shutil.copytree(tiny_package_factory("llama", layers=2), target)
    return target


def rewrite_header(path: Path, edit) -> None:
    """Replace the JSON header of ``path`` with ``edit(header)``, keeping the data."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = edit(json.loads(data[8 : 8 + length]))
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + length :])


def test_intact_package_passes_with_headers(package):
    assert verify_package(package) == []
    tensors, size = read_header(package / HEAD_PATH)
    assert {t.name for t in tensors} == {"norm.weight", "lm_head.weight"}
    assert size == (package / HEAD_PATH).stat().st_size


def test_truncated_and_rehashed_file_fails_verify(package, capsys):
    path = package / layer_path(1)
    path.write_bytes(path.read_bytes()[:-100])
    rehash(package, layer_path(1))
    assert main(["verify", str(package)]) == 1
    out = capsys.readouterr().out
    assert f"FAIL {layer_path(1)}: safetensors header: the file is" in out
    assert "(truncated)" in out and "1 problem(s)" in out


def test_truncated_file_fails_the_console_command(package):
    path = package / EMBED_PATH
    path.write_bytes(path.read_bytes()[:-4])
    rehash(package, EMBED_PATH)
    result = subprocess.run(
        [sys.executable, "-m", "mesh.package.cli", "verify", str(package)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    assert f"FAIL {EMBED_PATH}: safetensors header" in result.stdout


def test_header_that_lies_about_a_shape(package):
    """Data intact, header rewritten and re-hashed: the embedding's shape is not the
    manifest's vocab x hidden."""

    def halve(header: dict) -> dict:
        entry = header["embed_tokens.weight"]
        rows, cols = entry["shape"]
        entry["shape"] = [rows * 2, cols // 2]
        return header

    rewrite_header(package / EMBED_PATH, halve)
    rehash(package, EMBED_PATH)
    (problem,) = verify_package(package)
    assert problem.startswith(f"{EMBED_PATH}: safetensors header: embed_tokens.weight has shape")
    assert "the manifest implies [49152, 64]" in problem


def test_header_with_another_dtype(package):
    def as_f16(header: dict) -> dict:
        entry = header["input_layernorm.weight"]
        entry["dtype"], entry["shape"] = "F16", [entry["shape"][0] * 2]
        return header

    rewrite_header(package / layer_path(0), as_f16)
    rehash(package, layer_path(0))
    (problem,) = verify_package(package)
    assert "input_layernorm.weight is F16, the manifest's dtype is F32" in problem


@pytest.mark.parametrize(
    "content, message",
    [
        (b"\x01\x00", "no safetensors header length"),
        (struct.pack("<Q", 1 << 40) + b"{}", "header length 1099511627776 is not plausible"),
        (struct.pack("<Q", 64) + b"{}", "the file ends after 2 of them"),
        (struct.pack("<Q", 4) + b"nope", "header is not JSON"),
        (
            struct.pack("<Q", 64)
            + b'{"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}'.ljust(64),
            "needs 16 bytes",
        ),
        (
            struct.pack("<Q", 64)
            + b'{"t": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}'.ljust(64)
            + b"\0" * 16,
            "leaves a hole",
        ),
        (
            struct.pack("<Q", 64)
            + b'{"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}'.ljust(64)
            + b"\0" * 12,
            "has trailing bytes",
        ),
    ],
)
def test_malformed_headers(content, message, tmp_path):
    path = tmp_path / "t.safetensors"
    path.write_bytes(content)
    problem = header_problem(path)
    assert problem is not None and message in problem
