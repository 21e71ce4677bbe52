"""Fill in the middle (stage/frontend/fim.py, infill.py): the model's tokens found
by name, the prompt layouts, cutting to the context, llama.cpp's line limits, and
both routes (``/v1/completions`` with ``suffix`` through the official client, and
``/infill`` in llama.cpp's shape) over a tiny random model whose tokenizer has
Qwen2.5-Coder's FIM tokens."""

from __future__ import annotations

import json
import random
from pathlib import Path

import httpx
import pytest
from conftest import FIM_TOKENS
from frontend_support import (
    MODEL_ID,
    ScriptedBackend,
    TinyModelBackend,
    assert_openai_error,
    live_server,
)
from openai import OpenAI

from stage.frontend.backend import TokenEvent
from stage.frontend.fim import fim_prompt, fim_tokens, fit_to_room
from stage.frontend.llama_api import TextLimits

QWEN_FIM = FIM_TOKENS


def _tokenizer(base: Path, names: list[str]):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base)
    if names:
        tokenizer.add_special_tokens({"additional_special_tokens": names})
    return tokenizer


@pytest.fixture(scope="module")
def coder_tokenizer(fim_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(fim_model_dir)


@pytest.fixture(scope="module")
def coder_model(fim_model_dir) -> Path:
    return fim_model_dir


@pytest.mark.parametrize(
    ("names", "order", "ends"),
    [
        (QWEN_FIM, "psm", 2),
        # SmolLM2's vocabulary (StarCoder's) already has <file_sep>.
        (["<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>"], "psm", 2),
        (["▁<PRE>", "▁<SUF>", "▁<MID>", "▁<EOT>"], "psm", 1),
        (["<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"], "psm", 0),
        (["[PREFIX]", "[SUFFIX]"], "spm", 0),
    ],
)
def test_each_family_s_tokens_are_found_by_name(smollm2_tokenizer_dir, names, order, ends) -> None:
    tokenizer = _tokenizer(smollm2_tokenizer_dir, names)
    fim = fim_tokens(tokenizer)
    assert fim is not None and fim.order == order
    ids = [tokenizer.convert_tokens_to_ids(n) for n in names]
    assert fim.prefix == ids[0]
    # SmolLM2's <|endoftext|> also closes a StarCoder/Qwen middle.
    assert len(fim.ends - {tokenizer.convert_tokens_to_ids("<|endoftext|>")}) == ends
    assert fim.bos is None  # SmolLM2's tokenizer adds no BOS


def test_a_tokenizer_without_fim_tokens_has_none(smollm2_tokenizer_dir) -> None:
    # SmolLM2 has <file_sep> and <repo_name> but no prefix/suffix/middle tokens.
    assert fim_tokens(_tokenizer(smollm2_tokenizer_dir, [])) is None


def test_layouts(smollm2_tokenizer_dir) -> None:
    psm = fim_tokens(_tokenizer(smollm2_tokenizer_dir, QWEN_FIM))
    assert fim_prompt(psm, [10, 11], [20], [30], extra=[40]) == [
        40, psm.prefix, 10, 11, psm.suffix, 20, psm.middle, 30
    ]  # fmt: skip
    spm = fim_tokens(_tokenizer(smollm2_tokenizer_dir, ["[PREFIX]", "[SUFFIX]"]))
    assert fim_prompt(spm, [10], [20, 21], [30]) == [spm.suffix, 20, 21, spm.prefix, 10, 30]


def test_cutting_to_the_room_drops_files_first_then_the_ends_far_from_the_gap() -> None:
    prefix, suffix = list(range(100)), list(range(200, 300))
    files = [[1] * 30, [2] * 30]
    assert fit_to_room(prefix, suffix, files, 260) == (prefix, suffix, files, False)
    assert fit_to_room(prefix, suffix, files, 235) == (prefix, suffix, [[2] * 30], True)
    p, s, f, cut = fit_to_room(prefix, suffix, files, 120)
    # The suffix keeps a quarter of the room (its start), the prefix the rest (its end).
    assert (p, s, f, cut) == (prefix[-90:], suffix[:30], [], True)
    p, s, _, _ = fit_to_room(list(range(10)), suffix, [], 60)
    assert (p, s) == (list(range(10)), suffix[:50])  # a short prefix leaves more room


def _limited(text: str, n_indent: int, chunking: random.Random | None = None) -> tuple[str, bool]:
    limits = TextLimits(n_indent, 0.0, 0.0)
    out, at = "", 0
    while at < len(text) and not limits.ended:
        step = chunking.randint(1, 5) if chunking else len(text)
        out += limits.feed(text[at : at + step], 0.0)
        at += step
    return out + limits.flush(), limits.ended


@pytest.mark.parametrize(
    ("text", "n_indent", "want"),
    [
        ("x = 1\n    y = 2\n  z = 3\n", 4, ("x = 1\n    y = 2\n", True)),
        ("x = 1\n\n    y = 2\nreturn\n", 4, ("x = 1\n\n    y = 2\n", True)),
        ("return x\n    \n", 4, ("return x\n    \n", False)),
        ("a\nb\n", 0, ("a\nb\n", False)),
        ("first line at any indent\n\tok\n", 1, ("first line at any indent\n\tok\n", False)),
    ],
)
def test_n_indent_ends_the_middle_before_a_line_indented_less(text, n_indent, want) -> None:
    assert _limited(text, n_indent) == want
    rng = random.Random(5)
    for _ in range(50):
        assert _limited(text, n_indent, rng) == want


def test_t_max_predict_ends_the_middle_after_a_newline_past_the_deadline() -> None:
    limits = TextLimits(0, 1.0, start_s=0.0)
    assert limits.feed("a = 1", 2.0) == "a = 1" and not limits.ended  # no newline yet
    assert limits.feed("\nb", 2.1) == "\nb" and limits.ended
    early = TextLimits(0, 1.0, start_s=0.0)
    early.feed("a\nb", 0.5)
    assert not early.ended


def test_completions_suffix_lays_out_the_prompt_and_ends_on_fim_tokens(coder_tokenizer) -> None:
    middle = coder_tokenizer.encode("  return a + b", add_special_tokens=False)
    backend = ScriptedBackend([TokenEvent(tuple(middle), "stop")])
    with live_server(backend, coder_tokenizer) as base:
        client = OpenAI(base_url=f"{base}/v1", api_key="x")
        done = client.completions.create(
            model=MODEL_ID, prompt="def add(a, b):\n", suffix="\n\nprint(add(1, 2))\n"
        )
        assert done.choices[0].text == "  return a + b"
        plain = client.completions.create(model=MODEL_ID, prompt="def add(a, b):\n", suffix="")
        assert plain.choices[0].text == "  return a + b"
    fim = fim_tokens(coder_tokenizer)
    encode = coder_tokenizer.encode
    assert list(backend.requests[0].prompt_tokens) == fim_prompt(
        fim, encode("def add(a, b):\n"), encode("\n\nprint(add(1, 2))\n")
    )
    assert fim.ends <= backend.requests[0].stop_token_ids
    # An empty suffix is a plain completion of the prompt.
    assert list(backend.requests[1].prompt_tokens) == encode("def add(a, b):\n")
    assert not fim.ends & backend.requests[1].stop_token_ids - {coder_tokenizer.eos_token_id}


def test_infill_answers_in_llama_cpp_s_shape(coder_tokenizer) -> None:
    text = "    total = 0\n    for x in xs:\n        total += x\nprint(total)\n"
    backend = ScriptedBackend(
        [TokenEvent((t,)) for t in coder_tokenizer.encode(text)] + [TokenEvent((), "stop")]
    )
    body = {
        "input_prefix": "def total(xs):\n",
        "input_suffix": "    return total\n",
        "input_extra": [{"filename": "util.py", "text": "X = 1"}],
        "prompt": "",
        "n_predict": 64,
        "n_indent": 4,
        "cache_prompt": True,
        "samplers": ["top_k", "top_p", "infill"],
        "t_max_prompt_ms": 500,
        "top_k": 40,
        "top_p": 0.99,
        "repeat_penalty": 1.1,
    }
    with live_server(backend, coder_tokenizer) as base:
        answer = httpx.post(f"{base}/infill", json=body, timeout=30).json()
        # Cut before "print(total)": its line is indented less than n_indent.
        assert answer["content"] == "    total = 0\n    for x in xs:\n        total += x\n"
        assert answer["stop"] is True and answer["stop_type"] == "limit"
        assert answer["truncated"] is False and answer["model"] == MODEL_ID
        assert answer["tokens_evaluated"] == len(backend.requests[0].prompt_tokens)
        assert answer["tokens_predicted"] >= 1 and "predicted_ms" in answer["timings"]
        with httpx.stream(
            "POST", f"{base}/infill", json=body | {"stream": True, "n_indent": 0}, timeout=30
        ) as response:
            events = [
                json.loads(line[len("data: ") :])
                for line in response.iter_lines()
                if line.startswith("data: ")
            ]
    assert "".join(e["content"] for e in events) == text
    assert all(e["stop"] is False for e in events[:-1]) and events[-1]["stop"] is True
    assert events[-1]["stop_type"] == "eos"
    fim = fim_tokens(coder_tokenizer)
    encode = coder_tokenizer.encode
    request = backend.requests[0]
    assert list(request.prompt_tokens) == [
        fim.file_sep,
        *encode("util.py\nX = 1\n"),
        fim.prefix,
        *encode("def total(xs):\n"),
        fim.suffix,
        *encode("    return total\n"),
        fim.middle,
    ]
    assert request.max_new_tokens == 64 and request.sampling.repetition_penalty == 1.1
    assert request.sampling.top_k == 40


def test_infill_cuts_a_prompt_longer_than_the_context(coder_tokenizer) -> None:
    backend = ScriptedBackend([TokenEvent((5,), "stop")])  # context 512
    prefix = "".join(f"line_{i} = {i}\n" for i in range(400))
    suffix = "".join(f"after_{i} = {i}\n" for i in range(400))
    with live_server(backend, coder_tokenizer) as base:
        answer = httpx.post(
            f"{base}/infill",
            json={"input_prefix": prefix, "input_suffix": suffix, "n_predict": 32},
            timeout=30,
        ).json()
    assert answer["truncated"] is True
    prompt = list(backend.requests[0].prompt_tokens)
    assert len(prompt) + 32 <= 512
    text = coder_tokenizer.decode(prompt)
    # The text next to the gap is kept: the prefix's end, the suffix's start.
    assert "line_399 = 399\n<|fim_suffix|>after_0 = 0\n" in text
    assert "line_0 = 0\n" not in text


def test_fim_requests_are_refused_clearly(smollm2_tokenizer_dir, coder_tokenizer) -> None:
    plain = _tokenizer(smollm2_tokenizer_dir, [])
    backend = ScriptedBackend([TokenEvent((5,), "stop")])
    with live_server(backend, plain) as base:
        for path, body, param in [
            ("/v1/completions", {"prompt": "a", "suffix": "b"}, "suffix"),
            ("/infill", {"input_prefix": "a", "input_suffix": "b"}, "input_prefix"),
        ]:
            response = httpx.post(f"{base}{path}", json=body, timeout=30)
            error = assert_openai_error(response, 400, param=param)
            assert "fill-in-the-middle" in error["message"]
    with live_server(backend, coder_tokenizer) as base:
        for path, body, param in [
            ("/v1/completions", {"prompt": "a", "suffix": "b", "echo": True}, "suffix"),
            ("/infill", {"input_prefix": "a", "n_predict": 0}, "n_predict"),
            ("/infill", {"input_prefix": "a", "n_predict": -3}, "n_predict"),
            ("/infill", {"input_prefix": "a", "n_predict": 5, "max_tokens": 5}, "n_predict"),
            ("/infill", {"input_prefix": "a", "n": 2}, "n"),
            ("/infill", {"input_prefix": "a", "n_probs": 21}, "n_probs"),
            ("/infill", {"input_prefix": 7}, "input_prefix"),
            ("/infill", {"input_extra": [{"filename": 1}]}, None),
        ]:
            response = httpx.post(f"{base}{path}", json=body, timeout=30)
            assert_openai_error(response, 400, param=param)
    assert backend.requests == []


def test_a_real_model_fills_the_same_through_both_routes(coder_model) -> None:
    """The tiny model's greedy middle is the same from /infill, from /v1/completions
    with ``suffix``, and from the FIM layout sent as token ids."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(coder_model)
    backend = TinyModelBackend(coder_model)
    prefix, suffix = "def add(a, b):\n", "\n\nprint(add(1, 2))\n"
    fim = fim_tokens(tokenizer)
    ids = fim_prompt(fim, tokenizer.encode(prefix), tokenizer.encode(suffix))
    with live_server(backend, tokenizer) as base:
        client = OpenAI(base_url=f"{base}/v1", api_key="x")
        common = dict(model=MODEL_ID, max_tokens=12, temperature=0.0)
        fill = client.completions.create(prompt=prefix, suffix=suffix, **common)
        laid_out = client.completions.create(prompt=ids, **common)
        answer = httpx.post(
            f"{base}/infill",
            json={"input_prefix": prefix, "input_suffix": suffix, "n_predict": 12,
                  "temperature": 0.0},
            timeout=60,
        ).json()  # fmt: skip
    assert fill.choices[0].text == laid_out.choices[0].text == answer["content"]
    assert answer["tokens_predicted"] == fill.usage.completion_tokens
    assert fill.usage.prompt_tokens == len(ids) == answer["tokens_evaluated"]


def test_llama_cpp_s_completion_props_and_template_routes(coder_model) -> None:
    """``/completion`` gives what ``/v1/completions`` gives for the same prompt, with
    llama.cpp's names and its off-valued samplers accepted (its samplers built here
    at any value, those not built refused unless off); ``/props`` and
    ``/apply-template`` answer as llama.cpp clients read them."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(coder_model)
    backend = TinyModelBackend(coder_model)
    llama_cpp_defaults = {
        "typical_p": 1.0, "tfs_z": 1.0, "mirostat": 0, "mirostat_tau": 5.0,
        "mirostat_eta": 0.1, "dynatemp_range": 0.0, "dynatemp_exponent": 1.0,
        "xtc_probability": 0.0, "xtc_threshold": 0.1, "dry_multiplier": 0.0,
        "dry_base": 1.75, "dry_allowed_length": 2, "dry_penalty_last_n": -1,
        "repeat_last_n": 64, "penalize_nl": False, "n_probs": 0, "n_keep": 0,
        "min_keep": 0, "cache_prompt": True, "samplers": ["top_k", "temperature"],
        "seed": -1, "repeat_penalty": 1.0,
    }  # fmt: skip
    with live_server(backend, tokenizer) as base:
        client = OpenAI(base_url=f"{base}/v1", api_key="x")
        want = client.completions.create(
            model=MODEL_ID, prompt="Once upon a time", max_tokens=10, temperature=0.0
        )
        body = {"prompt": "Once upon a time", "n_predict": 10, "temperature": 0.0}
        answer = httpx.post(f"{base}/completion", json=body | llama_cpp_defaults, timeout=60)
        assert answer.status_code == 200, answer.text
        answer = answer.json()
        assert answer["content"] == want.choices[0].text
        assert answer["stop_type"] == "limit" and answer["tokens_predicted"] == 10
        ids = tokenizer.encode("Once upon a time")
        by_ids = httpx.post(f"{base}/completion", json=body | {"prompt": ids}, timeout=60).json()
        assert by_ids["content"] == want.choices[0].text
        with httpx.stream(
            "POST", f"{base}/completion", json=body | {"stream": True}, timeout=60
        ) as response:
            events = [
                json.loads(line[6:]) for line in response.iter_lines() if line[:6] == "data: "
            ]
        assert "".join(e["content"] for e in events) == want.choices[0].text
        assert events[-1]["stop"] is True and events[-1]["tokens_predicted"] == 10
        for name, value in [("mirostat", 2), ("tfs_z", 0.9)]:
            refused = httpx.post(f"{base}/completion", json=body | {name: value}, timeout=30)
            assert "sampler" in assert_openai_error(refused, 400, param=name)["message"]
        built = {"typical_p": 0.9, "dry_multiplier": 0.8, "xtc_probability": 0.5}
        for name, value in built.items():
            sampled = body | {name: value, "temperature": 0.8, "seed": 3}
            accepted = httpx.post(f"{base}/completion", json=sampled, timeout=60)
            assert accepted.status_code == 200, accepted.text
        penalised = body | {"repeat_penalty": 1.3}
        for window in (64, -1, 0):
            answer = httpx.post(
                f"{base}/completion", json=penalised | {"penalty_last_n": window}, timeout=60
            )
            assert answer.status_code == 200, answer.text
        # Window 0 turns the penalties off (llama.cpp's meaning): the plain text.
        assert answer.json()["content"] == want.choices[0].text
        props = httpx.get(f"{base}/props", timeout=30).json()
        assert props["default_generation_settings"]["n_ctx"] == backend.context_length
        # The defaults /props reports, sent back, change nothing.
        defaults = props["default_generation_settings"]["params"]
        echoed = body | defaults | {"temperature": 0.0, "n_predict": 10}
        answer = httpx.post(f"{base}/completion", json=echoed, timeout=60)
        assert answer.status_code == 200, answer.text
        assert answer.json()["content"] == want.choices[0].text
        assert props["chat_template"] == tokenizer.chat_template and props["model_path"] == MODEL_ID
        messages = [{"role": "user", "content": "hi"}]
        rendered = httpx.post(f"{base}/apply-template", json={"messages": messages}, timeout=30)
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert rendered.json() == {"prompt": text}


