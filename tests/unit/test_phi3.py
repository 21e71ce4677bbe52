"""Phi-3 checkpoints packaged as Llama (mesh/package/fused.py): fused projections split
by rows, from safetensors and from GGUF, float and quantised, LongRoPE and sliding
windows; the runtime's logits against transformers' own Phi-3."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from runtime_support import full_logits, load_chain, max_diff, run_chain
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Phi3Config

from mesh.package.builder import build_package
from mesh.package.gguf_file import GgufModel
from mesh.package.gguf_quant import GgufQuantReader
from mesh.package.manifest import PackageManifest, layer_path
from mesh.types import LayerRange

TOLERANCE = 1e-4
VOCAB = 1000
HEADS, KV_HEADS, HIDDEN, INTERMEDIATE, LAYERS = 4, 2, 64, 128, 4
HEAD_DIM = HIDDEN // HEADS
HALVES = (LayerRange(0, 2), LayerRange(2, 4))
# HF Phi-3 name -> GGUF name (llama.cpp's phi3 layout).
GGUF_NAMES = {
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def phi3_config(**overrides) -> Phi3Config:
    return Phi3Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        **overrides,
    )


def phi3_model(seed: int = 0, **overrides):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(phi3_config(**overrides)).eval()


def saved(model, directory: Path) -> Path:
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def tokens(count: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (count,), generator=torch.Generator().manual_seed(seed))


def assert_split_model_matches(model, package: Path, prefill: int, total: int) -> None:
    """A prompt of ``prefill`` tokens, one-token steps, then a verify window of 4, on
    two stages, against the unsplit Phi-3."""
    sequence = tokens(total, seed=3)
    want = full_logits(model, sequence)
    stages = load_chain(package, HALVES)
    got = run_chain(stages, "s", 0, sequence[:prefill])
    assert max_diff(got, want[:prefill]) <= TOLERANCE
    for pos in range(prefill, total - 4):
        got = run_chain(stages, "s", pos, sequence[pos : pos + 1])
        assert max_diff(got, want[pos : pos + 1]) <= TOLERANCE
    got = run_chain(stages, "s", total - 4, sequence[total - 4 :])
    assert max_diff(got, want[total - 4 :]) <= TOLERANCE


def test_a_phi3_package_is_llama_with_the_fused_rows_split(tmp_path: Path) -> None:
    model = phi3_model()
    package = build_package(str(saved(model, tmp_path / "src")), tmp_path / "pkg")
    assert package.architecture == "LlamaForCausalLM" and package.model_type == "llama"
    assert package.source["architecture"] == "Phi3ForCausalLM"
    config = json.loads((tmp_path / "pkg" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "resid_pdrop" not in config

    state = model.state_dict()
    layer = load_file(str(tmp_path / "pkg" / layer_path(1)))
    assert not any("qkv_proj" in name or "gate_up_proj" in name for name in layer)
    qkv = state["model.layers.1.self_attn.qkv_proj.weight"]
    q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM])
    gate, up = state["model.layers.1.mlp.gate_up_proj.weight"].split([INTERMEDIATE] * 2)
    for name, want in [("q", q), ("k", k), ("v", v)]:
        assert torch.equal(layer[f"self_attn.{name}_proj.weight"], want)
    assert torch.equal(layer["mlp.gate_proj.weight"], gate)
    assert torch.equal(layer["mlp.up_proj.weight"], up)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        # Phi-3-mini-4k's window on every layer: positions past it see only the window.
        {"sliding_window": 8},
        # LongRoPE past the original context (Phi-3-mini-128k, Phi-3.5-mini).
        {
            "original_max_position_embeddings": 16,
            "rope_scaling": {
                "type": "longrope",
                "long_factor": [1.0 + 0.3 * i for i in range(HEAD_DIM // 2)],
                "short_factor": [1.0 + 0.05 * i for i in range(HEAD_DIM // 2)],
            },
        },
    ],
    ids=["default", "sliding-window", "longrope"],
)
def test_split_phi3_matches_transformers(tmp_path: Path, overrides: dict) -> None:
    model = phi3_model(**overrides)
    build_package(str(saved(model, tmp_path / "src")), tmp_path / "pkg")
    assert_split_model_matches(model, tmp_path / "pkg", prefill=18, total=28)


def as_llama(model, directory: Path) -> Path:
    """The same weights saved as a Llama checkpoint, split by hand."""
    config = LlamaConfig(
        **{
            key: value
            for key, value in model.config.to_dict().items()
            if key not in ("architectures", "model_type", "resid_pdrop", "embd_pdrop")
        }
    )
    llama = LlamaForCausalLM(config)
    state = {}
    for name, tensor in model.state_dict().items():
        if name.endswith("qkv_proj.weight"):
            sizes = [HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM]
            for part, piece in zip("qkv", tensor.split(sizes), strict=True):
                state[name.replace("qkv_proj", f"{part}_proj")] = piece
        elif name.endswith("gate_up_proj.weight"):
            gate, up = tensor.split([INTERMEDIATE] * 2)
            state[name.replace("gate_up_proj", "gate_proj")] = gate
            state[name.replace("gate_up_proj", "up_proj")] = up
        else:
            state[name] = tensor
    llama.load_state_dict(state, strict=True)
    return saved(llama, directory)


def package_tensors(package: Path) -> dict[str, torch.Tensor]:
    manifest = PackageManifest.load(package)
    found = {}
    for entry in manifest.files:
        if entry.path.endswith(".safetensors"):
            for name, tensor in load_file(str(package / entry.path)).items():
                found[f"{entry.path}:{name}"] = tensor
    return found


@pytest.mark.parametrize("quant", ["int4", "int8"])
def test_a_quantised_phi3_package_equals_the_same_weights_saved_as_llama(
    tmp_path: Path, quant: str
) -> None:
    model = phi3_model(seed=1)
    phi3 = build_package(str(saved(model, tmp_path / "phi3")), tmp_path / "a", quant=quant)
    llama = build_package(str(as_llama(model, tmp_path / "llama")), tmp_path / "b", quant=quant)
    assert phi3.quantization == llama.quantization
    first, second = package_tensors(tmp_path / "a"), package_tensors(tmp_path / "b")
    assert first.keys() == second.keys()
    for name, tensor in first.items():
        assert torch.equal(tensor, second[name]), name


def rotary(partial: float = 1.0, longrope: bool = False) -> dict:
    """Config overrides: rotary on the first ``partial`` of each head (Phi-4-mini:
    3/4), LongRoPE past an original context of 16 (its factors cover only the
    rotated part). A fresh dict each time: transformers' configs write into it."""
    overrides: dict = {} if partial == 1.0 else {"partial_rotary_factor": partial}
    if longrope:
        pairs = int(HEAD_DIM * partial) // 2
        overrides["original_max_position_embeddings"] = 16
        overrides["rope_scaling"] = {
            "type": "longrope",
            "long_factor": [1.0 + 0.3 * i for i in range(pairs)],
            "short_factor": [1.0 + 0.05 * i for i in range(pairs)],
        }
    return overrides


