"""Import boundaries: the shared library never reaches into the roles, and compute
code never imports the network stack.

A static scan of every Python file in the repository (relative imports resolved,
``importlib.import_module("...")`` with a literal included), plus a fresh
interpreter that imports every compute module and checks what got loaded.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SKIP_DIRS = {"__pycache__", "build", "dist", "node_modules", "venv"}
NETWORK = ("grpc", "fastapi", "uvicorn", "starlette")
ROLES = ("stage", "coordinator")
COMPUTE_PACKAGES = ("mesh.runtime", "mesh.speculative")


def python_files(root: Path) -> list[Path]:
    found: list[Path] = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if any(p.startswith(".") or p in SKIP_DIRS or p.endswith(".egg-info") for p in parts):
            continue
        found.append(path)
    return found


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path, root: Path) -> set[str]:
    """Absolute names of every module ``path`` imports, at any depth of its code."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = package.split(".")[: max(0, len(package.split(".")) - node.level + 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names if alias.name != "*")
        elif isinstance(node, ast.Call) and _is_dynamic_import(node):
            argument = node.args[0]
            if isinstance(argument, ast.Constant) and isinstance(argument.value, str):
                found.add(argument.value)
    return {m for m in found if m}


def _is_dynamic_import(call: ast.Call) -> bool:
    func = call.func
    named = (isinstance(func, ast.Name) and func.id in ("__import__", "import_module")) or (
        isinstance(func, ast.Attribute) and func.attr == "import_module"
    )
    return named and bool(call.args)


def violations(root: Path, under: str, forbidden: tuple[str, ...]) -> list[str]:
    """``file: module`` for each import of a forbidden top-level package under ``under``."""
    base = root / under
    targets = [base] if base.is_file() else python_files(base) if base.is_dir() else []
    found = []
    for path in targets:
        for module in sorted(imported_modules(path, root)):
            if module.split(".")[0] in forbidden:
                found.append(f"{path.relative_to(root)}: imports {module}")
    return found


def run_fresh(script: str) -> None:
    """Run ``script`` in a fresh interpreter at the repository root; it must succeed."""
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]


def test_every_python_file_parses() -> None:
    files = python_files(ROOT)
    assert any(p.relative_to(ROOT).parts[0] == "mesh" for p in files)
    for path in files:
        imported_modules(path, ROOT)


def test_mesh_never_imports_stage_or_coordinator() -> None:
    assert violations(ROOT, "mesh", ROLES) == []


@pytest.mark.parametrize("package", ["mesh/runtime", "mesh/speculative"])
def test_compute_packages_do_not_import_the_network(package: str) -> None:
    assert (ROOT / package / "__init__.py").is_file(), f"{package} is not a package"
    assert violations(ROOT, package, NETWORK) == []


def test_stage_engine_does_not_import_the_network() -> None:
    assert violations(ROOT, "stage/engine.py", NETWORK) == []
    assert violations(ROOT, "stage/engine", NETWORK) == []


def test_compute_modules_load_without_the_network_stack() -> None:
    script = textwrap.dedent(
        f"""
        import importlib, pkgutil, sys
        for name in {COMPUTE_PACKAGES!r}:
            package = importlib.import_module(name)
            for info in pkgutil.walk_packages(package.__path__, name + "."):
                importlib.import_module(info.name)
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in {NETWORK!r})
        assert not loaded, "compute modules pulled in: " + ", ".join(loaded)
        """
    )
    run_fresh(script)


def test_scanner_catches_violations(tmp_path: Path) -> None:
    """The checks above can fail: a planted violation of each kind is found."""
    runtime = tmp_path / "mesh" / "runtime"
    runtime.mkdir(parents=True)
    (tmp_path / "mesh" / "__init__.py").write_text("")
    (runtime / "__init__.py").write_text("from ...stage import engine\n")
    (runtime / "net.py").write_text(
        "import importlib\n"
        "def f():\n"
        "    from grpc import aio\n"
        "    return importlib.import_module('fastapi')\n"
    )
    (tmp_path / "mesh" / "ok.py").write_text("from . import runtime\nimport torch\n")
    assert violations(tmp_path, "mesh", ROLES) == [
        "mesh/runtime/__init__.py: imports stage",
        "mesh/runtime/__init__.py: imports stage.engine",
    ]
    assert violations(tmp_path, "mesh/runtime", NETWORK) == [
        "mesh/runtime/net.py: imports fastapi",
        "mesh/runtime/net.py: imports grpc",
        "mesh/runtime/net.py: imports grpc.aio",
    ]
    assert imported_modules(tmp_path / "mesh" / "ok.py", tmp_path) == {
        "mesh",
        "mesh.runtime",
        "torch",
    }


# The data plane's values and the code that decides over them never touch protobuf:
# only the codec (mesh/codec*.py), the servicers and the links do.
PROTO_FREE = (
    "mesh.frames",
    "stage.engine",
    "stage.frontend.engine_core",
    "stage.frontend.engine_prompts",
    "stage.frontend.engine_types",
)
WIRE = ("google", "grpc", "mesh.proto", "mesh.codec", "mesh.codec_data", "mesh.codec_tensor")


@pytest.mark.parametrize("module", PROTO_FREE)
def test_data_plane_values_and_engines_import_no_protobuf(module: str) -> None:
    path = ROOT / (module.replace(".", "/") + ".py")
    found = [
        m
        for m in sorted(imported_modules(path, ROOT))
        if any(m == w or m.startswith(w + ".") for w in WIRE)
    ]
    assert found == [], f"{module} imports {found}"


def test_data_plane_modules_load_without_protobuf() -> None:
    script = textwrap.dedent(
        f"""
        import importlib, sys
        for name in {PROTO_FREE!r}:
            importlib.import_module(name)
        wire = {WIRE!r}
        loaded = sorted(
            m for m in sys.modules if any(m == w or m.startswith(w + ".") for w in wire)
        )
        assert not loaded, "the data plane pulled in: " + ", ".join(loaded)
        """
    )
    run_fresh(script)
