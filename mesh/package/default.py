"""The default package: SmolLM2-135M-Instruct built once under ``$MESH_HOME``.

``build_default_package`` is cheap when the package is already there and current
(manifest readable, built from the installed wheel's GGUF, every file present with
its recorded size), so start-up code may call it every time. Concurrent callers
serialise on a lock file next to the package; the second one finds it built.
"""

from __future__ import annotations

import fcntl
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from mesh.errors import PackageError
from mesh.package.embedded import DEFAULT_MODEL_ID, default_gguf_path, default_source_info
from mesh.package.manifest import PackageManifest
from mesh.package.verify import verify_package

logger = logging.getLogger(__name__)

DEFAULT_DTYPE = "float32"


def mesh_home() -> Path:
    """``$MESH_HOME``, or ``~/.cache/mesh``."""
    value = os.environ.get("MESH_HOME")
    return Path(value).expanduser() if value else Path.home() / ".cache" / "mesh"


def default_package_dir(quant: str | None = None) -> Path:
    """Where the default package lives: ``$MESH_HOME/packages/SmolLM2-135M-Instruct``
    (with ``-int4`` / ``-int8`` appended for a quantised build)."""
    suffix = f"-{quant}" if quant else ""
    return mesh_home() / "packages" / f"{DEFAULT_MODEL_ID}{suffix}"


def build_default_package(
    out: Path | None = None, *, force: bool = False, quant: str | None = None
) -> Path:
    """Build the default package into ``out`` (default: default_package_dir()) unless a
    current, intact one is already there. ``quant`` (int4 / int8) builds it with
    quantised weights. Returns the package directory."""
    out = Path(out).expanduser().absolute() if out is not None else default_package_dir(quant)
    out.parent.mkdir(parents=True, exist_ok=True)
    with _lock(out):
        if not force:
            problem = _staleness(out, quant)
            if problem is None:
                logger.debug("default package at %s is current", out)
                return out
            logger.info("building the default package at %s (%s)", out, problem)
        from mesh.package.builder import build_package  # imports torch: only when building

        build_package("default", out, dtype=DEFAULT_DTYPE, model_id=DEFAULT_MODEL_ID, quant=quant)
    return out


def _staleness(out: Path, quant: str | None = None) -> str | None:
    """Why the package at ``out`` must be (re)built, or None if it is current."""
    if not out.is_dir():
        return "not built yet"
    try:
        manifest = PackageManifest.load(out)
    except PackageError as error:
        return str(error)
    expected = default_source_info(default_gguf_path())
    if manifest.source != expected:
        return f"built from {manifest.source}, the installed wheel is {expected}"
    if manifest.model_id != DEFAULT_MODEL_ID or manifest.dtype != DEFAULT_DTYPE:
        return f"holds {manifest.model_id} in {manifest.dtype}"
    held = None if manifest.quantization is None else manifest.quantization.get("linear")
    if held != quant:
        return f"holds {held or 'plain'} weights, {quant or 'plain'} wanted"
    problems = verify_package(out, quick=True)
    if problems:
        return "; ".join(problems[:3])
    return None


@contextmanager
def _lock(out: Path) -> Iterator[None]:
    lock_path = out.parent / f".{out.name}.lock"
    with open(lock_path, "a+b") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
