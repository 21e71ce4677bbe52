"""Legacy /v1/completions features: ``echo``, scoring with ``max_tokens: 0`` and
batched prompts, against a real uvicorn server over a real tiny model.

Prompt scores are checked against a direct forward pass of the same model.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest
import torch
from frontend_support import MODEL_ID, TinyModelBackend, assert_openai_error, live_server

PROMPT = "The history of the river"
PROMPTS = ["Once upon a time", "The history of the river is long"]
COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def client(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def http(base_url) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, timeout=60.0) as client:
        yield client


def reference_scores(backend: TinyModelBackend, ids: list[int]) -> torch.Tensor:
    """Row i: log-probabilities of the token after ``ids[: i + 1]``, one forward pass."""
    with torch.no_grad():
        logits = backend.model(input_ids=torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def assert_scores_match(
    logprobs: dict, ids: list[int], reference: torch.Tensor, tokenizer, k: int
) -> None:
    """The prompt part of legacy ``logprobs`` (first token null, then each token's
    score given those before it, and its top ``k``) equals the reference."""
    assert logprobs["tokens"][: len(ids)] == [tokenizer.decode([t]) for t in ids]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    for i, token in enumerate(ids[1:]):
        row = reference[i]
        assert logprobs["token_logprobs"][i + 1] == pytest.approx(float(row[token]), abs=1e-4)
        top = logprobs["top_logprobs"][i + 1]
        values, indices = torch.topk(row, k)
        expected = {
            tokenizer.decode([t]): v for t, v in zip(indices.tolist(), values.tolist(), strict=True)
        }
        # The scored token itself is always there too (OpenAI's: up to k + 1), with
        # its own value where another token shares its text.
        expected[tokenizer.decode([token])] = float(row[token])
        assert top.keys() == expected.keys()
        for text, value in expected.items():
            assert top[text] == pytest.approx(value, abs=1e-4)


def assert_offsets_fit(text: str, logprobs: dict) -> None:
    """Each token's text is at its ``text_offset`` in the choice's text, in order."""
    assert logprobs["text_offset"][0] == 0
    end = 0
    for token, offset in zip(logprobs["tokens"], logprobs["text_offset"], strict=True):
        assert offset == end and text[offset : offset + len(token)] == token
        end = offset + len(token)
    assert end == len(text)


def test_echo_without_logprobs_puts_the_prompt_before_the_completion(
    client, backend, tokenizer
) -> None:
    plain = client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=6, temperature=0)
    echoed = client.completions.create(
        model=MODEL_ID, prompt=PROMPT, max_tokens=6, temperature=0, echo=True
    )
    assert backend.requests[-1].score_prompt is False
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    assert echoed.choices[0].logprobs is None
    assert echoed.usage.prompt_tokens == plain.usage.prompt_tokens
    assert echoed.usage.completion_tokens == plain.usage.completion_tokens == 6
    ids = tokenizer.encode(PROMPT)
    by_ids = client.completions.create(
        model=MODEL_ID, prompt=ids, max_tokens=6, temperature=0, echo=True
    )
    assert by_ids.choices[0].text == tokenizer.decode(ids) + plain.choices[0].text
    # Nothing to generate and nothing to score: the prompt comes back as it is.
    only = client.completions.create(
        model=MODEL_ID, prompt=PROMPT, max_tokens=0, echo=True, temperature=0
    )
    assert only.choices[0].text == PROMPT and only.choices[0].finish_reason == "length"
    assert only.usage.completion_tokens == 0 and only.usage.prompt_tokens == len(ids)


def test_echo_with_max_tokens_0_scores_the_prompt(client, backend, tokenizer) -> None:
    """The lm-evaluation-harness idiom: echo, max_tokens 0, logprobs k."""
    reply = client.completions.create(
        model=MODEL_ID, prompt=PROMPT, max_tokens=0, echo=True, logprobs=3, temperature=0
    )
    ids = tokenizer.encode(PROMPT)
    request = backend.requests[-1]
    assert request.score_prompt and request.max_new_tokens == 0
    choice = reply.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert reply.usage.prompt_tokens == len(ids) and reply.usage.completion_tokens == 0
    logprobs = choice.logprobs.model_dump()
    assert len(logprobs["tokens"]) == len(ids)
    assert_scores_match(logprobs, ids, reference_scores(backend, ids), tokenizer, 3)
    assert_offsets_fit(choice.text, logprobs)


def test_echo_with_logprobs_and_generation(http, backend, tokenizer) -> None:
    body = {"model": MODEL_ID, "prompt": PROMPT, "max_tokens": 5, "temperature": 0}
    plain = http.post(COMPLETIONS, json={**body, "logprobs": 2}).json()["choices"][0]
    response = http.post(COMPLETIONS, json={**body, "logprobs": 2, "echo": True})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert '"token_logprobs":[null,' in response.text.replace(" ", "")
    ids = tokenizer.encode(PROMPT)
    assert choice["text"] == PROMPT + plain["text"]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(ids) + 5
    assert_scores_match(logprobs, ids, reference_scores(backend, ids), tokenizer, 2)
    # The completion's part is the one a request without echo gets, offsets moved on.
    generated = plain["logprobs"]
    assert logprobs["tokens"][len(ids) :] == generated["tokens"]
    assert logprobs["token_logprobs"][len(ids) :] == pytest.approx(generated["token_logprobs"])
    assert logprobs["text_offset"][len(ids) :] == [
        len(PROMPT) + offset for offset in generated["text_offset"]
    ]
    assert_offsets_fit(choice["text"], logprobs)


def stream_chunks(http: httpx.Client, body: dict) -> list[dict]:
    chunks = []
    with http.stream("POST", COMPLETIONS, json={**body, "stream": True}) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: ") :]))
    return chunks


@pytest.mark.parametrize("max_tokens", [0, 5])
def test_streamed_echo_sends_the_prompt_first(http, max_tokens: int) -> None:
    body = {
        "model": MODEL_ID,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "echo": True,
        "logprobs": 1,
    }
    whole = http.post(COMPLETIONS, json=body).json()["choices"][0]
    chunks = stream_chunks(http, body)
    first = chunks[0]["choices"][0]
    assert first["text"] == PROMPT and first["finish_reason"] is None
    assert first["logprobs"]["token_logprobs"][0] is None
    choices = [chunk["choices"][0] for chunk in chunks]
    assert "".join(c["text"] for c in choices) == whole["text"]
    assert choices[-1]["finish_reason"] == "length"
    joined: dict[str, list] = {key: [] for key in whole["logprobs"]}
    for c in choices:
        for key in joined:
            joined[key] += (c["logprobs"] or {}).get(key, [])
    assert joined["tokens"] == whole["logprobs"]["tokens"]
    assert joined["text_offset"] == whole["logprobs"]["text_offset"]
    assert joined["token_logprobs"][0] is None
    assert joined["token_logprobs"][1:] == pytest.approx(whole["logprobs"]["token_logprobs"][1:])


def test_batched_string_prompts_with_n_2(client, backend, tokenizer) -> None:
    reply = client.completions.create(
        model=MODEL_ID, prompt=PROMPTS, n=2, max_tokens=4, temperature=0.9, seed=11
    )
    requests = backend.requests[-4:]
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    assert len({r.request_id for r in requests}) == 4
    assert reply.id == requests[0].request_id
    # A prompt's second choice reads it from a copy of its first choice's session.
    assert [r.fork_of for r in requests] == [
        "",
        requests[0].request_id,
        "",
        requests[2].request_id,
    ]
    lengths = [len(tokenizer.encode(p)) for p in PROMPTS]
    assert reply.usage.prompt_tokens == sum(lengths)
    # Choice i of prompt p is the answer of prompt p alone with seed 11 + i.
    produced = 0
    for index, choice in enumerate(reply.choices):
        prompt, offset = PROMPTS[index // 2], index % 2
        alone = client.completions.create(
            model=MODEL_ID, prompt=prompt, max_tokens=4, temperature=0.9, seed=11 + offset
        )
        assert choice.text == alone.choices[0].text
        produced += alone.usage.completion_tokens
    assert reply.usage.completion_tokens == produced


def test_batched_token_prompts_scored_with_n_2(client, backend, tokenizer) -> None:
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    reply = client.completions.create(
        model=MODEL_ID, prompt=prompts, n=2, max_tokens=0, echo=True, logprobs=1
    )
    # Scored prompts are read by every choice: no copies.
    assert [r.fork_of for r in backend.requests[-4:]] == ["", "", "", ""]
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    assert reply.usage.prompt_tokens == sum(len(p) for p in prompts)
    assert reply.usage.completion_tokens == 0
    for choice in reply.choices:
        ids = prompts[choice.index // 2]
        assert choice.text == tokenizer.decode(ids)
        logprobs = choice.logprobs.model_dump()
        assert_scores_match(logprobs, ids, reference_scores(backend, ids), tokenizer, 1)
        assert_offsets_fit(choice.text, logprobs)


def test_streamed_batch_interleaves_choices_with_their_indices(http) -> None:
    body = {
        "model": MODEL_ID,
        "prompt": PROMPTS,
        "n": 2,
        "max_tokens": 4,
        "temperature": 0,
        "echo": True,
        "stream_options": {"include_usage": True},
    }
    whole = http.post(COMPLETIONS, json={k: v for k, v in body.items() if k != "stream_options"})
    chunks = stream_chunks(http, body)
    assert len({chunk["id"] for chunk in chunks}) == 1
    texts = ["", "", "", ""]
    firsts: dict[int, str] = {}
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        firsts.setdefault(choice["index"], choice["text"])
        texts[choice["index"]] += choice["text"]
    assert firsts == {i: PROMPTS[i // 2] for i in range(4)}
    assert texts == [c["text"] for c in whole.json()["choices"]]
    usage, expected = chunks[-1]["usage"], whole.json()["usage"]
    assert chunks[-1]["choices"] == []
    assert usage["prompt_tokens"] == expected["prompt_tokens"]
    assert usage["completion_tokens"] == expected["completion_tokens"]


def test_sixteen_choices_are_the_most_a_request_gets(http) -> None:
    body = {"model": MODEL_ID, "prompt": ["a b"] * 8, "n": 2, "max_tokens": 1}
    reply = http.post(COMPLETIONS, json=body)
    assert reply.status_code == 200, reply.text
    assert [c["index"] for c in reply.json()["choices"]] == list(range(16))
    error = assert_openai_error(
        http.post(COMPLETIONS, json={**body, "prompt": ["a b"] * 9}), 400, param="prompt"
    )
    assert "18 choices" in error["message"] and "16" in error["message"]


@pytest.mark.parametrize(
    ("changes", "param", "words"),
    [
        ({"max_tokens": 0}, "max_tokens", "echo"),
        ({"prompt": ["a"] * 17}, "prompt", "17 choices"),
        ({"prompt": ["hello", ""]}, "prompt", "prompt 1 is empty"),
        ({"prompt": [[1, 2], []]}, "prompt", ""),
        ({"prompt": [[1, 2], [10**9]]}, "prompt", "prompt 1 token 0"),
        ({"prompt": ["a", [1]]}, "prompt", ""),
        ({"echo": "yes"}, "echo", ""),
        ({"echo": True, "logprobs": 6}, "logprobs", ""),
        ({"echo": True, "best_of": 2}, "best_of", ""),
        ({"echo": True, "suffix": "x"}, "suffix", ""),
    ],
)
def test_bad_echo_and_batch_requests_are_400(http, changes: dict, param: str, words: str) -> None:
    body = {"model": MODEL_ID, "prompt": PROMPT, "max_tokens": 2, **changes}
    error = assert_openai_error(http.post(COMPLETIONS, json=body), 400, param=param)
    assert words in error["message"]


def test_chat_still_refuses_max_tokens_0(http) -> None:
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}
    assert_openai_error(http.post("/v1/chat/completions", json=body), 400, param="max_tokens")


def test_scoring_two_continuations_as_docs_show(http) -> None:
    """docs/serving.md's example: a batch of texts scored in one request."""
    texts = ["The capital of France is Paris", "The capital of France is Rome"]
    body = {"prompt": texts, "echo": True, "max_tokens": 0, "logprobs": 1}
    reply = http.post(COMPLETIONS, json=body)
    assert reply.status_code == 200, reply.text
    paris, rome = reply.json()["choices"]
    assert [paris["text"], rome["text"]] == texts
    # The shared prefix scores the same in both; the last word is scored apart.
    first, second = paris["logprobs"], rome["logprobs"]
    assert first["tokens"][:-1] == second["tokens"][:-1]
    assert first["token_logprobs"][1:-1] == pytest.approx(second["token_logprobs"][1:-1])
    assert first["token_logprobs"][-1] != second["token_logprobs"][-1]


