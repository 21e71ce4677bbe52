"""The OpenAI frontend of stage 0 over a real 2-stage mesh, with the openai client."""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import openai
import pytest
from openai import OpenAI

from coordinator.localmesh import MeshProcesses, wait_for

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory, tiny_package_factory):
    package = tiny_package_factory("llama", layers=6)
    processes = MeshProcesses(
        package, tmp_path_factory.mktemp("serving"), 2, max_sessions=8, max_queued=2
    )
    try:
        processes.start().wait_serving()
        yield processes
    finally:
        processes.close()


@pytest.fixture(scope="module")
def client(mesh: MeshProcesses) -> OpenAI:
    return OpenAI(base_url=mesh.http_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def chat(client: OpenAI, content: str, **kwargs) -> openai.types.chat.ChatCompletion:
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], **kwargs
    )


def sessions_freed(mesh: MeshProcesses) -> None:
    wait_for(
        lambda: all(s.active_sessions == 0 for s in mesh.status().stages if s.assigned),
        15,
        "every stage to free its sessions",
    )


def test_chat_and_completions_with_usage_and_timings(client: OpenAI, mesh: MeshProcesses):
    reply = chat(client, "Say hello.", max_tokens=8, temperature=0)
    assert reply.model == MODEL
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 8
    assert reply.usage.prompt_tokens > 5
    timings = reply.model_extra["timings"]
    assert timings["predicted_n"] == 8 and timings["prompt_n"] == reply.usage.prompt_tokens
    completion = client.completions.create(
        model=MODEL, prompt="The weather today", max_tokens=6, temperature=0
    )
    assert completion.usage.completion_tokens == 6
    assert completion.choices[0].text
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    # The fingerprint names the served package and is the same on every answer.
    from mesh.package.manifest import PackageManifest

    fingerprint = "fp_" + PackageManifest.load(mesh.package).sha256()[:12]
    assert reply.system_fingerprint == completion.system_fingerprint == fingerprint


def test_llama_cpp_s_completion_route_serves_what_completions_serves(client, mesh):
    want = client.completions.create(model=MODEL, prompt="Once", max_tokens=7, temperature=0)
    body = {"prompt": "Once", "n_predict": 7, "temperature": 0.0, "cache_prompt": True}
    answer = httpx.post(mesh.http_url + "/completion", json=body, timeout=60).json()
    assert answer["content"] == want.choices[0].text and answer["tokens_predicted"] == 7
    assert answer["timings"]["predicted_n"] == 7
    # The test package's tokenizer (SmolLM2's) has no fill-in-the-middle tokens.
    refused = httpx.post(mesh.http_url + "/infill", json={"input_prefix": "x"}, timeout=30)
    assert refused.status_code == 400 and "fill-in-the-middle" in refused.text


def test_streaming_matches_non_streaming_and_reports_usage(client: OpenAI):
    plain = chat(client, "Count to five.", max_tokens=10, temperature=0)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Count to five."}],
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, usage, finish = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(pieces) == plain.choices[0].message.content
    assert usage is not None and usage.completion_tokens == 10
    assert finish == "length"


