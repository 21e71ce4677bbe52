"""Gemma's variations of the decoder (mesh/runtime/block.py) and Gemma 3's multimodal
checkpoints packaged as their text model (mesh/package/textonly.py). The split
against transformers for every Gemma family runs with the other families in
test_runtime_equivalence.py, test_runtime_batch.py and test_row_invariance.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import tiny_config
from runtime_support import SPLITS, TINY_VISION, load_chain, max_diff, run_chain
from safetensors.torch import load_file, save_file
from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

from mesh.errors import UnsupportedArchitecture
from mesh.package.builder import build_package
from mesh.package.textonly import text_name
from mesh.runtime.block import rms_norm

TOLERANCE = 1e-4
VOCAB = 512


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_gemma_norm_scales_by_one_plus_its_weight_in_float32(dtype: torch.dtype) -> None:
    """The weight loaded as ``1 + weight`` in float32 gives transformers' Gemma norm
    bit for bit, in float32 and in bfloat16 (where scaling in bfloat16 would not)."""
    torch.manual_seed(0)
    norm = Gemma3RMSNorm(64, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_(0.0, 0.5)
    norm = norm.to(dtype)
    hidden = torch.randn(7, 64).to(dtype)
    want = norm(hidden)
    loaded = 1.0 + norm.weight.detach().float()
    assert torch.equal(rms_norm(hidden, loaded, 1e-6), want)
    if dtype == torch.bfloat16:
        rounded = rms_norm(hidden, loaded.to(dtype), 1e-6)
        assert not torch.equal(rounded, want)


def multimodal_gemma3(seed: int) -> Gemma3ForConditionalGeneration:
    """A tiny Gemma 3 with a vision tower, norms random (Gemma's start at zero)."""
    text = tiny_config("gemma3", layers=6, vocab_size=VOCAB).to_dict()
    vision = SiglipVisionConfig(**TINY_VISION)
    config = Gemma3Config(
        text_config=text,
        vision_config=vision.to_dict(),
        mm_tokens_per_image=4,
        image_token_index=VOCAB - 12,
        boi_token_index=VOCAB - 11,
        eoi_token_index=VOCAB - 10,
    )
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(0.0, 0.3)
    return model


def renamed_checkpoint(source: Path, out: Path, old: str, new: str) -> Path:
    """A copy of an HF directory whose tensor names start with ``new`` for ``old``."""
    out.mkdir()
    (out / "config.json").write_text((source / "config.json").read_text())
    tensors = load_file(str(source / "model.safetensors"))
    renamed = {new + k[len(old) :] if k.startswith(old) else k: v for k, v in tensors.items()}
    save_file(renamed, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("prefix", ["language_model.model.", "model.language_model."])
def test_a_multimodal_gemma3_is_packaged_as_its_text_model(tmp_path: Path, prefix: str) -> None:
    """Both ways transformers names the language model's tensors; the vision tower is
    left out, and the split text model gives the multimodal model's logits."""
    model = multimodal_gemma3(seed=3)
    model.save_pretrained(tmp_path / "saved")
    source = tmp_path / "saved"
    names = load_file(str(source / "model.safetensors")).keys()
    saved = "language_model.model."
    if f"{saved}norm.weight" not in names:
        saved = "model.language_model."
        assert f"{saved}norm.weight" in names
    if saved != prefix:
        source = renamed_checkpoint(source, tmp_path / "renamed", saved, prefix)

    manifest = build_package(str(source), tmp_path / "pkg")
    assert manifest.architecture == "Gemma3ForCausalLM"
    assert manifest.source["architecture"] == "Gemma3ForConditionalGeneration"
    config = json.loads((tmp_path / "pkg" / "config.json").read_text())
    assert config["model_type"] == "gemma3_text" and "vision_config" not in config
    packaged = set()
    for path in (tmp_path / "pkg").rglob("*.safetensors"):
        packaged |= set(load_file(str(path)))
    assert not any("vision" in name or "multi_modal" in name for name in packaged)

    ids = torch.randint(3, VOCAB - 20, (20,), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        want = model(input_ids=ids[None]).logits[0].float()
    for ranges in (SPLITS[1], SPLITS[3]):
        stages = load_chain(tmp_path / "pkg", ranges)
        got = [run_chain(stages, "s", 0, ids[:12])]
        got += [run_chain(stages, "s", p, ids[p : p + 1]) for p in range(12, 20)]
        assert max_diff(torch.cat(got), want) <= TOLERANCE


def test_text_names_of_a_multimodal_checkpoint() -> None:
    assert text_name("language_model.model.layers.3.mlp.up_proj.weight") == (
        "model.layers.3.mlp.up_proj.weight"
    )
    assert text_name("model.language_model.norm.weight") == "model.norm.weight"
    assert text_name("language_model.lm_head.weight") == "lm_head.weight"
    assert text_name("vision_tower.vision_model.post_layernorm.weight") is None


@pytest.mark.parametrize("architecture", ["gemma"])
def test_a_first_gemma_gguf_is_refused_naming_what_to_build_from(
    tmp_path: Path, architecture: str
) -> None:
    import gguf
    import numpy as np

    path = tmp_path / f"{architecture}.gguf"
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    writer.add_embedding_length(8)
    writer.add_tensor("token_embd.weight", np.zeros((16, 8), dtype=np.float32))
    writer.add_tensor("output_norm.weight", np.ones(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedArchitecture, match="Hugging Face checkpoint"):
        build_package(str(path), tmp_path / "pkg")
    assert not (tmp_path / "pkg" / "model-package.json").exists()


# HF layer tensor -> llama.cpp's GGUF name for Gemma 2 and 3.
GGUF_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}


def gemma_for_gguf(family: str, seed: int):
    """A tiny Gemma 2 or 3 as llama.cpp runs a model of its size: queries scaled by
    1 / sqrt(head_dim); norms random."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(family, layers=6, vocab_size=VOCAB)
    config.query_pre_attn_scalar = config.head_dim
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(0.0, 0.3)
    return model


def write_gemma_gguf(model, path: Path, architecture: str) -> Path:
    """The model in llama.cpp's layout: norms stored plus one, float32 tensors, the
    metadata llama.cpp's converter writes (caps for Gemma 2, the global layers'
    rotary scaling for Gemma 3)."""
    import gguf

    config = model.config
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(VOCAB)
    writer.add_sliding_window(config.sliding_window)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    if architecture == "gemma2":
        writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    else:
        full = config.rope_parameters["full_attention"]
        writer.add_rope_freq_base(full["rope_theta"])
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(full["factor"])
    state = {name: tensor.float().numpy() for name, tensor in model.state_dict().items()}

    def add(name: str, values) -> None:
        writer.add_tensor(name, values + 1.0 if name.endswith("norm.weight") else values)

    add("token_embd.weight", state["model.embed_tokens.weight"])
    add("output_norm.weight", state["model.norm.weight"])
    for index in range(config.num_hidden_layers):
        for hf, short in GGUF_LAYER_NAMES.items():
            name = f"model.layers.{index}.{hf}.weight"
            if name in state:
                add(f"blk.{index}.{short}.weight", state[name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(("family", "architecture"), [("gemma2", "gemma2"), ("gemma3", "gemma3")])
def test_a_gemma_gguf_is_packaged_and_matches_transformers(
    tmp_path: Path, family: str, architecture: str
) -> None:
    """Norms back from plus one, the norms around attention and MLP named, the query
    scaling, caps and rotary tables llama.cpp's files imply: the split package gives
    transformers' logits."""
    model = gemma_for_gguf(family, seed=7)
    path = write_gemma_gguf(model, tmp_path / f"{family}.gguf", architecture)
    manifest = build_package(str(path), tmp_path / "pkg")
    assert manifest.architecture == type(model).__name__
    ids = torch.randint(3, VOCAB, (20,), generator=torch.Generator().manual_seed(8))
    with torch.inference_mode():
        want = model(ids[None], use_cache=False).logits[0].float()
    stages = load_chain(tmp_path / "pkg", SPLITS[2])
    got = [run_chain(stages, "s", 0, ids[:12])]
    got += [run_chain(stages, "s", p, ids[p : p + 1]) for p in range(12, 20)]
    assert max_diff(torch.cat(got), want) <= TOLERANCE


def test_the_settings_a_gemma_gguf_implies() -> None:
    """llama.cpp's rules: the 27B models (by layer count) scale queries by hidden /
    heads; a sliding-window pattern read as llama.cpp reads it; Gemma 3's local
    layers at the file's own base where it has one."""
    from transformers import Gemma2Config, Gemma3TextConfig

    from mesh.package.gguf_gemma import gemma_config

    wide = Gemma3TextConfig(
        hidden_size=5376, num_attention_heads=32, head_dim=128, num_hidden_layers=62
    )
    settings = {"rope.freq_base": 1e6, "rope.scaling.type": "linear", "rope.scaling.factor": 8.0}
    wide = gemma_config("gemma3", settings, wide)
    assert wide.query_pre_attn_scalar == 168
    assert wide.rope_parameters["full_attention"] == {
        "rope_type": "linear",
        "factor": 8.0,
        "rope_theta": 1e6,
    }
    assert wide.rope_parameters["sliding_attention"]["rope_theta"] == 10000.0
    small = Gemma3TextConfig(hidden_size=1152, num_attention_heads=4, head_dim=256)
    small = gemma_config("gemma3", {"rope.freq_base_swa": 5000.0}, small)
    assert small.query_pre_attn_scalar == 256
    assert small.rope_parameters["full_attention"]["rope_type"] == "default"
    assert small.rope_parameters["sliding_attention"]["rope_theta"] == 5000.0
    big2 = Gemma2Config(
        hidden_size=4608, num_attention_heads=32, head_dim=128, num_hidden_layers=46
    )
    assert gemma_config("gemma2", {}, big2).query_pre_attn_scalar == 144
    layers = dict(hidden_size=64, num_attention_heads=4, head_dim=16, num_hidden_layers=6)
    every_third = gemma_config(
        "gemma2", {"attention.sliding_window_pattern": 3.0}, Gemma2Config(**layers)
    )
    assert (
        every_third.layer_types == ["sliding_attention", "sliding_attention", "full_attention"] * 2
    )
    flags = [1.0, 0.0, 0.0, 1.0, 1.0, 0.0]
    flagged = gemma_config(
        "gemma2", {"attention.sliding_window_pattern": flags}, Gemma2Config(**layers)
    )
    assert [t == "sliding_attention" for t in flagged.layer_types] == [bool(f) for f in flags]
    none = gemma_config("gemma2", {"attention.sliding_window_pattern": 1.0}, Gemma2Config(**layers))
    assert set(none.layer_types) == {"full_attention"}
    with pytest.raises(UnsupportedArchitecture, match="yarn"):
        gemma_config("gemma3", {"rope.scaling.type": "yarn"}, Gemma3TextConfig(**layers))
