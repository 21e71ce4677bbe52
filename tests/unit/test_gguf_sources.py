"""GGUF sources read a tensor (or a few rows) at a time: split files, bad files, and
packages equal to what transformers' own GGUF loader makes of the same file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mesh.errors import PackageError
from mesh.package import weight_store
from mesh.package.builder import build_package
from mesh.package.manifest import PackageManifest
from mesh.package.synthetic_gguf import LlamaShape, q4_k_m, write_llama_gguf
from mesh.package.tensors import load_hf_state_dict

SHAPE = LlamaShape(layers=3, hidden=256, intermediate=512, heads=4, kv_heads=2, vocab=512)
TYPES = ("Q4_K", "Q6_K", "Q8_0", "Q5_K", "Q4_0", "Q4_1", "Q5_0", "F16", "F32")


def mixed_types(name: str, layer: int | None, shape: LlamaShape) -> str:
    """Every block type somewhere (norms stay float32)."""
    if name.endswith("norm.weight"):
        return "F32"
    return TYPES[(hash(name.split(".")[-2]) + (layer or 0)) % len(TYPES)]


def tensor_files(package: Path) -> dict[str, dict[str, torch.Tensor]]:
    return {
        str(path.relative_to(package)): load_file(str(path))
        for path in sorted(package.rglob("*.safetensors"))
    }


def assert_same_tensors(first: Path, second: Path) -> None:
    left, right = tensor_files(first), tensor_files(second)
    assert left.keys() == right.keys()
    for name, tensors in left.items():
        assert tensors.keys() == right[name].keys(), name
        for key, value in tensors.items():
            assert torch.equal(value, right[name][key]), f"{name}: {key}"


@pytest.mark.parametrize("tied", [False, True])
def test_package_holds_what_transformers_reads_from_the_gguf(tmp_path: Path, tied: bool) -> None:
    from transformers import AutoModelForCausalLM

    shape = LlamaShape(**{**SHAPE.__dict__, "tied": tied})
    gguf = write_llama_gguf(tmp_path / "model.gguf", shape, types=mixed_types, seed=3)[0]
    manifest = build_package(str(gguf), tmp_path / "pkg")
    assert manifest.architecture == "LlamaForCausalLM"
    assert manifest.tied_embeddings is tied
    ours = load_hf_state_dict(tmp_path / "pkg")
    model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=gguf.name, dtype=torch.float32)
    theirs = model.state_dict()
    if tied:
        theirs.pop("lm_head.weight")
        ours.pop("lm_head.weight", None)
    assert ours.keys() == theirs.keys()
    for name, value in theirs.items():
        # q and k rows included: the GGUF stores them in llama.cpp's rotary order.
        assert torch.equal(ours[name], value), name


def test_split_gguf_gives_the_same_package(tmp_path: Path) -> None:
    single = write_llama_gguf(tmp_path / "one" / "model.gguf", SHAPE, seed=5)
    parts = write_llama_gguf(tmp_path / "parts" / "model.gguf", SHAPE, seed=5, split_max_tensors=7)
    assert len(single) == 1 and len(parts) == 5
    assert [p.name for p in parts][:2] == ["model-00001-of-00005.gguf", "model-00002-of-00005.gguf"]
    build_package(str(single[0]), tmp_path / "from-one", quant="int4")
    # The directory of parts, or any one part, names the whole model.
    build_package(str(tmp_path / "parts"), tmp_path / "from-parts", quant="int4")
    build_package(str(parts[3]), tmp_path / "from-part-4", quant="int4")
    assert_same_tensors(tmp_path / "from-one", tmp_path / "from-parts")
    assert_same_tensors(tmp_path / "from-one", tmp_path / "from-part-4")
    manifest = PackageManifest.load(tmp_path / "from-parts")
    assert manifest.quantization["from_source_codes"] == {"Q4_K": 17}


def test_a_missing_part_is_named_and_nothing_is_written(tmp_path: Path) -> None:
    parts = write_llama_gguf(tmp_path / "model.gguf", SHAPE, split_max_tensors=9)
    parts[1].unlink()
    with pytest.raises(PackageError, match=f"{parts[1].name} is missing"):
        build_package(str(parts[0]), tmp_path / "pkg")
    assert not (tmp_path / "pkg").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_a_truncated_file_is_named(tmp_path: Path) -> None:
    gguf = write_llama_gguf(tmp_path / "model.gguf", SHAPE)[0]
    size = gguf.stat().st_size
    with open(gguf, "r+b") as handle:
        handle.truncate(size - 4096)
    with pytest.raises(PackageError, match=r"model\.gguf \([\d,]+ bytes\).* truncated"):
        build_package(str(gguf), tmp_path / "pkg")
    assert not (tmp_path / "pkg").exists()


def test_a_block_type_that_cannot_be_decoded_is_named(tmp_path: Path) -> None:
    def with_q8_1(name: str, layer: int | None, shape: LlamaShape) -> str:
        return "Q8_1" if name == "blk.1.ffn_up.weight" else q4_k_m(name, layer, shape)

    gguf = write_llama_gguf(tmp_path / "model.gguf", SHAPE, types=with_q8_1)[0]
    with pytest.raises(PackageError, match=r"blk\.1\.ffn_up\.weight is stored as Q8_1"):
        build_package(str(gguf), tmp_path / "pkg")


def test_an_unknown_block_type_number_is_a_clear_error(tmp_path: Path) -> None:
    gguf = write_llama_gguf(tmp_path / "model.gguf", SHAPE)[0]
    data = bytearray(gguf.read_bytes())
    # The first tensor info: name, dims, sizes, then its uint32 type.
    name = b"token_embd.weight"
    at = data.index(name) + len(name) + 4 + 2 * 8
    data[at : at + 4] = (250).to_bytes(4, "little")
    gguf.write_bytes(bytes(data))
    with pytest.raises(PackageError, match="cannot read GGUF .*model.gguf.*tensor type"):
        build_package(str(gguf), tmp_path / "pkg")


@pytest.mark.parametrize(("arch", "message"), [("gpt2", "not supported"), ("nonsense", "nonsense")])
def test_an_unsupported_architecture_is_refused(tmp_path: Path, arch: str, message: str) -> None:
    gguf = write_llama_gguf(tmp_path / "model.gguf", SHAPE, arch=arch)[0]
    with pytest.raises(PackageError, match=message):
        build_package(str(gguf), tmp_path / "pkg")
    assert not (tmp_path / "pkg").exists()


@pytest.mark.parametrize("quant", [None, "int4"])
def test_reading_in_small_chunks_gives_the_same_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, quant: str | None
) -> None:
    gguf = write_llama_gguf(tmp_path / "model.gguf", SHAPE, types=mixed_types, seed=9)[0]
    build_package(str(gguf), tmp_path / "whole", quant=quant)
    # 4 KB reads: a few rows at a time, q and k in whole heads.
    monkeypatch.setattr(weight_store, "CHUNK_BYTES", 4096)
    build_package(str(gguf), tmp_path / "chunked", quant=quant)
    assert_same_tensors(tmp_path / "whole", tmp_path / "chunked")


def test_no_read_holds_more_than_a_chunk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Memory stays bounded: every read of tensor data is at most one chunk (as
    float32), whatever the tensor's size; nothing reads a whole weight at once."""
    from mesh.package.gguf_file import GgufModel

    gguf = write_llama_gguf(tmp_path / "model.gguf", SHAPE, types=mixed_types)[0]
    chunk = 64 * 1024
    monkeypatch.setattr(weight_store, "CHUNK_BYTES", chunk)
    reads: list[int] = []
    original = GgufModel.raw_rows

    def recording(self: GgufModel, name: str, first: int, count: int):  # noqa: ANN202
        reads.append(count * self.tensors[name].shape[-1] * 4)
        return original(self, name, first, count)

    monkeypatch.setattr(GgufModel, "raw_rows", recording)
    for quant in (None, "int4"):
        reads.clear()
        build_package(str(gguf), tmp_path / f"pkg-{quant}", quant=quant, overwrite=True)
        # The largest tensors (embedding, FFN weights) are 512 KB as float32.
        assert len(reads) > 40 and max(reads) <= chunk