def test_stop_strings_cut_the_text(client: OpenAI):
    def complete(**kwargs):
        return client.completions.create(
            model=MODEL, prompt="Hello", max_tokens=24, temperature=0, **kwargs
        )

    text = complete().choices[0].text
    starts = [i for i in range(len(text) // 3, len(text) - 3) if not text[i : i + 3].isspace()]
    assert starts, f"the greedy text is expected to have visible characters: {text!r}"
    stop = text[starts[0] : starts[0] + 3]
    cut = complete(stop=[stop, "\x00zz"])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]


def test_seed_reproducibility(client: OpenAI):
    first = chat(client, "Pick a word.", max_tokens=12, temperature=0.9, seed=1234)
    again = chat(client, "Pick a word.", max_tokens=12, temperature=0.9, seed=1234)
    other = chat(client, "Pick a word.", max_tokens=12, temperature=0.9, seed=99)
    assert first.choices[0].message.content == again.choices[0].message.content
    assert first.choices[0].message.content != other.choices[0].message.content


def test_concurrent_requests_get_the_tokens_they_get_alone(client: OpenAI, mesh):
    prompts = [f"Question number {i}: what is {i} plus {i}?" for i in range(8)]
    alone = [
        chat(client, p, max_tokens=16, temperature=0.7, seed=i).choices[0].message.content
        for i, p in enumerate(prompts)
    ]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        together = list(
            pool.map(
                lambda ip: (
                    chat(client, ip[1], max_tokens=16, temperature=0.7, seed=ip[0])
                    .choices[0]
                    .message.content
                ),
                enumerate(prompts),
            )
        )
    assert together == alone
    sessions_freed(mesh)


def test_n_choices_each_get_what_one_request_with_its_seed_gets(client: OpenAI, mesh):
    # Choice i of a request with seed s is the answer to the same request with seed s + i.
    content = "Name a fruit and a color."
    many = chat(client, content, max_tokens=12, temperature=0.9, seed=40, n=3)
    alone = [chat(client, content, max_tokens=12, temperature=0.9, seed=40 + i) for i in range(3)]
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert [c.message.content for c in many.choices] == [
        a.choices[0].message.content for a in alone
    ]
    assert len({c.message.content for c in many.choices}) > 1
    assert many.usage.prompt_tokens == alone[0].usage.prompt_tokens
    assert many.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    # Greedy choices are all the one greedy answer; completions take n too.
    greedy = client.completions.create(
        model=MODEL, prompt="The river", max_tokens=8, temperature=0, n=4
    )
    single = client.completions.create(model=MODEL, prompt="The river", max_tokens=8, temperature=0)
    assert [c.text for c in greedy.choices] == [single.choices[0].text] * 4
    sessions_freed(mesh)


def test_streamed_choices_interleave_and_match_the_answer(client: OpenAI, mesh):
    args = {"max_tokens": 10, "temperature": 0.8, "seed": 7, "n": 3}
    whole = chat(client, "Tell me a short fact.", **args)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me a short fact."}],
        stream=True,
        stream_options={"include_usage": True},
        **args,
    )
    texts, finishes, usage = ["", "", ""], [None, None, None], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    assert texts == [c.message.content for c in whole.choices]
    assert finishes == [c.finish_reason for c in whole.choices]
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens
    # A client that leaves a stream of several choices frees every one of them.
    # More choices than the mesh ever admits (8 sessions and 2 queued): a 400 that
    # says so, since no retry would get it in.
    url = mesh.http_url + "/v1/completions"
    never = {"model": MODEL, "prompt": "Once", "max_tokens": 50, "n": 16}
    refused = httpx.post(url, json=never, timeout=60)
    assert refused.status_code == 400 and "at most 10" in refused.json()["error"]["message"]
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 300, "stream": True, "n": 3}
    with httpx.stream("POST", url, json=body, timeout=60) as reply:
        lines = reply.iter_lines()
        assert any(next(lines).startswith("data: ") for _ in range(8))
        # 10 choices fit an idle mesh, not one running these 3: a 429, and the
        # choices that were admitted are freed again.
        busy = httpx.post(url, json={**never, "n": 10}, timeout=60)
        assert busy.status_code == 429 and busy.json()["error"]["message"]
    sessions_freed(mesh)


