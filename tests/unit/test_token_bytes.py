"""Each token's own bytes (``stage/frontend/token_bytes.py``): joined over a text's
tokens they give the text's UTF-8, also where a token holds part of a character, for
a byte-level tokenizer (SmolLM2's) and a SentencePiece-style one with byte
fallback; and where the API shows them: ``logprobs`` ``bytes`` on chat and
llama.cpp's completions, and ``/tokenize`` ``with_pieces`` / ``return_token_strs``."""

from __future__ import annotations

import json

import httpx
import pytest
from frontend_support import (
    ScriptedBackend,
    assert_openai_error,
    live_server,
    sentencepiece_style,
)

from mesh.frames import TokenLogprob
from stage.frontend.backend import TokenEvent
from stage.frontend.token_bytes import piece, token_bytes

TEXTS = ["héllo 🙂 世界", " two  spaces\n\ttab", "Ünïcödé — ½ ∑ 𝔘", "日本語のテキスト"]


def joined(tokenizer, ids: list[int]) -> bytes:
    return b"".join(token_bytes(tokenizer, t) for t in ids)


@pytest.mark.parametrize("text", TEXTS)
def test_a_byte_level_tokenizer_s_tokens_join_into_the_text(smollm2_tokenizer, text: str) -> None:
    ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
    assert joined(smollm2_tokenizer, ids) == text.encode("utf-8")
    # Some of these tokens hold part of a character: decoded alone they are U+FFFD.
    if any(ord(c) > 0x2FFF for c in text):
        assert any(smollm2_tokenizer.decode([t]) == "\ufffd" for t in ids)


def test_special_tokens_are_their_text(smollm2_tokenizer) -> None:
    end = smollm2_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert token_bytes(smollm2_tokenizer, end) == b"<|im_end|>"
    assert piece(smollm2_tokenizer, end) == "<|im_end|>"


def test_a_sentencepiece_tokenizer_s_byte_tokens_are_their_bytes() -> None:
    tokenizer = sentencepiece_style()
    text = "hi 世"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.convert_ids_to_tokens(ids)[-3:] == ["<0xE4>", "<0xB8>", "<0x96>"]
    # The leading ▁ the normaliser adds is a space, as llama.cpp's pieces have it.
    assert joined(tokenizer, ids) == b" " + text.encode("utf-8")
    assert piece(tokenizer, ids[-1]) == [0x96]
    assert token_bytes(tokenizer, 1) == b"<s>"


@pytest.fixture()
def cjk(smollm2_tokenizer):
    """(base URL, the answer's text, its ids): a backend answering "世界 ok" with
    log-probabilities, each token's alternatives the token itself."""
    text = "世界 ok"
    ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
    logprobs = tuple(TokenLogprob(-0.5, ((t, -0.5),)) for t in ids)
    backend = ScriptedBackend([TokenEvent(tuple(ids), "stop", logprobs=logprobs)])
    with live_server(backend, smollm2_tokenizer) as url:
        yield url, text, ids


def test_logprobs_bytes_join_into_the_answer(cjk) -> None:
    url, text, ids = cjk
    chat = httpx.post(
        f"{url}/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "logprobs": True,
            "top_logprobs": 1,
            "max_tokens": 16,
        },
        timeout=30,
    ).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == len(ids)
    assert bytes(b for entry in content for b in entry["bytes"]).decode("utf-8") == text
    assert all(entry["top_logprobs"][0]["bytes"] == entry["bytes"] for entry in content)
    llama = httpx.post(
        f"{url}/completion", json={"prompt": "hi", "n_predict": 16, "n_probs": 1}, timeout=30
    ).json()
    probabilities = llama["completion_probabilities"]
    assert bytes(b for entry in probabilities for b in entry["bytes"]).decode("utf-8") == text


def test_tokenize_with_pieces_and_token_strings(cjk, smollm2_tokenizer) -> None:
    url, text, ids = cjk
    answer = httpx.post(f"{url}/tokenize", json={"content": text, "with_pieces": True}).json()
    pieces = answer["tokens"]
    assert [p["id"] for p in pieces] == ids and answer["count"] == len(ids)
    raw = b"".join(
        p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"]) for p in pieces
    )
    assert raw.decode("utf-8") == text
    assert any(isinstance(p["piece"], list) for p in pieces)  # parts of 世 and 界
    assert pieces[-1]["piece"] == smollm2_tokenizer.decode([ids[-1]])  # a whole token
    strs = httpx.post(f"{url}/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert strs["tokens"] == ids
    assert strs["token_strs"] == smollm2_tokenizer.convert_ids_to_tokens(ids)
    chat = httpx.post(
        f"{url}/tokenize",
        json={"messages": [{"role": "user", "content": text}], "with_pieces": True},
    ).json()
    assert all(set(p) == {"id", "piece"} for p in chat["tokens"])
    refused = httpx.post(f"{url}/tokenize", json={"prompt": text, "with_pieces": "yes"})
    assert_openai_error(refused, 400, param="with_pieces")
    assert json.loads(refused.text)["error"]["type"] == "invalid_request_error"


def test_a_completion_keeps_the_space_before_its_first_word() -> None:
    """A SentencePiece tokenizer drops the leading space of a decode's first word:
    the completion's text is decoded after the prompt's last tokens, so it is
    " hi" after "hi", and echo gives "hi hi" (it gave "hi" and "hihi")."""
    tokenizer = sentencepiece_style()
    word = tokenizer.convert_tokens_to_ids("▁hi")
    backend = ScriptedBackend([TokenEvent((word,), "stop")])
    with live_server(backend, tokenizer) as url:
        plain = httpx.post(
            f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=30
        ).json()
        echoed = httpx.post(
            f"{url}/v1/completions",
            json={"prompt": "hi", "max_tokens": 4, "echo": True},
            timeout=30,
        ).json()
        streamed = []
        with httpx.stream(
            "POST",
            f"{url}/v1/completions",
            json={"prompt": "hi", "max_tokens": 4, "stream": True},
            timeout=30,
        ) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    streamed.append(json.loads(line[6:])["choices"][0]["text"])
    assert plain["choices"][0]["text"] == " hi"
    assert echoed["choices"][0]["text"] == "hi hi"
    assert "".join(streamed) == " hi"


def test_a_stop_string_completed_by_the_flushed_text_ends_with_stop(smollm2_tokenizer) -> None:
    """The budget ends an answer inside a character: the flushed text ends in
    U+FFFD, and a stop string that it completes is a stop, not "length"."""
    ids = smollm2_tokenizer.encode("ab🎉", add_special_tokens=False)
    partial = ids[:-1]
    assert smollm2_tokenizer.decode(partial).endswith("\ufffd")
    backend = ScriptedBackend([TokenEvent(tuple(partial), "length")])
    with live_server(backend, smollm2_tokenizer) as url:
        reply = httpx.post(
            f"{url}/v1/completions",
            json={"prompt": "x", "max_tokens": len(partial), "stop": ["b\ufffd"]},
            timeout=30,
        ).json()
    assert reply["choices"][0]["text"] == "a"
    assert reply["choices"][0]["finish_reason"] == "stop"
