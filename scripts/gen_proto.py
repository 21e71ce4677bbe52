"""Regenerate the Python gRPC stubs in mesh/proto/v1 from proto/mesh/v1/*.proto.

    python scripts/gen_proto.py           # rewrite mesh/proto/v1
    python scripts/gen_proto.py --check   # exit 1 when the committed stubs are stale

protoc names the generated modules after the proto package (``mesh.v1``), which
would collide with the ``mesh`` Python package; the sibling imports are rewritten
to ``mesh.proto.v1``. The output depends only on the .proto files and the
grpcio-tools version, so regenerating twice gives identical files.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.metadata
import importlib.resources
import re
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "proto"
PROTO_PACKAGE_DIR = Path("mesh") / "v1"
OUT_DIR = REPO_ROOT / "mesh" / "proto" / "v1"

INIT_TEXT = (
    '"""Generated gRPC stubs for the mesh.v1 protocol (scripts/gen_proto.py; do not edit)."""\n'
)
GENERATED_SUFFIXES = (".py", ".pyi")

_IMPORT_FROM = re.compile(r"^from mesh\.v1 import ", re.MULTILINE)
_IMPORT_PLAIN = re.compile(r"^import mesh\.v1\.", re.MULTILINE)
_TOOLS_VERSION = re.compile(r"^GRPC_GENERATED_VERSION = '([^']+)'", re.MULTILINE)


def proto_files() -> list[Path]:
    """The .proto sources, relative to PROTO_ROOT, in a stable order."""
    files = sorted((PROTO_ROOT / PROTO_PACKAGE_DIR).glob("*.proto"))
    if not files:
        raise SystemExit(f"no .proto files under {PROTO_ROOT / PROTO_PACKAGE_DIR}")
    return [f.relative_to(PROTO_ROOT) for f in files]


def rewrite_imports(text: str) -> str:
    """Point generated sibling imports at mesh.proto.v1 instead of mesh.v1."""
    text = _IMPORT_FROM.sub("from mesh.proto.v1 import ", text)
    return _IMPORT_PLAIN.sub("import mesh.proto.v1.", text)


def generate() -> dict[str, str]:
    """Run protoc and return {file name: text} for every file of mesh/proto/v1."""
    well_known = importlib.resources.files("grpc_tools") / "_proto"
    with tempfile.TemporaryDirectory(prefix="mesh-proto-") as tmp:
        args = [
            "grpc_tools.protoc",
            f"--proto_path={PROTO_ROOT}",
            f"--proto_path={well_known}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *(str(p) for p in proto_files()),
        ]
        status = protoc.main(args)
        if status != 0:
            raise SystemExit(f"protoc failed with status {status}; see the messages above")
        generated_dir = Path(tmp) / PROTO_PACKAGE_DIR
        out = {
            path.name: rewrite_imports(path.read_text(encoding="utf-8"))
            for path in sorted(generated_dir.iterdir())
            if path.suffix in GENERATED_SUFFIXES
        }
    out["__init__.py"] = INIT_TEXT
    return out


def current_files(directory: Path) -> dict[str, str]:
    if not directory.is_dir():
        return {}
    return {
        path.name: path.read_text(encoding="utf-8")
        for path in sorted(directory.iterdir())
        if path.is_file() and path.suffix in GENERATED_SUFFIXES
    }


def stale_report(expected: dict[str, str], actual: dict[str, str]) -> list[str]:
    """Human-readable differences between fresh stubs and the committed ones."""
    lines: list[str] = []
    committed_versions = {m for text in actual.values() for m in _TOOLS_VERSION.findall(text)}
    installed = importlib.metadata.version("grpcio-tools")
    if committed_versions and committed_versions != {installed}:
        lines.append(
            f"the committed stubs come from grpcio-tools {', '.join(sorted(committed_versions))} "
            f"but {installed} is installed: install the version pinned in pyproject.toml, "
            "or regenerate and update the pin together"
        )
    for name in sorted(set(expected) | set(actual)):
        if name not in actual:
            lines.append(f"missing: mesh/proto/v1/{name}")
        elif name not in expected:
            lines.append(f"unexpected: mesh/proto/v1/{name} (no .proto produces it)")
        elif expected[name] != actual[name]:
            diff = difflib.unified_diff(
                actual[name].splitlines(),
                expected[name].splitlines(),
                fromfile=f"committed/{name}",
                tofile=f"generated/{name}",
                lineterm="",
                n=1,
            )
            lines.append(f"differs: mesh/proto/v1/{name}")
            lines.extend(list(diff)[:40])
    return lines


def write(files: dict[str, str], directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for stale in set(current_files(directory)) - set(files):
        (directory / stale).unlink()
    for name, text in files.items():
        target = directory / name
        if not target.exists() or target.read_text(encoding="utf-8") != text:
            target.write_text(text, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check",
        action="store_true",
        help="regenerate into a temporary directory and exit 1 if mesh/proto/v1 differs",
    )
    args = parser.parse_args(argv)
    files = generate()
    if args.check:
        problems = stale_report(files, current_files(OUT_DIR))
        if problems:
            sys.stderr.write(
                "mesh/proto/v1 is stale; run `python scripts/gen_proto.py`:\n"
                + "\n".join(problems)
                + "\n"
            )
            return 1
        sys.stdout.write(f"mesh/proto/v1 is up to date ({len(files)} files)\n")
        return 0
    write(files, OUT_DIR)
    sys.stdout.write(f"wrote {len(files)} files to {OUT_DIR.relative_to(REPO_ROOT)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