def test_a_batched_prompt_too_long_for_the_context_is_named(http, backend) -> None:
    body = {"prompt": [[5, 6], [5] * backend.context_length], "max_tokens": 2}
    error = assert_openai_error(
        http.post(COMPLETIONS, json=body), 400, code="context_length_exceeded", param="prompt"
    )
    assert error["message"].startswith("prompt 1 has")


def test_a_bos_token_the_tokenizer_adds_takes_no_room_in_the_echoed_text(
    tiny_model_factory, backend
) -> None:
    """With a tokenizer that puts a BOS token before every prompt (as Llama's and
    Mistral's do), the echoed text is the prompt as sent and the BOS token sits at
    offset 0 without moving the others: each later token is at its place in the text."""
    from tokenizers import processors
    from transformers import AutoTokenizer

    bos_adding = AutoTokenizer.from_pretrained(tiny_model_factory("llama", layers=2))
    bos_adding._tokenizer.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)]
    )
    assert bos_adding.encode(PROMPT)[0] == 1
    with live_server(backend, bos_adding) as url, httpx.Client(base_url=url, timeout=60) as http:
        body = {"prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 0}
        choice = http.post(COMPLETIONS, json=body).json()["choices"][0]
    assert choice["text"] == PROMPT
    logprobs = choice["logprobs"]
    assert logprobs["tokens"][0] == "<|im_start|>" and logprobs["text_offset"][:2] == [0, 0]
    assert_offsets_fit(PROMPT, {k: v[1:] for k, v in logprobs.items()})


def test_legacy_top_logprobs_always_hold_the_sampled_token(tokenizer) -> None:
    """As OpenAI's completions: ``top_logprobs`` holds the ``logprobs`` likeliest
    tokens and the sampled one where it is not among them (up to logprobs + 1), and
    with ``logprobs: 0`` the sampled one alone."""
    from frontend_support import MODEL_ID, ScriptedBackend, live_server

    from mesh.frames import TokenLogprob
    from stage.frontend.backend import TokenEvent

    sampled, other = 11, 12
    for k, alternatives in ((1, ((other, -0.1),)), (0, ())):
        entry = TokenLogprob(-3.0, alternatives)
        backend = ScriptedBackend([TokenEvent((sampled,), "length", logprobs=(entry,))])
        with live_server(backend, tokenizer) as url:
            body = {"model": MODEL_ID, "prompt": "hi", "max_tokens": 1, "logprobs": k}
            reply = httpx.post(url + "/v1/completions", json=body, timeout=30).json()
        top = reply["choices"][0]["logprobs"]["top_logprobs"][0]
        assert top[tokenizer.decode([sampled])] == -3.0
        assert len(top) == k + 1


@pytest.mark.parametrize("chunks", [(1,), (2, 3), (5,), (100,)])
def test_text_offsets_count_characters_however_the_tokens_are_grouped(
    smollm2_tokenizer, chunks: tuple[int, ...]
) -> None:
    """An answer of characters split over several byte-level tokens (emoji, Hebrew,
    CJK): each token's ``text_offset`` is where its character starts in the returned
    text (every part of a character at the same place), streamed equal to unstreamed
    whatever tokens each event carries (before, each part counted one character, and
    a stream counted from the start of each chunk), and a completion's
    ``top_logprobs`` keep the chosen token's own value where parts share a text."""
    from frontend_support import ScriptedBackend

    from mesh.frames import TokenLogprob
    from stage.frontend.backend import TokenEvent

    answer = " 🌍🚀 שלום 长走\nok"
    ids = smollm2_tokenizer.encode(answer, add_special_tokens=False)
    assert len(ids) > len(answer)  # characters span several tokens
    other = smollm2_tokenizer.encode("🎉", add_special_tokens=False)[0]
    scores = [TokenLogprob(-0.5, ((other, -0.1), (token, -0.5))) for token in ids]
    events, start = [], 0
    for size in [*chunks * len(ids)][: len(ids)]:
        if start >= len(ids):
            break
        part = ids[start : start + size]
        events.append(TokenEvent(tuple(part), None, logprobs=tuple(scores[start : start + size])))
        start += size
    events[-1] = TokenEvent(events[-1].token_ids, "stop", logprobs=events[-1].logprobs)
    backend = ScriptedBackend(events)
    body = {"model": MODEL_ID, "prompt": "Say it", "max_tokens": 64, "logprobs": 2}
    with live_server(backend, smollm2_tokenizer) as url, httpx.Client(base_url=url) as http:
        whole = http.post(COMPLETIONS, json=body).json()["choices"][0]
        with http.stream("POST", COMPLETIONS, json={**body, "stream": True}) as reply:
            lines = [line[6:] for line in reply.iter_lines() if line.startswith("data: {")]
    text, logprobs = whole["text"], whole["logprobs"]
    assert text == answer
    offsets = logprobs["text_offset"]
    # Token i is where the whole characters of the tokens before it end.
    expected = [len(smollm2_tokenizer.decode(ids[:i]).rstrip("\ufffd")) for i in range(len(ids))]
    assert offsets == expected and offsets[-1] < len(text)
    streamed = [json.loads(line)["choices"][0]["logprobs"] for line in lines]
    joined = [o for part in streamed if part for o in part["text_offset"]]
    assert joined == offsets
    for i, top in enumerate(logprobs["top_logprobs"]):
        assert top[logprobs["tokens"][i]] == logprobs["token_logprobs"][i]
