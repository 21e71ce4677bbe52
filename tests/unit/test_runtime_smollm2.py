"""The real SmolLM2-135M: a 2-way split decodes exactly what HF generate decodes."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from runtime_support import package_of, run_chain
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from mesh.runtime import StageRuntime, load_stage_runtime
from mesh.types import LayerRange

pytestmark = pytest.mark.slow

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def smollm2_model(smollm2_gguf: Path) -> PreTrainedModel:
    """The unsplit model, dequantised from the GGUF by transformers, in float32."""
    model = AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="module")
def smollm2_split_package(
    smollm2_model: PreTrainedModel,
    smollm2_tokenizer_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Path]:
    """A package built by the package builder from the very tensors of ``smollm2_model``
    (written out as an HF directory, which avoids dequantising the GGUF twice). The HF
    directory goes as soon as the package is built and the package when the module ends:
    together they are about a gigabyte of disk."""
    hf_dir = tmp_path_factory.mktemp("smollm2-hf")
    config = smollm2_model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(smollm2_model).__name__]
    (hf_dir / "config.json").write_text(json.dumps(config, indent=2))
    state = smollm2_model.state_dict()
    if smollm2_model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file({k: v.contiguous() for k, v in state.items()}, str(hf_dir / "model.safetensors"))
    for path in smollm2_tokenizer_dir.iterdir():
        shutil.copy(path, hf_dir / path.name)
    package = package_of(hf_dir, tmp_path_factory.mktemp("smollm2-pkg") / "pkg")
    shutil.rmtree(hf_dir)
    yield package
    shutil.rmtree(package)


def greedy(stages: list[StageRuntime], prompt: torch.Tensor, steps: int, eos: set[int]) -> list:
    logits = run_chain(stages, "greedy", 0, prompt)
    emitted: list[int] = []
    pos = prompt.shape[0]
    while True:
        token = int(logits[-1].argmax())
        emitted.append(token)
        if len(emitted) == steps or token in eos:
            return emitted
        logits = run_chain(stages, "greedy", pos, torch.tensor([token]))
        pos += 1


def test_two_way_split_greedy_equals_hf_generate(
    smollm2_model: PreTrainedModel, smollm2_split_package: Path, smollm2_tokenizer_dir: Path
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    prompt = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.inference_mode():
        generated = smollm2_model.generate(
            prompt,
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            attention_mask=torch.ones_like(prompt),
        )
    want = generated[0, prompt.shape[1] :].tolist()
    assert len(want) == NEW_TOKENS, "the prompt must not end early for this comparison"

    stages = [
        load_stage_runtime(smollm2_split_package, LayerRange(0, 15)),
        load_stage_runtime(smollm2_split_package, LayerRange(15, 30)),
    ]
    eos = smollm2_model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    got = greedy(stages, prompt[0], NEW_TOKENS, eos_ids)
    assert got == want
    assert [s.session_length("greedy") for s in stages] == [prompt.shape[1] + NEW_TOKENS - 1] * 2


def test_half_split_holds_only_half_the_layers_plus_its_ends(
    smollm2_model: PreTrainedModel, smollm2_split_package: Path
) -> None:
    state = smollm2_model.state_dict()

    def nbytes(predicate) -> int:
        return sum(t.numel() * t.element_size() for n, t in state.items() if predicate(n))

    def layers(layer_range: LayerRange) -> int:
        prefixes = tuple(f"model.layers.{i}." for i in layer_range)
        return nbytes(lambda name: name.startswith(prefixes))

    embed = nbytes(lambda name: name == "model.embed_tokens.weight")
    norm = nbytes(lambda name: name == "model.norm.weight")
    head = embed  # the LM head matrix is vocab x hidden, tied or not
    whole = layers(LayerRange(0, 30)) + embed + norm
    first = load_stage_runtime(smollm2_split_package, LayerRange(0, 15))
    last = load_stage_runtime(smollm2_split_package, LayerRange(15, 30))
    assert first.param_bytes <= layers(LayerRange(0, 15)) + embed
    assert last.param_bytes <= layers(LayerRange(15, 30)) + norm + head
    assert first.param_bytes >= layers(LayerRange(0, 15))
    assert last.param_bytes >= layers(LayerRange(15, 30))
    assert max(first.param_bytes, last.param_bytes) < 0.65 * whole
