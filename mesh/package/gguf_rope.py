"""Rotary settings of llama.cpp's GGUF files that transformers' config reader drops.

Read from a GGUF, transformers' configs rotate whole heads by plain rotary
embeddings, whatever the file says. A model converted with a scaled or partial
rotary would load and answer wrongly without an error: Llama 3.1-3.3, Phi-3-mini-128k,
Phi-3.5-mini, Phi-4-mini, and any model converted with linear or YaRN scaling.
llama.cpp's converters store:

- the rotated width of each head as ``rope.dimension_count`` (Phi-4-mini: 96 of 128;
  ``partial_rotary_factor`` in transformers' terms; read here for Phi-3, whose
  config reader ignores the key);
- Llama 3's frequency scaling as one factor per frequency, the tensor
  ``rope_freqs.weight`` (each frequency divided by its factor), without the
  parameters it came from. They are found again here: the largest factor is the
  scale, the factors between 1 and it lie on Llama 3's smooth ramp, a line in the
  inverse wavelength whose slope and intercept give the low and high frequency
  factors for an original context (``LLAMA3_CONTEXT``, Llama 3's own, or half the
  model's context where that is shorter; only the ratios matter).
  The parameters found are checked by recomputing every factor with transformers'
  own Llama 3 rule; factors that no such parameters give are refused;
- LongRoPE's factors as ``rope_factors_long.weight`` and ``rope_factors_short.weight``,
  the original context as ``rope.scaling.original_context_length`` and the
  attention factor as ``rope.scaling.attn_factor``;
- linear and YaRN scaling as ``rope.scaling.type``, ``rope.scaling.factor`` and (YaRN)
  the original context and ``rope.scaling.yarn_beta_fast`` / ``_slow``; another
  scaling type is refused.

``rope_config`` puts them back into the config's ``rope_parameters`` as the
model's Hugging Face config holds them. Gemma 2/3 files have rules of their own
(``mesh/package/gguf_gemma.py``). The factor tensors are settings, not weights: the
package leaves them out (``ROPE_TENSORS``).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from mesh.errors import PackageError, UnsupportedArchitecture

LLAMA3_FREQS = "rope_freqs.weight"
LONGROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")
ROPE_TENSORS = (LLAMA3_FREQS, *LONGROPE_TENSORS)
# The original context the Llama 3 parameters are stated for (Llama 3.1-3.3's own).
LLAMA3_CONTEXT = 8192
# How closely recomputed Llama 3 factors must equal the file's.
_FACTOR_TOLERANCE = 1e-4
_OWN_RULES = ("gemma2", "gemma3")


def rope_config(architecture: str, model: Any, config: Any) -> Any:
    """``config`` (transformers' reading of a GGUF of ``architecture``) with the
    rotary settings of ``model`` (a ``GgufModel``) that the reader left out."""
    if architecture in _OWN_RULES:
        return config
    settings = model.settings
    rope = dict(getattr(config, "rope_parameters", None) or {})
    rope.setdefault("rope_type", "default")
    if "rope.freq_base" in settings:
        rope["rope_theta"] = float(settings["rope.freq_base"])
    rope.setdefault("rope_theta", 10000.0)
    head_dim = int(getattr(config, "head_dim", None) or 0) or (
        int(config.hidden_size) // int(config.num_attention_heads)
    )
    width = head_dim
    if architecture == "phi3":
        width = int(settings.get("rope.dimension_count", head_dim))
        if not 0 < width <= head_dim or width % 2:
            raise PackageError(
                f"GGUF rope.dimension_count {width} does not fit heads of {head_dim} dimensions"
            )
        if width < head_dim:
            rope["partial_rotary_factor"] = width / head_dim
    if any(name in model.tensors for name in LONGROPE_TENSORS):
        rope.update(_longrope(model, width))
        config.original_max_position_embeddings = rope["original_max_position_embeddings"]
    elif LLAMA3_FREQS in model.tensors:
        factors = _factors(model, LLAMA3_FREQS, width)
        if any(abs(f - 1.0) > _FACTOR_TOLERANCE for f in factors):
            rope.update(
                _llama3(
                    factors, float(rope["rope_theta"]), width, int(config.max_position_embeddings)
                )
            )
    else:
        rope.update(_scaling(settings))
    config.rope_parameters = rope
    return config


def _factors(model: Any, name: str, width: int) -> list[float]:
    values = [float(x) for x in model.float_rows(name, 0, 1).reshape(-1)]
    if len(values) != width // 2:
        raise PackageError(
            f"GGUF {name} holds {len(values)} factors; a rotated width of {width} needs "
            f"{width // 2}"
        )
    return values


def _longrope(model: Any, width: int) -> dict[str, Any]:
    missing = [name for name in LONGROPE_TENSORS if name not in model.tensors]
    if missing:
        raise PackageError(f"GGUF holds LongRoPE factors without {missing[0]}")
    original = model.settings.get("rope.scaling.original_context_length")
    if original is None:
        raise PackageError(
            "GGUF holds LongRoPE factors but no rope.scaling.original_context_length"
        )
    found: dict[str, Any] = {
        "rope_type": "longrope",
        "long_factor": _factors(model, LONGROPE_TENSORS[0], width),
        "short_factor": _factors(model, LONGROPE_TENSORS[1], width),
        "original_max_position_embeddings": int(original),
    }
    if "rope.scaling.attn_factor" in model.settings:
        found["attention_factor"] = float(model.settings["rope.scaling.attn_factor"])
    return found


def _scaling(settings: dict[str, Any]) -> dict[str, Any]:
    kind = str(settings.get("rope.scaling.type", "none"))
    if kind == "none":
        return {}
    factor = float(settings.get("rope.scaling.factor", 1.0))
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor} if factor != 1.0 else {}
    if kind == "yarn":
        original = settings.get("rope.scaling.original_context_length")
        if original is None:
            raise PackageError(
                "GGUF asks for YaRN scaling but holds no rope.scaling.original_context_length"
            )
        found: dict[str, Any] = {
            "rope_type": "yarn",
            "factor": factor,
            "original_max_position_embeddings": int(original),
        }
        for key in ("beta_fast", "beta_slow"):
            if f"rope.scaling.yarn_{key}" in settings:
                found[key] = float(settings[f"rope.scaling.yarn_{key}"])
        return found
    raise UnsupportedArchitecture(
        f"GGUF rotary scaling {kind!r} is not supported (linear, YaRN, Llama 3's and "
        "LongRoPE are); build the package from the Hugging Face checkpoint"
    )


def llama3_factors(parameters: dict[str, Any], base: float, width: int) -> list[float]:
    """The per-frequency divisors llama.cpp stores for Llama 3 ``parameters``
    (transformers' rule: plain frequencies over the scaled ones)."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(
        hidden_size=width,
        max_position_embeddings=int(parameters["original_max_position_embeddings"]) * 2,
        num_attention_heads=1,
        rope_parameters={"rope_type": "llama3", "rope_theta": base, **parameters},
    )
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config)
    plain = 1.0 / (base ** (torch.arange(0, width, 2, dtype=torch.float) / width))
    return (plain / scaled).tolist()


