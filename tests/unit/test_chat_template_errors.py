"""A chat request against a model whose chat template is missing or broken: a clear
answer saying whose problem it is (the client's 400 for a missing template, with
where to send prompt text; the operator's 500 for one that does not compile), not
transformers' own message blaming the request's messages."""

from __future__ import annotations

import copy

import pytest

from stage.frontend.errors import OpenAIError
from stage.frontend.prepare import render_chat

MESSAGES = [{"role": "user", "content": "hi"}]


def test_a_model_without_a_chat_template_points_to_completions(smollm2_tokenizer) -> None:
    tokenizer = copy.copy(smollm2_tokenizer)
    tokenizer.chat_template = None
    with pytest.raises(OpenAIError) as refused:
        render_chat(tokenizer, MESSAGES)
    assert refused.value.status == 400 and refused.value.param == "messages"
    assert "no chat template" in refused.value.message
    assert "/v1/completions" in refused.value.message


def test_a_chat_template_that_does_not_compile_is_the_operator_s_error(
    smollm2_tokenizer,
) -> None:
    tokenizer = copy.copy(smollm2_tokenizer)
    tokenizer.chat_template = "{% for m in messages %}{{ m.content }"
    with pytest.raises(OpenAIError) as failed:
        render_chat(tokenizer, MESSAGES)
    assert failed.value.status == 500 and failed.value.code == "chat_template_broken"
    assert "cannot be compiled" in failed.value.message


def test_a_working_template_still_renders(smollm2_tokenizer) -> None:
    assert render_chat(smollm2_tokenizer, MESSAGES)
