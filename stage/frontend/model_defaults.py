"""The model's own sampling defaults, for requests that leave them unset.

Model makers publish the sampling they recommend in ``generation_config.json``
(Qwen3: temperature 0.6, top_p 0.95, top_k 20; Llama 3.1: temperature 0.6, top_p
0.9), which the package keeps. With ``[frontend] sampling_defaults = "model"`` (the
default, as vLLM serves) a request that does not set ``temperature``, ``top_p``,
``top_k``, ``min_p`` or ``repetition_penalty`` gets the model's value; with
``"openai"``, OpenAI's (temperature 1, top_p 1, no top-k, min-p or repetition
penalty). A value outside what a request could set is ignored, named in the log.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mesh.package.end_tokens import GENERATION_CONFIG, read_generation_config

logger = logging.getLogger(__name__)

SAMPLING_DEFAULTS = ("model", "openai")


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request that leaves a parameter unset samples with (OpenAI's by default)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    @classmethod
    def of_package(cls, package_dir: Path | str) -> SamplingDefaults:
        """The defaults ``generation_config.json`` of a package recommends; OpenAI's
        for what it does not set (or when it is missing or unreadable)."""
        raw = read_generation_config(package_dir)
        found: dict[str, Any] = {}
        for name, low, high, integer in _RANGES:
            value = raw.get(name)
            if value is None:
                continue
            if _fits(value, low, high, integer):
                found[name] = int(value) if integer else float(value)
            else:
                logger.warning(
                    "%s of %s: %s %r is not a value a request could set; ignored",
                    GENERATION_CONFIG,
                    package_dir,
                    name,
                    value,
                )
        return cls(**found)


# (name, least, most, integer): the ranges a request may set.
_RANGES = (
    ("temperature", 0.0, 2.0, False),
    ("top_p", 1e-9, 1.0, False),
    ("top_k", 0, 1 << 31, True),
    ("min_p", 0.0, 1.0, False),
    ("repetition_penalty", 1e-9, 10.0, False),
)


def _fits(value: Any, low: float, high: float, integer: bool) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if integer and not float(value).is_integer():
        return False
    return math.isfinite(value) and low <= value <= high
