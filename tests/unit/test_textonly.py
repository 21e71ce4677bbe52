"""Multimodal checkpoints packaged as their language model (mesh/package/textonly.py):
Mistral Small 3.x's and Llava's, whose split text model gives the multimodal model's
logits on text; a language model the runtime does not split is refused, named.
(Gemma 3's multimodal checkpoints: tests/unit/test_gemma.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from runtime_support import TINY_VISION, load_chain, max_diff, run_chain
from safetensors.torch import load_file

from mesh.errors import UnsupportedArchitecture
from mesh.package.builder import build_package
from mesh.package.textonly import text_config
from mesh.types import LayerRange

TOLERANCE = 1e-4
VOCAB = 512
TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
)


def mistral3():
    from transformers import (
        Mistral3Config,
        Mistral3ForConditionalGeneration,
        MistralConfig,
        PixtralVisionConfig,
    )

    vision = PixtralVisionConfig(**TINY_VISION, head_dim=16)
    config = Mistral3Config(
        text_config=MistralConfig(**TEXT, sliding_window=None).to_dict(),
        vision_config=vision.to_dict(),
        image_token_index=VOCAB - 1,
    )
    return Mistral3ForConditionalGeneration(config)


def llava():
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    vision = CLIPVisionConfig(**TINY_VISION)
    config = LlavaConfig(
        text_config=LlamaConfig(**TEXT).to_dict(),
        vision_config=vision.to_dict(),
        image_token_index=VOCAB - 1,
    )
    return LlavaForConditionalGeneration(config)


# Qwen-VL vision towers: one block, patches of 14 merged 2 x 2 into the text width.
QWEN_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
# M-RoPE: the 8 frequency pairs of a 16-dimensional head in bands of 2, 3 and 3.
MROPE = [2, 3, 3]


def qwen2_vl():
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    text = {**TEXT, "rope_scaling": {"type": "mrope", "mrope_section": MROPE}}
    vision = dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2)
    config = Qwen2VLConfig(text_config=text, vision_config=vision)
    return Qwen2VLForConditionalGeneration(config)


def qwen2_5_vl():
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    text = {**TEXT, "rope_scaling": {"type": "mrope", "mrope_section": MROPE}}
    vision = {**QWEN_VISION, "fullatt_block_indexes": [0]}
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision)
    return Qwen2_5_VLForConditionalGeneration(config)


def qwen3_vl():
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    rope = {"rope_type": "default", "mrope_section": MROPE, "mrope_interleaved": True}
    vision = {**QWEN_VISION, "deepstack_visual_indexes": [0]}
    config = Qwen3VLConfig(text_config={**TEXT, "rope_scaling": rope}, vision_config=vision)
    return Qwen3VLForConditionalGeneration(config)


@pytest.mark.parametrize(
    ("make", "architecture", "text_architecture"),
    [
        (mistral3, "Mistral3ForConditionalGeneration", "MistralForCausalLM"),
        (llava, "LlavaForConditionalGeneration", "LlamaForCausalLM"),
        (qwen2_vl, "Qwen2VLForConditionalGeneration", "Qwen2ForCausalLM"),
        (qwen2_5_vl, "Qwen2_5_VLForConditionalGeneration", "Qwen2ForCausalLM"),
        (qwen3_vl, "Qwen3VLForConditionalGeneration", "Qwen3ForCausalLM"),
    ],
)
def test_a_multimodal_checkpoint_is_packaged_as_its_text_model(
    tmp_path: Path, make, architecture: str, text_architecture: str
) -> None:
    torch.manual_seed(4)
    model = make().eval()
    model.save_pretrained(tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == [
        architecture
    ]
    manifest = build_package(str(tmp_path / "hf"), tmp_path / "pkg")
    assert manifest.architecture == text_architecture
    assert manifest.source["architecture"] == architecture
    packaged: set[str] = set()
    for path in (tmp_path / "pkg").rglob("*.safetensors"):
        packaged |= set(load_file(str(path)))
    assert packaged and not any(
        part in n for n in packaged for part in ("vision", "projector", "visual")
    )

    ids = torch.randint(3, VOCAB - 8, (20,), generator=torch.Generator().manual_seed(6))
    with torch.inference_mode():
        want = model(input_ids=ids[None]).logits[0].float()
    stages = load_chain(tmp_path / "pkg", (LayerRange(0, 2), LayerRange(2, 4)))
    got = [run_chain(stages, "s", 0, ids[:12])]
    got += [run_chain(stages, "s", p, ids[p : p + 1]) for p in range(12, 20)]
    assert max_diff(torch.cat(got), want) <= TOLERANCE


def test_qwen3_vl_experts_stacked_in_one_tensor_are_refused_named() -> None:
    from transformers import Qwen3VLMoeConfig

    text = {**TEXT, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    raw = Qwen3VLMoeConfig(text_config=text, vision_config=QWEN_VISION).to_dict()
    raw["architectures"] = ["Qwen3VLMoeForConditionalGeneration"]
    with pytest.raises(UnsupportedArchitecture, match="stacks every expert"):
        text_config(raw)


def test_a_language_model_the_runtime_does_not_split_is_refused_named() -> None:
    from transformers import CLIPVisionConfig, GPT2Config, LlavaConfig

    raw = LlavaConfig(
        text_config=GPT2Config(n_layer=2, n_embd=32, n_head=2).to_dict(),
        vision_config=CLIPVisionConfig(
            hidden_size=32, num_attention_heads=2, num_hidden_layers=1
        ).to_dict(),
    ).to_dict()
    raw["architectures"] = ["LlavaForConditionalGeneration"]
    with pytest.raises(UnsupportedArchitecture, match="'gpt2' model"):
        text_config(raw)
    del raw["text_config"]
    with pytest.raises(UnsupportedArchitecture, match="without a text_config"):
        text_config(raw)