def test_n_probs_gives_llama_cpp_s_completion_probabilities(coder_model) -> None:
    """``n_probs: N`` on /completion: each token's ``id``, ``token``, ``bytes`` and
    ``logprob`` with N alternatives, the same log-probabilities /v1/completions reports;
    streamed, the events carry their own tokens' entries, the same ones in all."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(coder_model)
    backend = TinyModelBackend(coder_model)
    body = {"prompt": "Once upon a time", "n_predict": 8, "temperature": 0.0, "n_probs": 3}
    with live_server(backend, tokenizer) as base:
        client = OpenAI(base_url=f"{base}/v1", api_key="x")
        want = client.completions.create(
            model=MODEL_ID, prompt=body["prompt"], max_tokens=8, temperature=0.0, logprobs=3
        )
        answer = httpx.post(f"{base}/completion", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        probabilities = answer.json()["completion_probabilities"]
        with httpx.stream(
            "POST", f"{base}/completion", json=body | {"stream": True}, timeout=60
        ) as response:
            events = [
                json.loads(line[6:]) for line in response.iter_lines() if line[:6] == "data: "
            ]
        plain = httpx.post(f"{base}/completion", json=body | {"n_probs": 0}, timeout=60).json()
        too_many = httpx.post(f"{base}/completion", json=body | {"n_probs": 21}, timeout=30)
    logprobs = want.choices[0].logprobs
    assert len(probabilities) == 8
    assert [p["logprob"] for p in probabilities] == pytest.approx(logprobs.token_logprobs)
    assert "".join(p["token"] for p in probabilities) == answer.json()["content"]
    joined = bytes(b for entry in probabilities for b in entry["bytes"])
    assert joined.decode("utf-8", errors="replace") == answer.json()["content"]
    for entry, top in zip(probabilities, logprobs.top_logprobs, strict=True):
        assert tokenizer.decode([entry["id"]]) == entry["token"]
        assert len(entry["top_logprobs"]) == 3
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx(list(top.values()))
    streamed = [p for event in events for p in event.get("completion_probabilities", [])]
    assert streamed == probabilities
    assert "completion_probabilities" not in plain
    assert too_many.status_code == 400


def test_infill_tokenizes_only_the_text_it_can_keep(coder_tokenizer, monkeypatch) -> None:
    """Megabytes around the cursor: only text within twice the context's reach of the
    gap is tokenized, files that cannot fit (and the files before them) not at all,
    and the prompt is the one the text near the gap alone gives."""
    from stage.frontend.prepare import longest_token_chars

    backend = ScriptedBackend([TokenEvent((5,), "stop")])  # context 512
    reach = 2 * 512 * longest_token_chars(coder_tokenizer)
    lines = 3 * reach // 12
    small_file = {"filename": "util.py", "text": "X = 1"}
    near = {
        "input_prefix": "".join(f"line_{i} = {i}\n" for i in range(lines - 2000, lines)),
        "input_suffix": "".join(f"after_{i} = {i}\n" for i in range(2000)),
        "n_predict": 32,
    }
    whole = near | {
        "input_prefix": "".join(f"line_{i} = {i}\n" for i in range(lines)),
        "input_suffix": "".join(f"after_{i} = {i}\n" for i in range(lines)),
    }
    short = {"input_prefix": "def f():\n", "input_suffix": "    return X\n", "n_predict": 32}
    files = short | {"input_extra": [{"filename": "big.py", "text": "y = 2\n" * reach}, small_file]}
    read: list[int] = []
    real = type(coder_tokenizer).encode

    def encode(self, text, *args, **kwargs):
        read.append(len(text))
        return real(self, text, *args, **kwargs)

    monkeypatch.setattr(type(coder_tokenizer), "encode", encode)
    bodies = [whole, near, files, short | {"input_extra": [small_file]}]
    with live_server(backend, coder_tokenizer) as base:
        answers = [httpx.post(f"{base}/infill", json=body, timeout=60).json() for body in bodies]
    assert max(read) <= reach
    assert [a["truncated"] for a in answers] == [True, True, True, False]
    prompts = [r.prompt_tokens for r in backend.requests]
    assert prompts[0] == prompts[1]
    assert prompts[2] == prompts[3] and "util.py" in coder_tokenizer.decode(prompts[2])
