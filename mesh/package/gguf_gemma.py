"""Gemma 2 and Gemma 3 from llama.cpp's GGUF files.

llama.cpp's converter writes Gemma's norms as ``1 + weight`` (the runtime adds the
one itself: the reader subtracts it), names the norm before the MLP ``ffn_norm``
and the two after attention and MLP ``post_attention_norm`` and ``post_ffw_norm``,
and leaves out of the metadata what transformers' config reader then gets wrong:

- the query scaling (``query_pre_attn_scalar``): llama.cpp scales queries by
  ``1 / sqrt(hidden / heads)`` in the 27B models (told by their layer count: 46
  for Gemma 2, 62 for Gemma 3) and by ``1 / sqrt(head_dim)`` in the others, which
  is what their Hugging Face configs say (144 and 168 for the 27B models, 256 for
  the others);
- Gemma 3's rotary tables: the file's ``rope.freq_base`` and ``rope.scaling`` are
  the global layers' (a linear factor of 8 from 4B up); the sliding-window layers
  rotate unscaled by ``rope.freq_base_swa`` where the file has it, else by 10,000;
- which layers use the sliding window, where the file says
  (``attention.sliding_window_pattern``: every n-th layer global, or a flag per
  layer); else the families' own patterns (Gemma 2 every other layer, Gemma 3 five
  of six), which transformers' configs default to;
- Gemma 2's caps on scores and logits, read here where the file holds them.
"""

from __future__ import annotations

from typing import Any

from mesh.errors import UnsupportedArchitecture

GEMMA_ARCHITECTURES = ("gemma2", "gemma3")
# What llama.cpp's converter adds to every norm weight of these files.
NORM_SHIFT = 1.0
# GGUF layer tensor names -> HF names, where they differ from Llama's meaning.
LAYER_PARTS = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Layer counts of the 27B models, whose queries llama.cpp scales by hidden / heads.
_WIDE_SCALE_LAYERS = {"gemma2": 46, "gemma3": 62}
_LOCAL_ROPE_BASE = 10000.0


def gemma_config(architecture: str, settings: dict[str, Any], config: Any) -> Any:
    """``config`` (transformers' reading of a GGUF of ``architecture``) with what the
    file's ``settings`` (``GgufModel.settings``) and llama.cpp's rules add; other
    architectures unchanged."""
    if architecture not in GEMMA_ARCHITECTURES:
        return config
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    if int(config.num_hidden_layers) == _WIDE_SCALE_LAYERS[architecture]:
        config.query_pre_attn_scalar = int(config.hidden_size) // heads
    else:
        config.query_pre_attn_scalar = head_dim
    pattern = settings.get("attention.sliding_window_pattern")
    if pattern is not None:
        config.layer_types = _layer_types(pattern, int(config.num_hidden_layers))
    if architecture == "gemma2":
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if key in settings:
                setattr(config, key, float(settings[key]))
        return config
    base = float(settings.get("rope.freq_base", 1_000_000.0))
    kind = str(settings.get("rope.scaling.type", "none"))
    factor = float(settings.get("rope.scaling.factor", 1.0))
    full: dict[str, Any] = {"rope_type": "default", "rope_theta": base}
    if kind == "linear" and factor != 1.0:
        full = {"rope_type": "linear", "factor": factor, "rope_theta": base}
    elif kind not in ("none", "linear"):
        raise UnsupportedArchitecture(
            f"this Gemma 3 GGUF scales its rotary angles by {kind!r}, which is not read; "
            "build the package from the Hugging Face checkpoint instead"
        )
    local_base = float(settings.get("rope.freq_base_swa", _LOCAL_ROPE_BASE))
    local = {"rope_type": "default", "rope_theta": local_base}
    config.rope_parameters = {"full_attention": full, "sliding_attention": local}
    return config


def _layer_types(pattern: Any, layers: int) -> list[str]:
    """Layer types from a GGUF sliding-window pattern: every ``n``-th layer global
    (a number, as llama.cpp reads it: 0 puts every layer in the window, 1 none), or a
    flag per layer, true where the layer uses the window."""
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise UnsupportedArchitecture(
                f"the GGUF's sliding-window pattern has {len(pattern)} entries for "
                f"{layers} layers: the file is inconsistent"
            )
        flags = [bool(flag) for flag in pattern]
    else:
        period = int(pattern)
        flags = [period == 0 or (index + 1) % period != 0 for index in range(layers)]
    return ["sliding_attention" if flag else "full_attention" for flag in flags]
