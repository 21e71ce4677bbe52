"""Multimodal checkpoints served by their language model alone.

Several of the models users split are published with a vision tower and a projector
beside a language model that is exactly one of the supported text models: Gemma 3
from 4B up (``Gemma3ForConditionalGeneration``, a Gemma 3 text model), Mistral Small
3.1 and 3.2 (``Mistral3ForConditionalGeneration``, a Mistral model) and the Llava
family (``LlavaForConditionalGeneration``, a Llama, Mistral or Qwen2 model), and
Qwen2-VL, Qwen2.5-VL and Qwen3-VL (dense), whose language models are Qwen2 and Qwen3
models rotating by multimodal rotary embeddings (M-RoPE): each frequency band turns
by one of three position ids (time, height, width), and for text all three are the
token's position, so on text M-RoPE is plain rotary with the same base, and the
text config becomes a Qwen2 / Qwen3 config (``_TEXT_AS``). Their config nests the
language model's as ``text_config`` and their tensors sit under ``language_model.``
(``model.language_model.`` in checkpoints saved by newer transformers) or, in
Qwen2-VL and Qwen2.5-VL checkpoints, under a causal LM's own names beside
``visual.``. Qwen3-VL's mixture-of-experts models stack every expert of a layer in
one tensor and are refused, named.

``TextOnlyLayout`` presents such a checkpoint as that text model: the text config
(defaults filled in by transformers) at the top, the language model's tensors under
a causal LM's names, the vision tensors left out. The package serves text; the
manifest's ``source`` keeps the original architecture. Images are not served.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from mesh.errors import PackageError, UnsupportedArchitecture
from mesh.package.fused import RowPart, RowParts
from mesh.package.manifest import SUPPORTED_ARCHITECTURES
from mesh.package.sources import Checkpoint

# Multimodal architectures packaged as their language model.
TEXT_MODELS = (
    "Gemma3ForConditionalGeneration",
    "Mistral3ForConditionalGeneration",
    "LlavaForConditionalGeneration",
    "Qwen2VLForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration",
    "Qwen3VLForConditionalGeneration",
    "Qwen3VLMoeForConditionalGeneration",
)
# Text model types without a causal LM of their own -> the causal LM's model type
# (see the module docstring).
_TEXT_AS = {"qwen2_vl_text": "qwen2", "qwen2_5_vl_text": "qwen2", "qwen3_vl_text": "qwen3"}
# Keys of M-RoPE's rope parameters that plain rotary has no use for.
_MROPE_KEYS = ("mrope_section", "mrope_interleaved", "type")
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
    "visual.",
    "model.visual.",
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


def text_config(raw: dict[str, Any]) -> dict[str, Any]:
    """The text model's config of a multimodal ``config.json``, with its causal LM's
    architecture; refused where that is not a supported one."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    described = (raw.get("architectures") or ["this multimodal model"])[0]
    if not isinstance(raw.get("text_config"), dict):
        raise UnsupportedArchitecture(
            f"a {described} config without a text_config: cannot tell its language model's shape"
        )
    try:
        full = CONFIG_MAPPING[raw["model_type"]](**raw)
    except (KeyError, ValueError, TypeError) as error:
        raise PackageError(f"cannot read the {described} config: {error}") from error
    text = full.get_text_config()
    if text.model_type == "qwen3_vl_moe_text":
        raise UnsupportedArchitecture(
            f"the language model of this {described} stacks every expert of a layer in one "
            "tensor, which mesh-package does not read; its dense Qwen3-VL models are read"
        )
    if text.model_type in _TEXT_AS:
        text = _as_causal(text)
    architecture = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(str(text.model_type))
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitecture(
            f"the language model of this {described} is a {text.model_type!r} model, "
            "which the runtime does not split; supported: " + ", ".join(SUPPORTED_ARCHITECTURES)
        )
    config = {key: value for key, value in text.to_dict().items() if not key.startswith("_")}
    for key in _SHARED_KEYS:
        if key in raw and config.get(key) is None:
            config[key] = raw[key]
    if "tie_word_embeddings" in raw:
        # The multimodal model's own flag decides, as transformers ties its weights
        # by it (Mistral 3 leaves the text config's at false and ties).
        config["tie_word_embeddings"] = bool(raw["tie_word_embeddings"])
    config["architectures"] = [architecture]
    return config


def _as_causal(text: Any) -> Any:
    """A Qwen-VL text config as the Qwen2 / Qwen3 config it is on text: the same
    fields, rotary without its multimodal sections."""
    from transformers import CONFIG_MAPPING

    fields = {key: value for key, value in text.to_dict().items() if not key.startswith("_")}
    rope = dict(fields.get("rope_parameters") or {})
    if rope.get("rope_type") == "mrope" or rope.get("type") == "mrope":
        rope["rope_type"] = "default"
    for key in _MROPE_KEYS:
        rope.pop(key, None)
    fields["rope_parameters"] = rope
    target = _TEXT_AS[text.model_type]
    fields["model_type"] = target
    return CONFIG_MAPPING[target](**fields)


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
        self.config_json = text_config(inner.config_json)
        self.description = replace(
            inner.description,
            architecture=self.config_json["architectures"][0],
            model_type=self.config_json["model_type"],
            tied_embeddings=bool(self.config_json.get("tie_word_embeddings", False)),
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