@pytest.mark.parametrize("longrope", [False, True], ids=["default", "longrope"])
def test_partial_rotary_phi3_matches_transformers(tmp_path: Path, longrope: bool) -> None:
    model = phi3_model(**rotary(0.75, longrope))
    build_package(str(saved(model, tmp_path / "src")), tmp_path / "pkg")
    assert_split_model_matches(model, tmp_path / "pkg", prefill=18, total=28)


def write_phi3_gguf(model, path: Path, block_type: str | None = None) -> Path:
    """The model in llama.cpp's phi3 GGUF layout; linear weights as ``block_type``
    codes when given (else float32)."""
    import gguf
    from gguf.quants import quantize

    writer = gguf.GGUFWriter(str(path), "phi3")
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_block_count(LAYERS)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    rope = model.config.rope_parameters
    writer.add_rope_dimension_count(int(HEAD_DIM * rope.get("partial_rotary_factor", 1.0)))
    writer.add_layer_norm_rms_eps(model.config.rms_norm_eps)
    writer.add_rope_freq_base(10000.0)
    if rope.get("rope_type") == "longrope":
        # llama.cpp's Phi-3 converter: the factors as tensors, the original context
        # and the attention factor as metadata.
        original = rope["original_max_position_embeddings"]
        writer.add_rope_scaling_orig_ctx_len(original)
        scale = 512 / original
        writer.add_rope_scaling_attn_factors(float(np.sqrt(1 + np.log(scale) / np.log(original))))
        for kind in ("long", "short"):
            factors = np.asarray(rope[f"{kind}_factor"], dtype=np.float32)
            writer.add_tensor(f"rope_factors_{kind}.weight", factors)
    writer.add_vocab_size(VOCAB)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    state = {name: tensor.numpy() for name, tensor in model.state_dict().items()}

    def add(name: str, values: np.ndarray) -> None:
        if block_type is None or values.ndim == 1 or name == "token_embd.weight":
            writer.add_tensor(name, values)
            return
        kind = gguf.GGMLQuantizationType[block_type]
        writer.add_tensor(name, quantize(values, kind), raw_dtype=kind)

    add("token_embd.weight", state["model.embed_tokens.weight"])
    add("output_norm.weight", state["model.norm.weight"])
    add("output.weight", state["lm_head.weight"])
    for index in range(LAYERS):
        for hf, short in GGUF_NAMES.items():
            add(f"blk.{index}.{short}.weight", state[f"model.layers.{index}.{hf}.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_phi3_gguf_is_packaged_as_llama_and_matches_transformers(tmp_path: Path) -> None:
    model = phi3_model(seed=2)
    gguf = write_phi3_gguf(model, tmp_path / "phi3.gguf")
    package = build_package(str(gguf), tmp_path / "pkg")
    assert package.architecture == "LlamaForCausalLM"
    assert package.source["architecture"] == "Phi3ForCausalLM"
    assert_split_model_matches(model, tmp_path / "pkg", prefill=12, total=20)


@pytest.mark.parametrize(
    ("partial", "longrope"),
    [(0.75, False), (0.75, True), (1.0, True)],
    ids=["partial", "partial-longrope", "longrope"],
)
def test_a_phi3_gguf_keeps_its_rotary_settings(
    tmp_path: Path, partial: float, longrope: bool
) -> None:
    """The rotated width (``rope.dimension_count``) and LongRoPE (factors stored as
    tensors) of llama.cpp's Phi-3 files, which transformers' GGUF reader drops."""
    model = phi3_model(seed=4, **rotary(partial, longrope))
    gguf = write_phi3_gguf(model, tmp_path / "phi3.gguf")
    build_package(str(gguf), tmp_path / "pkg")
    # Past the original context of 16 from the prompt on: the long factors in use.
    assert_split_model_matches(model, tmp_path / "pkg", prefill=18, total=28)


def test_a_quantised_phi3_gguf_keeps_its_own_codes_split_by_rows(tmp_path: Path) -> None:
    model = phi3_model(seed=3)
    gguf = write_phi3_gguf(model, tmp_path / "phi3.gguf", block_type="Q4_0")
    build_package(str(gguf), tmp_path / "pkg", quant="int4")
    reader = GgufQuantReader(GgufModel(gguf), HEADS, KV_HEADS)
    layer = load_file(str(tmp_path / "pkg" / layer_path(2)))
    q_rows, kv_rows = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    pieces = [
        ("self_attn.q_proj", "self_attn.qkv_proj", 0, q_rows),
        ("self_attn.k_proj", "self_attn.qkv_proj", q_rows, kv_rows),
        ("self_attn.v_proj", "self_attn.qkv_proj", q_rows + kv_rows, kv_rows),
        ("mlp.gate_proj", "mlp.gate_up_proj", 0, INTERMEDIATE),
        ("mlp.up_proj", "mlp.gate_up_proj", INTERMEDIATE, INTERMEDIATE),
    ]
    for name, source, first, count in pieces:
        want = reader.parts(f"model.layers.2.{source}.weight", "int4", first, count)
        assert want, name
        for key, value in want.items():
            assert torch.equal(layer[f"{name}.weight.{key}"], value), (name, key)