def _llama3(factors: list[float], base: float, width: int, max_positions: int) -> dict[str, Any]:
    """Llama 3 parameters that give ``factors`` (see the module docstring)."""
    scale = max(factors)
    tol = _FACTOR_TOLERANCE
    if all(f >= scale - tol for f in factors):
        return {"rope_type": "linear", "factor": scale}
    inv_freq = 1.0 / (base ** (torch.arange(0, width, 2, dtype=torch.float) / width))
    # x: inverse wavelength; on the ramp, smooth(x) = (context * x - low) / (high - low).
    xs = (inv_freq / (2 * math.pi)).tolist()
    ramp = [
        (x, (1 / f - 1 / scale) / (1 - 1 / scale))
        for x, f in zip(xs, factors, strict=True)
        if 1 + tol < f < scale - tol
    ]
    unscaled = [x for x, f in zip(xs, factors, strict=True) if f <= 1 + tol]
    full = [x for x, f in zip(xs, factors, strict=True) if f >= scale - tol]
    context = float(min(LLAMA3_CONTEXT, max(1, max_positions // 2)))
    ends: list[tuple[float, float]] = []  # candidate (start, end) of the ramp, in x
    if len(ramp) >= 2:
        (x0, y0), (x1, y1) = ramp[0], ramp[-1]
        slope = (y1 - y0) / (x1 - x0)
        ends.append((x0 - y0 / slope, x0 - y0 / slope + 1 / slope))
    elif ramp:
        # One point on the ramp (x, y): its end midway above it and its start where
        # the line through both reaches 0, or its start midway below and its end
        # where the line reaches 1; the first the other factors agree with.
        (x, y) = ramp[0]
        if unscaled:
            end = (x + min(unscaled)) / 2
            ends.append(((x - y * end) / (1 - y), end))
        start = (x + max(full)) / 2 if full else x / 2
        ends.append((start, start + (x - start) / y))
    elif unscaled and full:
        # No point on the ramp: it lies anywhere between the two kinds.
        gap = min(unscaled) - max(full)
        ends.append((max(full) + gap / 3, max(full) + 2 * gap / 3))
    for start, end in ends:
        # Rounded first: the parameters the model was made with are round numbers.
        for digits in (6, None):
            parameters = {
                "factor": scale,
                "low_freq_factor": _round(context * start, digits),
                "high_freq_factor": _round(context * end, digits),
                "original_max_position_embeddings": int(context),
            }
            if 0 < start < end and _close(llama3_factors(parameters, base, width), factors):
                return {"rope_type": "llama3", **parameters}
    raise UnsupportedArchitecture(
        f"GGUF {LLAMA3_FREQS} holds rotary frequency factors (largest {scale:g}) that "
        "Llama 3's scaling rule does not give; build the package from the Hugging Face "
        "checkpoint"
    )


def _round(value: float, digits: int | None) -> float:
    """``value`` to ``digits`` significant digits (None: as it is)."""
    return value if digits is None or value == 0 else float(f"{value:.{digits}g}")


def _close(got: list[float], want: list[float]) -> bool:
    return all(
        abs(a - b) <= _FACTOR_TOLERANCE * max(1.0, abs(b)) for a, b in zip(got, want, strict=True)
    )