def error_of(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"}
    assert {"message", "type", "param", "code"} <= set(body["error"])
    assert body["error"]["message"]
    return body["error"]


def test_bad_input_gets_openai_errors_and_nothing_is_lost(mesh, client: OpenAI):
    url = mesh.http_url + "/v1/chat/completions"
    good = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    cases = [
        (b"{not json", 400),
        (json.dumps({**good, "temperature": -1}).encode(), 400),
        (json.dumps({**good, "max_tokens": "many"}).encode(), 400),
        (json.dumps({**good, "n": 17}).encode(), 400),
        (json.dumps({**good, "messages": []}).encode(), 400),
        (json.dumps({**good, "model": "no-such-model"}).encode(), 404),
        (json.dumps({k: v for k, v in good.items() if k != "messages"}).encode(), 400),
    ]
    for body, status in cases:
        response = httpx.post(url, content=body, headers={"content-type": "application/json"})
        assert response.status_code == status, (body, response.text)
        error_of(response)
    too_long = httpx.post(
        mesh.http_url + "/v1/completions",
        json={"model": MODEL, "prompt": [5] * 600, "max_tokens": 4},
    )
    assert too_long.status_code == 400
    assert error_of(too_long)["code"] == "context_length_exceeded"
    # Everything still serves.
    assert chat(client, "still there?", max_tokens=3).usage.completion_tokens == 3


UNFOLLOWABLE = [
    {"$ref": "#"},
    {"type": "string", "pattern": "^a{1000000}$"},
    {
        "$defs": {
            "n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}
        },
        "$ref": "#/$defs/n",
    },
]


def test_grammars_the_library_cannot_follow_get_400_before_anything_streams(mesh, client):
    """Schemas and grammars that compile but that the grammar library cannot follow
    with the model's tokenizer (a schema that is only a reference to itself, a
    repeat too large to build, no finite instance) are the request's 400, streamed
    or not; a forced tool call with such parameters falls back to any JSON object."""
    url = mesh.http_url + "/v1/chat/completions"
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    for schema in UNFOLLOWABLE:
        form = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        for stream in (False, True):
            response = httpx.post(url, json={**ask, "response_format": form, "stream": stream})
            assert response.status_code == 400, (schema, stream, response.text)
            assert "cannot be followed" in error_of(response)["message"]
    lark = httpx.post(
        mesh.http_url + "/v1/completions",
        json={
            "model": MODEL,
            "prompt": "a",
            "max_tokens": 4,
            "guided_grammar": 'start: "a"{1000000}',
        },
    )
    assert lark.status_code == 400, lark.text
    tool = {"type": "function", "function": {"name": "f", "parameters": {"$ref": "#"}}}
    forced = httpx.post(
        url, json={**ask, "max_tokens": 24, "tools": [tool], "tool_choice": "required"}
    )
    assert forced.status_code == 200, forced.text
    assert chat(client, "still there?", max_tokens=3).usage.completion_tokens == 3


def test_session_limit_gives_429_with_retry_after(mesh, client: OpenAI):
    def long_request(index: int) -> int:
        response = httpx.post(
            mesh.http_url + "/v1/completions",
            json={"model": MODEL, "prompt": f"story {index}", "max_tokens": 300},
            timeout=120,
        )
        if response.status_code == 429:
            assert int(response.headers["retry-after"]) >= 1
            assert error_of(response)["type"]
        return response.status_code

    with concurrent.futures.ThreadPoolExecutor(14) as pool:
        codes = list(pool.map(long_request, range(14)))
    assert codes.count(429) >= 1
    assert set(codes) <= {200, 429}
    sessions_freed(mesh)


def test_client_disconnect_frees_sessions_on_every_stage(mesh):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "stream": True}
    with httpx.stream("POST", mesh.http_url + "/v1/completions", json=body, timeout=60) as reply:
        lines = reply.iter_lines()
        received = [next(lines) for _ in range(6)]
    assert any(line.startswith("data: ") for line in received)
    sessions_freed(mesh)


def test_lost_stage_request_resumes_on_the_reloaded_pipeline(mesh, client: OpenAI):
    before = client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, temperature=0)
    last = max((s for s in mesh.status().stages if s.assigned), key=lambda s: s.stage_index)
    term = mesh.status().term
    mesh.kill_stage(last.node_id)
    # Admitted while the loss is not yet noticed, this request waits for the mesh to
    # be planned again and finishes with the same greedy text.
    after = client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, temperature=0)
    assert after.choices[0].text == before.choices[0].text
    assert mesh.status().term > term


def test_not_ready_gives_503_then_serves(tmp_path, tiny_package_factory):
    package = tiny_package_factory("llama", layers=6)
    processes = MeshProcesses(package, tmp_path / "late", 2)
    try:
        processes.start_stage("stage-0", frontend=True)
        url = wait_for(lambda: _frontend_url(processes), 60, "stage 0 to report its frontend")
        health = httpx.get(url + "/health")
        assert health.status_code == 503
        # The shape of the loaded app's /health, whatever makes it unavailable.
        assert health.json()["status"] == "unavailable" and health.json()["reason"]
        response = httpx.post(
            url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}
        )
        assert response.status_code == 503
        assert int(response.headers["retry-after"]) >= 1
        error_of(response)
        processes.start_stage("stage-1")
        processes.wait_serving()
        assert httpx.get(url + "/health").status_code == 200
    finally:
        processes.close()


def _frontend_url(processes: MeshProcesses) -> str | None:
    for stage in processes.status().stages:
        if stage.node_id == "stage-0":
            return processes.status().http_url or None
    return None


