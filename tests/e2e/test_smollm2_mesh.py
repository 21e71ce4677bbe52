"""The real SmolLM2-135M-Instruct, split across 2 stage processes, through the
OpenAI frontend: it answers a chat request, and its greedy answer equals HF
`generate` on the unsplit model loaded from the same GGUF."""

from __future__ import annotations

import pytest
import torch
from openai import OpenAI

from coordinator.localmesh import MeshProcesses

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "What is the capital of France? Answer briefly."}]
NEW_TOKENS = 40


def test_split_smollm2_answers_like_unsplit_generate(tmp_path, smollm2_package, smollm2_gguf):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    mesh = MeshProcesses(smollm2_package, tmp_path / "mesh", 2)
    try:
        mesh.start().wait_serving(deadline_s=300)
        stages = [s for s in mesh.status().stages if s.assigned]
        assert len(stages) == 2
        client = OpenAI(base_url=mesh.http_url + "/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=MESSAGES,
            max_tokens=NEW_TOKENS,
            temperature=0,
        )
    finally:
        mesh.close()
    answer = reply.choices[0].message.content
    assert "Paris" in answer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_package)
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    if not isinstance(prompt, list):
        prompt = prompt["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32
    ).eval()
    generated = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)[
        0, len(prompt) :
    ].tolist()
    if tokenizer.eos_token_id in generated:
        generated = generated[: generated.index(tokenizer.eos_token_id)]
    assert reply.usage.completion_tokens == len(generated)
    assert answer == tokenizer.decode(generated, skip_special_tokens=True)
