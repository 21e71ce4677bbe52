"""Rotary settings of llama.cpp's GGUF files that transformers' config reader drops
(mesh/package/gguf_rope.py): Llama 3's frequency factors (``rope_freqs.weight``),
linear and YaRN scaling in the metadata; the package's logits against the
transformers model the file was written from. Phi-3's rotated width and LongRoPE
are tested in test_phi3.py."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import tiny_config
from runtime_support import full_logits, load_chain, max_diff, run_chain
from transformers import AutoModelForCausalLM

from mesh.errors import UnsupportedArchitecture
from mesh.package.builder import build_package
from mesh.package.gguf_rope import _llama3, llama3_factors
from mesh.types import LayerRange

TOLERANCE = 1e-4
VOCAB = 1000
LAYERS = 4
HALVES = (LayerRange(0, 2), LayerRange(2, 4))
# Base 10,000 and 16-dimensional heads: wavelengths 6.3, 19.9, 62.8, 199, 628, ...
# With an original context of 1,024 and factors 1 and 8, the 199 and 628 ones lie on
# the ramp, the longer ones are divided by the full factor.
LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 8.0,
    "original_max_position_embeddings": 1024,
}
GGUF_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def llama_model(rope: dict, seed: int = 0):
    config = tiny_config("llama", layers=LAYERS, vocab_size=VOCAB)
    config.tie_word_embeddings = False
    config.max_position_embeddings = 4096
    config.rope_parameters = dict(rope)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()


def interleaved(weight: np.ndarray, heads: int) -> np.ndarray:
    """q/k rows in llama.cpp's order (each head's halves as interleaved pairs)."""
    shape = weight.shape
    return (
        weight.reshape(heads, 2, shape[0] // heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)
    )


def write_llama_gguf(model, path: Path, rope_freqs: list[float] | None = None, **metadata) -> Path:
    """The model as llama.cpp's converter writes a Llama: q/k rows interleaved, float32
    tensors, ``rope_freqs.weight`` where given, ``metadata`` as
    ``llama.rope.scaling.<key>``."""
    import gguf

    config = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(VOCAB)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for key, value in metadata.items():
        if isinstance(value, str):
            writer.add_string(f"llama.rope.scaling.{key}", value)
        elif isinstance(value, int):
            writer.add_uint32(f"llama.rope.scaling.{key}", value)
        else:
            writer.add_float32(f"llama.rope.scaling.{key}", value)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32))
    state = {name: tensor.numpy() for name, tensor in model.state_dict().items()}
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", state["model.norm.weight"])
    writer.add_tensor("output.weight", state["lm_head.weight"])
    for index in range(config.num_hidden_layers):
        for hf, short in GGUF_LAYER_NAMES.items():
            values = state[f"model.layers.{index}.{hf}.weight"]
            if short == "attn_q":
                values = interleaved(values, config.num_attention_heads)
            elif short == "attn_k":
                values = interleaved(values, config.num_key_value_heads)
            writer.add_tensor(f"blk.{index}.{short}.weight", values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def assert_split_matches(model, package: Path) -> None:
    """A prompt, one-token steps and a verify window on two stages against the model."""
    sequence = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(5))
    want = full_logits(model, sequence)
    stages = load_chain(package, HALVES)
    assert max_diff(run_chain(stages, "s", 0, sequence[:14]), want[:14]) <= TOLERANCE
    for pos in range(14, 20):
        got = run_chain(stages, "s", pos, sequence[pos : pos + 1])
        assert max_diff(got, want[pos : pos + 1]) <= TOLERANCE
    assert max_diff(run_chain(stages, "s", 20, sequence[20:]), want[20:]) <= TOLERANCE


def package_rope(package: Path) -> dict:
    config = json.loads((package / "config.json").read_text())
    return config["rope_parameters"]


def test_llama3_frequency_factors_are_read_back_into_the_config(tmp_path: Path) -> None:
    model = llama_model(LLAMA3)
    factors = llama3_factors(
        {k: v for k, v in LLAMA3.items() if k not in ("rope_type", "rope_theta")}, 10000.0, 16
    )
    assert 1.0 < factors[3] < 8.0 and factors[0] == 1.0 and factors[-1] == 8.0
    gguf = write_llama_gguf(model, tmp_path / "llama3.gguf", rope_freqs=factors)
    build_package(str(gguf), tmp_path / "pkg")
    rope = package_rope(tmp_path / "pkg")
    assert rope["rope_type"] == "llama3" and rope["factor"] == 8.0
    # The same ramp, stated for another original context: only the ratios matter.
    ratio = rope["original_max_position_embeddings"] / 1024
    assert rope["low_freq_factor"] == pytest.approx(ratio, rel=1e-5)
    assert rope["high_freq_factor"] == pytest.approx(8 * ratio, rel=1e-5)
    assert_split_matches(model, tmp_path / "pkg")


def test_without_the_factors_the_outputs_differ(tmp_path: Path) -> None:
    """The test above can fail: the same file without its factors answers otherwise."""
    model = llama_model(LLAMA3)
    gguf = write_llama_gguf(model, tmp_path / "plain.gguf")
    build_package(str(gguf), tmp_path / "pkg")
    assert package_rope(tmp_path / "pkg")["rope_type"] == "default"
    with pytest.raises(AssertionError):
        assert_split_matches(model, tmp_path / "pkg")


@pytest.mark.parametrize(
    ("rope", "metadata"),
    [
        (
            {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
            {"type": "linear", "factor": 4.0},
        ),
        (
            {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 1024,
            },
            {"type": "yarn", "factor": 4.0, "original_context_length": 1024},
        ),
    ],
    ids=["linear", "yarn"],
)
def test_scaling_in_the_metadata_is_read(tmp_path: Path, rope: dict, metadata: dict) -> None:
    model = llama_model(rope, seed=1)
    gguf = write_llama_gguf(model, tmp_path / "scaled.gguf", **metadata)
    build_package(str(gguf), tmp_path / "pkg")
    assert package_rope(tmp_path / "pkg")["rope_type"] == rope["rope_type"]
    assert_split_matches(model, tmp_path / "pkg")


def test_an_unknown_scaling_type_is_refused(tmp_path: Path) -> None:
    model = llama_model({"rope_type": "default", "rope_theta": 10000.0})
    gguf = write_llama_gguf(model, tmp_path / "odd.gguf", type="xpos", factor=2.0)
    with pytest.raises(UnsupportedArchitecture, match="'xpos' is not supported"):
        build_package(str(gguf), tmp_path / "pkg")
    assert not (tmp_path / "pkg" / "model-package.json").exists()


def test_factors_no_llama3_parameters_give_are_refused(tmp_path: Path) -> None:
    model = llama_model({"rope_type": "default", "rope_theta": 10000.0})
    factors = [1.0, 3.0, 1.5, 8.0, 2.0, 8.0, 8.0, 8.0]
    gguf = write_llama_gguf(model, tmp_path / "odd.gguf", rope_freqs=factors)
    with pytest.raises(UnsupportedArchitecture, match="Llama 3's scaling rule"):
        build_package(str(gguf), tmp_path / "pkg")


def test_uniform_factors_are_linear_scaling() -> None:
    assert _llama3([4.0] * 8, 10000.0, 16, 4096) == {"rope_type": "linear", "factor": 4.0}


def test_llama3_parameters_are_found_again_from_their_factors() -> None:
    """Llama 3.1's and 3.2's own parameters exactly; random ones (ramps of 0, 1 or
    more frequencies, any base and width) as parameters that give the same factors."""
    llama31 = {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    found = _llama3(llama3_factors(llama31, 500000.0, 128), 500000.0, 128, 131072)
    assert found == {"rope_type": "llama3", **llama31}
    llama32 = {**llama31, "factor": 32.0}
    found = _llama3(llama3_factors(llama32, 500000.0, 64), 500000.0, 64, 131072)
    assert found == {"rope_type": "llama3", **llama32}
    rng = random.Random(7)
    for _ in range(200):
        base = rng.choice([10000.0, 500000.0, 1e6])
        width = rng.choice([16, 32, 64, 128])
        low = rng.uniform(0.5, 4.0)
        parameters = {
            "factor": rng.choice([2.0, 4.0, 8.0, 32.0]),
            "low_freq_factor": low,
            "high_freq_factor": low * rng.uniform(1.2, 16.0),
            "original_max_position_embeddings": rng.choice([64, 512, 8192]),
        }
        factors = llama3_factors(parameters, base, width)
        found = _llama3(factors, base, width, rng.choice([512, 131072]))
        if found["rope_type"] == "llama3":
            del found["rope_type"]
            got = llama3_factors(found, base, width)
            assert np.allclose(got, factors, rtol=1e-4), (parameters, found)
        else:
            assert all(f == pytest.approx(found["factor"]) for f in factors)