def test_health(mesh):
    assert httpx.get(mesh.http_url + "/health").status_code == 200
    metrics = httpx.get(mesh.http_url + "/metrics").text
    assert "mesh_stage_compute_seconds_bucket" in metrics
    assert "mesh_sessions_active" in metrics


def reference_embedding(model_dir, ids: list[int]) -> list[float]:
    """The unsplit model's final hidden state (after its last norm), averaged over
    the positions and scaled to length 1."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        hidden = model.model(torch.tensor([ids]), use_cache=False).last_hidden_state[0]
    mean = hidden.float().mean(dim=0)
    return (mean / mean.norm()).tolist()


def test_embeddings_equal_the_unsplit_models_and_chats_beside_them_keep_their_text(
    client: OpenAI, mesh, tiny_model_factory
):
    model_dir = tiny_model_factory("llama", layers=6)
    inputs = [[5, 17, 99, 3, 250, 8], list(range(40, 340)), [7]]
    # The official client asks for base64 and decodes it.
    reply = client.embeddings.create(model=MODEL, input=inputs)
    assert reply.model == MODEL and [d.index for d in reply.data] == [0, 1, 2]
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == sum(map(len, inputs))
    for item, ids in zip(reply.data, inputs, strict=True):
        want = reference_embedding(model_dir, ids)
        assert len(item.embedding) == len(want)
        assert max(abs(a - b) for a, b in zip(item.embedding, want, strict=True)) < 1e-4
    # Text and its token ids give the same vector; floats as asked.
    text = "The quick brown fox jumps over the lazy dog."
    ids = httpx.post(mesh.http_url + "/tokenize", json={"prompt": text}).json()["tokens"]
    as_text = client.embeddings.create(model=MODEL, input=text, encoding_format="float")
    as_ids = client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    assert as_text.data[0].embedding == pytest.approx(as_ids.data[0].embedding, abs=1e-5)
    # More inputs than the server runs at once, while chats run beside them.
    prompts = [f"Tell me about the number {i}." for i in range(4)]
    alone = [
        chat(client, p, max_tokens=12, temperature=0).choices[0].message.content for p in prompts
    ]
    many = [[(11 * i + j) % 900 + 1 for j in range(20 + i)] for i in range(14)]
    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        chats = [
            pool.submit(lambda p: chat(client, p, max_tokens=12, temperature=0), p) for p in prompts
        ]
        batch = pool.submit(client.embeddings.create, model=MODEL, input=many)
        together = [c.result().choices[0].message.content for c in chats]
        vectors = batch.result().data
    assert together == alone
    assert len(vectors) == 14
    for item, ids in zip(vectors[:3], many[:3], strict=True):
        want = reference_embedding(model_dir, ids)
        assert max(abs(a - b) for a, b in zip(item.embedding, want, strict=True)) < 1e-4
    sessions_freed(mesh)


def test_bad_embedding_requests_get_openai_errors_and_nothing_is_lost(mesh, client: OpenAI):
    url = mesh.http_url + "/v1/embeddings"
    cases = [
        ({"model": MODEL, "input": ""}, "input"),
        ({"model": MODEL, "input": []}, "input"),
        ({"model": MODEL, "input": [[]]}, "input"),
        ({"model": MODEL, "input": [5] * 600}, "input"),
        ({"model": MODEL, "input": [10**9]}, "input"),
        ({"model": MODEL, "input": "hi", "dimensions": 3}, "dimensions"),
        ({"model": MODEL, "input": "hi", "encoding_format": "int8"}, "encoding_format"),
        ({"model": MODEL, "input": "hi", "pooling": "max"}, "pooling"),
        ({"model": MODEL, "input": 42}, "input"),
        ({"input": "hi", "model": "no-such-model"}, "model"),
    ]
    for body, param in cases:
        response = httpx.post(url, json=body)
        assert response.status_code in (400, 404), (body, response.text)
        assert error_of(response)["param"] == param, (body, response.text)
    assert error_of(httpx.post(url, json={"input": [5] * 600}))["code"] == (
        "context_length_exceeded"
    )
    size = len(client.embeddings.create(model=MODEL, input="hi").data[0].embedding)
    exact = client.embeddings.create(model=MODEL, input="hi", dimensions=size)
    assert len(exact.data[0].embedding) == size
    assert chat(client, "still there?", max_tokens=3).usage.completion_tokens == 3
    sessions_freed(mesh)
