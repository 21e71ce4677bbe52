"""Mixture-of-experts layers (Qwen2-MoE, Qwen3-MoE, Mixtral): the model's own routing
rule (and Qwen2-MoE's shared expert), dense
and sparse layers mixed, per-expert package tensors, quantised experts, and layers
the runtime refuses. Split chains and batched frames of both families are covered
with every other family in test_runtime_equivalence.py and test_runtime_batch.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import tiny_config
from runtime_support import full_logits, max_diff, run_chain
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from mesh.errors import PackageError, UnsupportedArchitecture
from mesh.package.builder import build_package
from mesh.package.manifest import PackageManifest, layer_path
from mesh.runtime import StateDictWeights, build_stage_runtime, load_stage_runtime, qkernels
from mesh.runtime.block import check_structure
from mesh.runtime.skeleton import build_stage_modules
from mesh.types import LayerRange

CPU = torch.device("cpu")
PROMPT = torch.tensor([5, 17, 300, 4000, 12, 99, 7, 1024, 3, 41])
SMALL_VOCAB_PROMPT = PROMPT % 512


def tiny_moe(family: str, layers: int = 2, seed: int = 0, **overrides: object):
    """A tiny random HF model of ``family`` (eval mode, float32)."""
    config = tiny_config(family, layers=layers, vocab_size=512)
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.config.architectures = [type(model).__name__]
    return model


@pytest.mark.parametrize(
    ("family", "norm_topk_prob"),
    [
        ("qwen3_moe", True),
        ("qwen3_moe", False),
        ("qwen2_moe", False),
        ("qwen2_moe", True),
        ("mixtral", None),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_follow_the_models_own_routing(
    family: str, norm_topk_prob: bool | None, dtype: torch.dtype
) -> None:
    overrides = {} if norm_topk_prob is None else {"norm_topk_prob": norm_topk_prob}
    model = tiny_moe(family, **overrides).to(dtype)
    weights = StateDictWeights(model.state_dict(), tied=model.config.tie_word_embeddings)
    modules = build_stage_modules(model.config, weights, LayerRange(0, 2), CPU, dtype)
    experts = modules.blocks[0].experts
    assert experts is not None and experts.routing.top_k == 2
    states = torch.randn(24, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.inference_mode():
        want = model.model.layers[0].mlp(states.unsqueeze(0))[0]
        got = experts(states)
    assert got.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2 * want.abs().max().item()
    assert max_diff(got.float(), want.float()) <= tolerance
    if family == "qwen2_moe":
        # The shared expert counts: without it the outputs differ.
        assert experts.shared is not None
        shared = model.model.layers[0].mlp.shared_expert
        with torch.inference_mode():
            common = shared(states) * torch.sigmoid(
                model.model.layers[0].mlp.shared_expert_gate(states)
            )
        assert max_diff(got.float(), (want - common).float()) > 10 * tolerance
    if family in ("qwen3_moe", "qwen2_moe"):
        # The rule matters: the other normalisation gives other outputs.
        model.model.layers[0].mlp.gate.norm_topk_prob = not norm_topk_prob
        with torch.inference_mode():
            other = model.model.layers[0].mlp(states.unsqueeze(0))[0]
        assert max_diff(got.float(), other.float()) > 10 * tolerance


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_glm45_experts_follow_its_grouped_sigmoid_routing(dtype: torch.dtype) -> None:
    """GLM-4.5's rule (sigmoid scores, a bias on the choice, groups, scaled weights)
    and its ungated shared expert, against transformers' layer; its router stays in
    float32 as transformers keeps it."""
    model = tiny_moe("glm4_moe")
    layer = model.model.layers[1]
    with torch.no_grad():
        layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.5)
    model = model.to(dtype)
    layer.mlp.gate.float()
    weights = StateDictWeights(model.state_dict(), tied=model.config.tie_word_embeddings)
    modules = build_stage_modules(model.config, weights, LayerRange(0, 2), CPU, dtype)
    assert modules.blocks[0].experts is None  # first_k_dense_replace
    experts = modules.blocks[1].experts
    assert experts is not None and experts.routing.rule == "grouped_sigmoid"
    states = torch.randn(32, 64, generator=torch.Generator().manual_seed(2)).to(dtype)
    with torch.inference_mode():
        want = layer.mlp(states.unsqueeze(0))[0]
        got = experts(states)
    assert got.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2 * want.abs().max().item()
    assert max_diff(got.float(), want.float()) <= tolerance
    # The bias decides which experts: without it other experts are chosen.
    with torch.no_grad():
        layer.mlp.gate.e_score_correction_bias.zero_()
        other = layer.mlp(states.unsqueeze(0))[0]
    assert max_diff(got.float(), other.float()) > 10 * tolerance


def test_glm45_multi_token_prediction_layers_are_left_out(tmp_path) -> None:
    """A checkpoint's layers after the last decoder layer (``num_nextn_predict_layers``)
    are not packaged; any other extra layer is still refused."""
    model = tiny_moe("glm4_moe")
    model.save_pretrained(tmp_path / "src")
    shard = tmp_path / "src" / "model.safetensors"
    tensors = load_file(str(shard))
    tensors["model.layers.2.eh_proj.weight"] = torch.zeros(64, 128)
    tensors["model.layers.2.enorm.weight"] = torch.ones(64)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    build_package(str(tmp_path / "src"), tmp_path / "pkg")
    assert not (tmp_path / "pkg" / "layers" / "00002.safetensors").exists()
    tensors["model.layers.3.enorm.weight"] = torch.ones(64)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(PackageError, match="unexpected"):
        build_package(str(tmp_path / "src"), tmp_path / "pkg2")


def test_dense_and_sparse_layers_mix_as_the_config_says() -> None:
    """Qwen3-MoE's ``decoder_sparse_step`` and ``mlp_only_layers``: layers 1 and 5 are
    sparse, 3 is listed as MLP-only, the even ones are off the step."""
    model = tiny_moe(
        "qwen3_moe", layers=6, decoder_sparse_step=2, mlp_only_layers=[3], norm_topk_prob=False
    )
    model = AutoModelForCausalLM.from_config(model.config).eval()  # rebuilt with those layers
    weights = StateDictWeights(model.state_dict(), tied=model.config.tie_word_embeddings)
    ranges = (LayerRange(0, 2), LayerRange(2, 6))
    stages = [build_stage_runtime(model.config, weights, r) for r in ranges]
    modules = build_stage_modules(model.config, weights, LayerRange(0, 6), CPU, torch.float32)
    assert [b.experts is not None for b in modules.blocks] == [False, True] + [False] * 3 + [True]
    prompt = SMALL_VOCAB_PROMPT
    want = full_logits(model, prompt)
    got = [run_chain(stages, "s", 0, prompt[:6])]
    got += [run_chain(stages, "s", pos, prompt[pos : pos + 1]) for pos in range(6, 10)]
    assert max_diff(torch.cat(got), want) <= 1e-4


def test_mixtral_checkpoint_names_become_the_package_names(
    tiny_model_factory: Callable[..., Path], tiny_package_factory: Callable[..., Path]
) -> None:
    source = load_file(str(tiny_model_factory("mixtral", layers=6) / "model.safetensors"))
    stored = load_file(str(tiny_package_factory("mixtral", layers=6) / layer_path(4)))
    prefix = "model.layers.4.block_sparse_moe."
    assert torch.equal(stored["mlp.gate.weight"], source[prefix + "gate.weight"])
    for expert in range(4):
        for ours, theirs in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
            name = f"mlp.experts.{expert}.{ours}.weight"
            assert torch.equal(stored[name], source[f"{prefix}experts.{expert}.{theirs}.weight"])
    assert not [name for name in stored if "block_sparse_moe" in name or ".w1." in name]


def test_a_checkpoint_of_stacked_experts_is_refused_by_name(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    source = tiny_model_factory("qwen3_moe", layers=6)
    model = tmp_path / "stacked"
    model.mkdir()
    for path in source.iterdir():
        if path.suffix != ".safetensors":
            (model / path.name).write_bytes(path.read_bytes())
    state = AutoModelForCausalLM.from_pretrained(source).state_dict()
    state.pop("lm_head.weight")  # tied to the embedding
    save_file({k: v.contiguous() for k, v in state.items()}, str(model / "model.safetensors"))
    with pytest.raises(PackageError, match=r"model\.layers\.0\.mlp\.experts\.down_proj.*stacked"):
        build_package(str(model), tmp_path / "pkg")
    assert not (tmp_path / "pkg").exists()


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe"])
def test_an_int4_moe_package_builds_splits_and_follows_the_dense_one(
    tiny_package_factory: Callable[..., Path], family: str
) -> None:
    package = tiny_package_factory(family, layers=4, quant="int4")
    manifest = PackageManifest.load(package)
    assert manifest.quantization is not None and manifest.quantization["linear"] == "int4"
    stored = load_file(str(package / layer_path(1)))
    assert {"mlp.experts.3.down_proj.weight.qweight", "mlp.gate.weight"} <= set(stored)
    assert stored["mlp.gate.weight"].dtype == torch.float32  # the router stays in floats
    if family == "qwen2_moe":
        assert "mlp.shared_expert.down_proj.weight.qweight" in stored
        assert stored["mlp.shared_expert_gate.weight"].dtype == torch.float32  # as the router
    whole = load_stage_runtime(package, LayerRange(0, 4))
    parts = [load_stage_runtime(package, r) for r in (LayerRange(0, 1), LayerRange(1, 4))]
    assert whole.dtype == "bfloat16"
    logits = whole.forward("s", 0, PROMPT)
    assert torch.equal(run_chain(parts, "s", 0, PROMPT), logits)
    assert torch.equal(run_chain(parts, "s", 10, PROMPT[:1]), whole.forward("s", 10, PROMPT[:1]))
    dense = load_stage_runtime(
        tiny_package_factory(family, layers=4), LayerRange(0, 4), dtype="bfloat16"
    )
    cosine = torch.nn.functional.cosine_similarity(dense.forward("s", 0, PROMPT), logits, dim=-1)
    assert float(cosine.min()) > 0.9
    middle = LayerRange(1, 3)  # decoder layers only: the experts are most of their bytes
    dense_layers = load_stage_runtime(tiny_package_factory(family, layers=4), middle)
    assert load_stage_runtime(package, middle).param_bytes < dense_layers.param_bytes * 0.4


def test_a_sparse_layer_of_another_shape_is_refused() -> None:
    """A sparse MLP with parts the runtime does not compute (here one more module
    beside the router and experts) is refused, naming them."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config("qwen3_moe", layers=1))
    model.model.layers[0].mlp.extra = torch.nn.Linear(64, 64)
    with pytest.raises(UnsupportedArchitecture, match=r"decoder layer 0 .*sparse MLP parts"):
        check_structure(model.model.layers[0], 0)


def test_compiled_decode_steps_follow_eager(
    tiny_package_factory: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--compile`` (int4 experts on torch's kernels: the stage's own kernels are
    not compiled): the routing's host read splits the compiled layer function,
    which still runs every decode step (no fall back to eager)."""
    monkeypatch.setattr(qkernels, "MODE", "torch")
    package = tiny_package_factory("qwen3_moe", layers=4, quant="int4")
    eager = load_stage_runtime(package, LayerRange(0, 4))
    compiled = load_stage_runtime(package, LayerRange(0, 4), compile=True)
    want = [eager.forward("s", 0, PROMPT)[-1]]
    got = [compiled.forward("s", 0, PROMPT)[-1]]
    for pos, token in enumerate(PROMPT[:4].tolist(), start=PROMPT.shape[0]):
        want.append(eager.forward("s", pos, torch.tensor([token]))[-1])
        got.append(compiled.forward("s", pos, torch.tensor([token]))[-1])
    assert compiled.compiled, "compilation fell back to eager"
    scale = max(float(w.abs().max()) for w in want)
    for a, b in zip(want, got, strict=True):
        assert float((a - b).abs().max()) <= 0.02 * scale
