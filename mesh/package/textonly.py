"""Multimodal checkpoints served by their language model alone.

Gemma 3 from 4B up is published as ``Gemma3ForConditionalGeneration``: a vision
tower and a projector beside a language model that is exactly a Gemma 3 text model
(``Gemma3ForCausalLM``), its config nested as ``text_config`` and its tensors under
``language_model.`` (``model.language_model.`` in checkpoints saved by newer
transformers). ``TextOnlyLayout`` presents such a checkpoint as that text model:
the text config at the top, the language model's tensors under a causal LM's names,
the vision tensors left out. The package serves text; the manifest's ``source``
keeps the original architecture. Images are not served.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from mesh.errors import UnsupportedArchitecture
from mesh.package.fused import RowPart, RowParts
from mesh.package.sources import Checkpoint

# Multimodal architecture -> (the text model's architecture, its model_type).
TEXT_MODELS = {"Gemma3ForConditionalGeneration": ("Gemma3ForCausalLM", "gemma3_text")}
# Name prefixes of the language model's tensors, and what a causal LM calls them.
_TEXT_PREFIXES = (
    ("language_model.model.", "model."),
    ("model.language_model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("lm_head.", "lm_head."),
)
# Tensors of the vision side, not packaged.
_VISION_PREFIXES = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
)
# Top-level keys the text model keeps where its own config does not set them.
_SHARED_KEYS = (
    "torch_dtype",
    "dtype",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "transformers_version",
)


def text_config(raw: dict[str, Any], architecture: str, model_type: str) -> dict[str, Any]:
    """The text model's config of a multimodal ``config.json``."""
    nested = raw.get("text_config")
    if not isinstance(nested, dict):
        raise UnsupportedArchitecture(
            f"a {raw.get('architectures', ['?'])[0]} config without a text_config: "
            "cannot tell its language model's shape"
        )
    config = dict(nested)
    for key in _SHARED_KEYS:
        if key in raw and key not in config:
            config[key] = raw[key]
    config["architectures"] = [architecture]
    config["model_type"] = model_type
    return config


def text_name(name: str) -> str | None:
    """A language-model tensor's causal-LM name, or None for any other tensor."""
    for prefix, replacement in _TEXT_PREFIXES:
        if name.startswith(prefix):
            return replacement + name[len(prefix) :]
    return None


class TextOnlyLayout(RowParts):
    """A multimodal checkpoint as its text model (see the module docstring)."""

    def __init__(self, inner: Checkpoint) -> None:
        super().__init__(inner)
        original = inner.description.architecture
        architecture, model_type = TEXT_MODELS[original]
        self.config_json = text_config(inner.config_json, architecture, model_type)
        self.description = replace(
            inner.description, architecture=architecture, model_type=model_type
        )
        self.source = {**inner.source, "architecture": original}
        self.default_model_id = inner.default_model_id
        for name in inner.tensor_names():
            if name.startswith(_VISION_PREFIXES):
                continue
            renamed = text_name(name)
            if renamed is None:
                # Not the language model's: the package layout names and refuses it.
                self._names.append(name)
                continue
            self._parts[renamed] = RowPart(name, 0, inner.shape(name)[0])
            self._names.append(renamed)