def test_the_manifest_states_how_far_each_form_is_from_the_gguf(tmp_path: Path) -> None:
    """Per source block type and stored form: codes kept exactly (Q4_0, Q4_1) deviate
    by nothing, rounded ones (Q6_K to int4) by the measured error, which matches a
    recomputation from the package."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from mesh import quant

    def types(name: str, layer: int | None, shape: LlamaShape) -> str:
        if name.endswith("norm.weight"):
            return "F32"
        if name.endswith("ffn_down.weight"):
            return "Q6_K"
        return "Q4_1" if layer == 1 else "Q4_0"

    gguf = write_llama_gguf(tmp_path / "model.gguf", SHAPE, types=types, seed=2)[0]
    manifest = build_package(str(gguf), tmp_path / "pkg", quant="int4")
    deviation = {(d["source"], d["stored"]): d for d in manifest.quantization["deviation"]}
    for exact in ("Q4_0", "Q4_1"):
        entry = deviation[(exact, "int4 g32")]
        assert entry["from_source_codes"] == entry["tensors"] > 0
        assert entry["max_abs_error"] == 0.0 and entry["values_compared"] > 0
    rounded = deviation[("Q6_K", "int4 g32")]
    assert rounded["tensors"] == SHAPE.layers and rounded["from_source_codes"] == 0
    reader = GGUFReader(str(gguf))
    worst = 0.0
    for layer in range(SHAPE.layers):
        tensor = next(t for t in reader.tensors if t.name == f"blk.{layer}.ffn_down.weight")
        source = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).copy())
        stored = load_file(str(tmp_path / "pkg" / "layers" / f"{layer:05d}.safetensors"))
        parts = {k: stored[f"mlp.down_proj.weight.{k}"] for k in ("qweight", "scales", "mins")}
        worst = max(
            worst, float((quant.dequantize_int4(parts, torch.float32) - source).abs().max())
        )
    assert rounded["max_abs_error"] == pytest.approx(worst, rel=1e-3) and worst > 0


@pytest.mark.parametrize(
    ("layer_type", "flags", "kept"),
    [
        ("Q4_K", [], "int4"),
        ("Q6_K", [], "int4"),
        ("Q8_0", [], "int8"),
        ("F16", [], None),
        ("Q4_K", ["--dtype", "float32"], None),
        ("Q8_0", ["--quant", "int4"], "int4"),
    ],
)
def test_a_quantised_gguf_stays_quantised_unless_float_is_asked_for(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], layer_type: str, flags: list, kept
) -> None:
    from mesh.package.cli import main

    def types(name: str, layer: int | None, shape: LlamaShape) -> str:
        return "F32" if name.endswith("norm.weight") else layer_type

    gguf = write_llama_gguf(tmp_path / "model.gguf", SHAPE, types=types)[0]
    assert main(["build", str(gguf), "--out", str(tmp_path / "pkg"), *flags]) == 0
    manifest = PackageManifest.load(tmp_path / "pkg")
    assert (manifest.quantization or {}).get("linear") == kept
    said = capsys.readouterr().err
    assert ("keeping them quantised" in said) == (kept is not None and not flags)


@pytest.mark.parametrize("head_dim", [32, 8])
def test_a_head_size_other_than_hidden_over_heads_is_read(tmp_path: Path, head_dim: int) -> None:
    """Qwen3-0.6B, 4B and 32B: heads wider or narrower than hidden / heads, given by
    ``attention.key_length``, which transformers' reader drops for Qwen3 (its config
    then says 128). The split model's logits against the transformers model."""
    import gguf
    from runtime_support import full_logits, load_chain, max_diff, run_chain
    from transformers import AutoModelForCausalLM, Qwen3Config

    from mesh.types import LayerRange

    config = Qwen3Config(
        vocab_size=500,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    path = tmp_path / "qwen3.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen3")
    writer.add_context_length(512)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_block_count(2)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(500)
    state = {name: tensor.numpy() for name, tensor in model.state_dict().items()}
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", state["model.norm.weight"])
    writer.add_tensor("output.weight", state["lm_head.weight"])
    names = {
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
    }
    for index in range(2):
        for hf, short in names.items():
            writer.add_tensor(
                f"blk.{index}.{short}.weight", state[f"model.layers.{index}.{hf}.weight"]
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    build_package(str(path), tmp_path / "pkg")
    sequence = torch.randint(0, 500, (12,), generator=torch.Generator().manual_seed(1))
    stages = load_chain(tmp_path / "pkg", (LayerRange(0, 1), LayerRange(1, 2)))
    assert max_diff(run_chain(stages, "s", 0, sequence), full_logits(model, sequence)) <= 1e-4
