"""Speculative decoding through a real 2-stage mesh changes no token.

Every mesh serves the same tiny Llama package; a baseline mesh runs with speculation
off, and each other mesh runs one speculation setting (draft model identical to the
target, a random draft, n-gram, composite, an unresolvable draft). Its replies must
equal the baseline's: greedy text, the seeded text at temperature 0.8, the stop at
EOS, ``max_tokens`` and stop strings, all inside verify windows.

The random tiny model never emits EOS by itself, so the target is edited: its EOS
row (tied embedding and LM head) becomes 1.001x the row of a token X that the greedy
continuation of ``EOS_PROMPT`` first produces a few tokens in, so that EOS wins
wherever X would have, and that continuation ends at EOS inside the first window.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from coordinator.localmesh import MeshProcesses, wait_for

MODEL = "tiny-llama"
EOS_PROMPT = "Hello there"
PROMPTS = (
    "a b c a b c a b c a b c",
    "def add(x, y):\n    return x + y\n\ndef add(x, y):\n",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "Once upon a time",
)
NEW_TOKENS = 24
# Stage 0's speculation counter families (names without ``_total``) by short name.
SPECULATION_COUNTERS = {
    "mesh_speculation_drafted_tokens": "drafted",
    "mesh_speculation_accepted_tokens": "accepted",
    "mesh_speculation_windows": "windows",
    "mesh_speculation_rounds": "rounds",
    "mesh_speculation_emitted_tokens": "emitted",
}


def fixed(window: int) -> tuple[str, ...]:
    w = str(window)
    return ("--window-policy", "fixed", "--initial-window", w, "--min-window", w, "--max-window", w)


def greedy_continuation(model, prompt: list[int], steps: int) -> list[int]:
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt) :]


@pytest.fixture(scope="module")
def target_dir(tiny_model_factory, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama (seed 0) edited so that its greedy continuation of EOS_PROMPT
    stops with EOS between the 3rd and 8th generated token (see the module doc)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = tiny_model_factory("llama", layers=6, seed=0)
    tokenizer = AutoTokenizer.from_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    eos = tokenizer.eos_token_id
    prompt = tokenizer.encode(EOS_PROMPT)
    before = greedy_continuation(model, prompt, 8)
    index = next(i for i in range(2, 8) if before[i] not in before[:i] and before[i] != eos)
    embeddings = model.get_input_embeddings().weight
    assert model.get_output_embeddings().weight.data_ptr() == embeddings.data_ptr()
    with torch.no_grad():
        embeddings[eos] = embeddings[before[index]] * 1.001
    after = greedy_continuation(model, prompt, 8)
    assert after[: index + 1] == [*before[:index], eos], (before, after)
    out = tmp_path_factory.mktemp("spec-target")
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def package(target_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mesh.package.builder import build_package

    out = tmp_path_factory.mktemp("spec-package") / "pkg"
    build_package(str(target_dir), out, dtype="float32", model_id=MODEL)
    return out


class Served:
    """A running mesh and the request helpers the tests use."""

    def __init__(self, processes: MeshProcesses) -> None:
        self.processes = processes
        self.url = processes.http_url
        self._cache: dict[tuple, dict] = {}

    def complete(self, prompt: str, **params) -> dict:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0}
        reply = httpx.post(self.url + "/v1/completions", json={**body, **params}, timeout=120)
        assert reply.status_code == 200, reply.text
        return reply.json()

    def cached(self, prompt: str, **params) -> dict:
        key = (prompt, tuple(sorted((k, str(v)) for k, v in params.items())))
        if key not in self._cache:
            self._cache[key] = self.complete(prompt, **params)
        return self._cache[key]

    def counters(self) -> dict[tuple[str, str], float]:
        """Stage 0's speculation counters by (strategy, counter), summed over drafters."""
        text = httpx.get(self.url + "/metrics", timeout=30).text
        counters: dict[tuple[str, str], float] = {}
        for family in text_string_to_metric_families(text):
            counter = SPECULATION_COUNTERS.get(family.name)
            for sample in family.samples if counter else ():
                key = (sample.labels["strategy"], counter)
                counters[key] = counters.get(key, 0.0) + sample.value
        return counters

    def stage0_log(self) -> str:
        return self.processes.stage_log("stage-0")


@contextmanager
def serving(
    package: Path, workdir: Path, *stage0_args: str, stage_args: tuple[str, ...] = ()
) -> Iterator[Served]:
    processes = MeshProcesses(
        package,
        workdir,
        2,
        max_sessions=4,
        max_queued=4,
        stage0_args=stage0_args,
        stage_args=stage_args,
    )
    try:
        processes.start().wait_serving()
        yield Served(processes)
    finally:
        processes.close()


@pytest.fixture(scope="module")
def baseline(package: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with serving(package, tmp_path_factory.mktemp("baseline"), "--spec-type", "none") as mesh:
        yield mesh


def same_reply(reply: dict, reference: dict) -> None:
    """The same completion: text, finish reason and token count."""
    got, want = reply["choices"][0], reference["choices"][0]
    assert (got["text"], got["finish_reason"]) == (want["text"], want["finish_reason"])
    assert reply["usage"]["completion_tokens"] == reference["usage"]["completion_tokens"]


def assert_equivalent(mesh: Served, baseline: Served, prompts=PROMPTS) -> list[dict]:
    """Greedy and seeded (temperature 0.8) replies equal the baseline's; returns the
    greedy replies."""
    greedy = []
    for prompt in prompts:
        reply = mesh.complete(prompt)
        same_reply(reply, baseline.cached(prompt))
        greedy.append(reply)
    for seed, prompt in enumerate(prompts[:2]):
        params = {"temperature": 0.8, "seed": 1000 + seed}
        same_reply(mesh.complete(prompt, **params), baseline.cached(prompt, **params))
    return greedy


def timings_of(reply: dict) -> dict:
    return reply["timings"]


# A schema whose every document is short: the grammar must end it, so a reply to it
# stops on its own (EOS) well within STRUCTURED_TOKENS.
CARD_SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"type": "string", "enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "size": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["color", "ok", "size", "tags"],
    "additionalProperties": False,
}
CARD_FORMAT = {"type": "json_schema", "json_schema": {"name": "card", "schema": CARD_SCHEMA}}
STRUCTURED_TOKENS = 60
COLORS = ["red", "green", "light blue", "dark blue"]
WORDS = r"[a-z]{1,6}( [a-z]{1,6}){0,3}\."
SUM_GBNF = 'root ::= num " + " num " = " num\nnum ::= [0-9] | [1-9] [0-9]'


def assert_card(text: str) -> None:
    value = json.loads(text)
    assert list(value) == ["color", "ok", "size", "tags"], value
    assert value["color"] in {"red", "green", "blue"} and isinstance(value["ok"], bool)
    assert type(value["size"]) is int and 0 <= value["size"] <= 99
    assert len(value["tags"]) <= 2 and set(value["tags"]) <= {"a", "b"}


def assert_structured_equivalent(mesh: Served, baseline: Served) -> list[dict]:
    """response_format replies (greedy and seeded) equal the baseline's, and the
    schema's replies follow it; returns the greedy schema replies."""
    greedy = []
    for form in (CARD_FORMAT, {"type": "json_object"}):
        for prompt in PROMPTS[2:]:
            for params in ({}, {"temperature": 0.8, "seed": 77}):
                params = {**params, "response_format": form, "max_tokens": STRUCTURED_TOKENS}
                reply = mesh.complete(prompt, **params)
                same_reply(reply, baseline.cached(prompt, **params))
                text = reply["choices"][0]["text"]
                if form is CARD_FORMAT:
                    assert reply["choices"][0]["finish_reason"] == "stop"
                    assert_card(text)
                    greedy += [reply] if not params.get("seed") else []
                else:
                    assert text.startswith("{")
    # vLLM's and llama.cpp's constraints (extensions): a choice, a regex, a GBNF grammar.
    for constraint, matches in (
        ({"guided_choice": COLORS}, lambda text: text in COLORS),
        ({"structured_outputs": {"regex": WORDS}}, lambda text: re.fullmatch(WORDS, text)),
        ({"grammar": SUM_GBNF}, lambda text: re.fullmatch(r"\d+ \+ \d+ = \d+", text)),
    ):
        for params in ({}, {"temperature": 0.8, "seed": 78}):
            params = {**params, **constraint, "max_tokens": STRUCTURED_TOKENS}
            reply = mesh.complete(PROMPTS[2], **params)
            same_reply(reply, baseline.cached(PROMPTS[2], **params))
            choice = reply["choices"][0]
            assert choice["finish_reason"] == "stop" and matches(choice["text"]), choice
    return greedy


class TestIdenticalDraft:
    """Draft model == target, window 8: every draft token is accepted."""

    @pytest.fixture(scope="class")
    @classmethod
    def mesh(cls, package, target_dir, tmp_path_factory) -> Iterator[Served]:
        args = ("--spec-type", "draft-model", "--draft-model", str(target_dir), *fixed(8))
        with serving(package, tmp_path_factory.mktemp("same-draft"), *args) as mesh:
            yield mesh

    def test_greedy_and_seeded_replies_equal_the_baseline(self, mesh, baseline):
        for reply in assert_equivalent(mesh, baseline):
            timings = timings_of(reply)
            assert timings["drafted"] > 0
            assert timings["accept_rate"] == 1.0
            assert timings["accepted"] == timings["drafted"]
            assert timings["tokens_per_round"] > 1.0
            # Windows of 8 drafts plus the bonus token: 23 decode tokens in 3 rounds.
            assert timings["windows"] <= 3

    def test_structured_output_equals_the_baseline(self, mesh, baseline):
        # The draft model knows no grammar: the drafts it proposes where the
        # grammar wants something else are rejected, and the text is unchanged.
        for reply in assert_structured_equivalent(mesh, baseline):
            timings = timings_of(reply)
            assert timings["drafted"] > timings["accepted"]

    def test_eos_inside_a_window_stops_exactly(self, mesh, baseline):
        reference = baseline.cached(EOS_PROMPT)
        assert reference["choices"][0]["finish_reason"] == "stop"
        assert 2 <= reference["usage"]["completion_tokens"] < 9
        reply = mesh.complete(EOS_PROMPT)
        same_reply(reply, reference)
        # The EOS came out of a verify window, whose drafts end at the EOS: the first
        # token came with the prompt, the window held the rest and the EOS, and no
        # draft after it (rows of text the request never gets).
        timings = timings_of(reply)
        assert timings["windows"] == 1
        assert timings["drafted"] == reply["usage"]["completion_tokens"] < 8

    def test_max_tokens_below_the_window(self, mesh, baseline):
        for max_tokens in (1, 2, 5):
            reply = mesh.complete(PROMPTS[0], max_tokens=max_tokens)
            assert reply["usage"]["completion_tokens"] == max_tokens
            assert reply["choices"][0]["finish_reason"] == "length"
            same_reply(reply, baseline.cached(PROMPTS[0], max_tokens=max_tokens))
            # The window shrinks to fit: never more drafts than tokens left minus one.
            assert timings_of(reply).get("drafted", 0) == max(0, max_tokens - 2)

    def test_stop_string_inside_a_window(self, mesh, baseline):
        prompt = PROMPTS[3]
        text = baseline.cached(prompt)["choices"][0]["text"]
        starts = [i for i in range(4, len(text) - 3) if not text[i : i + 3].isspace()]
        assert starts, f"the greedy text is expected to have visible characters: {text!r}"
        stop = text[starts[0] : starts[0] + 3]
        reply = mesh.complete(prompt, stop=[stop])
        assert reply["choices"][0]["finish_reason"] == "stop"
        assert reply["choices"][0]["text"] == text[: text.index(stop)]
        same_reply(reply, baseline.cached(prompt, stop=[stop]))

    def test_logprobs_of_accepted_drafts_come_from_the_verify_pass(self, mesh, baseline):
        """Every token of a verify window carries its log-probability, equal (up to
        float rounding between a window's rows and single rows) to plain decoding's."""
        for prompt in PROMPTS[:2]:
            reply = mesh.complete(prompt, logprobs=3)
            reference = baseline.cached(prompt, logprobs=3)
            same_reply(reply, reference)
            got, want = reply["choices"][0]["logprobs"], reference["choices"][0]["logprobs"]
            assert got["tokens"] == want["tokens"] and len(got["tokens"]) == NEW_TOKENS
            assert got["token_logprobs"] == pytest.approx(want["token_logprobs"], abs=1e-4)
            assert timings_of(reply)["accepted"] > 0

    def test_request_log_line_and_metrics(self, mesh):
        before = mesh.counters()
        reply = mesh.complete(PROMPTS[1], max_tokens=12)
        timings = timings_of(reply)
        line = wait_for(
            lambda: next(
                (
                    ln
                    for ln in mesh.stage0_log().splitlines()
                    if f"request {reply['id']} done" in ln
                ),
                None,
            ),
            10,
            "the request's log line",
        )
        assert "12 generated" in line
        assert f"draft-model: drafted {timings['drafted']} accepted {timings['accepted']}" in line
        assert "rate 1.00" in line and f"windows {timings['windows']}" in line
        after = mesh.counters()
        for counter in ("drafted", "accepted", "windows"):
            key = ("draft-model", counter)
            assert after[key] - before.get(key, 0.0) == timings[counter]
        assert {strategy for strategy, _ in after} == {"draft-model"}


class TestRandomDraft:
    """A draft of another seed, window 3: nearly every draft is rejected."""

    @pytest.fixture(scope="class")
    @classmethod
    def mesh(cls, package, tiny_model_factory, tmp_path_factory) -> Iterator[Served]:
        draft = tiny_model_factory("llama", layers=6, seed=1)
        args = ("--spec-type", "draft-model", "--draft-model", str(draft), *fixed(3))
        with serving(package, tmp_path_factory.mktemp("random-draft"), *args) as mesh:
            yield mesh

    def test_rejected_drafts_change_nothing(self, mesh, baseline):
        replies = assert_equivalent(mesh, baseline, (*PROMPTS, EOS_PROMPT))
        drafted = sum(timings_of(r)["drafted"] for r in replies)
        accepted = sum(timings_of(r)["accepted"] for r in replies)
        # Each 24-token reply takes about 22 windows (the last ones shrink to fit).
        assert drafted >= 3 * 60
        assert accepted <= 0.1 * drafted


class TestPipelinedWindows:
    """Draft model == target, 15 ms on every hop: the depth rule keeps several windows
    in flight; at temperature 0.8 the greedy drafts are often refuted, so windows
    drafted ahead are dropped by the last stage. Text identical either way."""

    @pytest.fixture(scope="class")
    @classmethod
    def mesh(cls, package, target_dir, tmp_path_factory) -> Iterator[Served]:
        args = ("--spec-type", "draft-model", "--draft-model", str(target_dir), *fixed(3))
        delay = ("--inject-delay-ms", "15")
        with serving(package, tmp_path_factory.mktemp("ahead"), *args, stage_args=delay) as mesh:
            yield mesh

    def test_windows_drafted_ahead_change_nothing(self, mesh, baseline):
        greedy = assert_equivalent(mesh, baseline)
        ahead = [timings_of(r).get("windows_ahead", 0) for r in greedy]
        assert max(ahead) > 0, "no window was drafted ahead"
        assert max(timings_of(r).get("depth", 1) for r in greedy) > 1
        for reply in greedy:
            assert timings_of(reply).get("windows_dropped", 0) == 0  # sure drafts
        for prompt in PROMPTS:
            for seed in (7, 8):
                params = {"temperature": 0.8, "seed": seed}
                same_reply(mesh.complete(prompt, **params), baseline.cached(prompt, **params))
        text = httpx.get(mesh.url + "/metrics", timeout=30).text
        values = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }
        sent = values[("mesh_verify_windows_ahead_total", (("outcome", "sent"),))]
        assert sent > 0

    def test_stops_inside_windows_in_flight(self, mesh, baseline):
        for max_tokens in (1, 2, 5):
            same_reply(
                mesh.complete(PROMPTS[0], max_tokens=max_tokens),
                baseline.cached(PROMPTS[0], max_tokens=max_tokens),
            )
        params = {"stop": [baseline.cached(PROMPTS[2])["choices"][0]["text"][6:9]]}
        same_reply(mesh.complete(PROMPTS[2], **params), baseline.cached(PROMPTS[2], **params))
        reply = mesh.complete(EOS_PROMPT)
        same_reply(reply, baseline.cached(EOS_PROMPT))


class TestNgram:
    """Prompt lookup with auto gating off, window 1."""

    @pytest.fixture(scope="class")
    @classmethod
    def mesh(cls, package, tmp_path_factory) -> Iterator[Served]:
        args = ("--spec-type", "ngram", "--no-spec-auto", *fixed(1))
        with serving(package, tmp_path_factory.mktemp("ngram"), *args) as mesh:
            yield mesh

    def test_ngram_windows_change_nothing(self, mesh, baseline):
        replies = assert_equivalent(mesh, baseline)
        repeating = timings_of(replies[0])
        assert repeating["drafted"] > 0 and repeating["drafted"] == repeating["windows"]
        assert repeating["accepted"] > 0
        assert ("ngram", "drafted") in mesh.counters()

    def test_structured_output_equals_the_baseline(self, mesh, baseline):
        assert_structured_equivalent(mesh, baseline)

    def test_chat_endpoint(self, mesh, baseline):
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "a b a b a b a b"}],
            "max_tokens": NEW_TOKENS,
            "temperature": 0,
        }
        replies = [
            httpx.post(m.url + "/v1/chat/completions", json=body, timeout=120).json()
            for m in (mesh, baseline)
        ]
        assert replies[0]["choices"][0]["message"] == replies[1]["choices"][0]["message"]
        assert replies[0]["usage"] == replies[1]["usage"]


class TestComposite:
    """N-gram first, the (identical) draft model when the n-gram has nothing;
    adaptive window."""

    @pytest.fixture(scope="class")
    @classmethod
    def mesh(cls, package, target_dir, tmp_path_factory) -> Iterator[Served]:
        args = (
            "--spec-type", "composite", "--draft-model", str(target_dir), "--no-spec-auto",
            "--window-policy", "adaptive", "--initial-window", "2", "--max-window", "6",
        )  # fmt: skip
        with serving(package, tmp_path_factory.mktemp("composite"), *args) as mesh:
            yield mesh

    def test_composite_changes_nothing(self, mesh, baseline):
        replies = assert_equivalent(mesh, baseline, (*PROMPTS, EOS_PROMPT))
        assert all(timings_of(r)["drafted"] > 0 for r in replies)
        assert ("composite", "accepted") in mesh.counters()
        assert "speculation: composite (policy adaptive, window 1..6)" in mesh.stage0_log()


class TestUnresolvableDraft:
    """A draft that cannot be loaded: a warning, then n-gram (fixed window 4)."""

    @pytest.fixture(scope="class")
    @classmethod
    def mesh(cls, package, tmp_path_factory) -> Iterator[Served]:
        args = (
            "--spec-type", "draft-model", "--draft-model", "/nonexistent/draft",
            "--no-spec-auto", *fixed(4),
        )  # fmt: skip
        with serving(package, tmp_path_factory.mktemp("no-draft"), *args) as mesh:
            yield mesh

    def test_falls_back_to_ngram_with_a_warning_and_serves(self, mesh, baseline):
        log = mesh.stage0_log()
        warnings = [ln for ln in log.splitlines() if " WARNING " in ln and "/nonexistent" in ln]
        assert warnings and "serving with the n-gram drafter instead" in warnings[0]
        assert "speculation: ngram (policy fixed, window 4..4)" in log
        replies = assert_equivalent(mesh, baseline)
        assert timings_of(replies[0])["drafted"] > 0
        assert {strategy for strategy, _ in mesh.counters()} == {"ngram"}


# ---- penalties and biases ---------------------------------------------------------

PENALISED = (
    {"frequency_penalty": 1.5},
    {"presence_penalty": 1.0, "repetition_penalty": 1.4},
    {"repetition_penalty": 0.7, "logit_bias": {"17": 4.0, "42": -100}},
    {"temperature": 0.8, "seed": 21, "frequency_penalty": 0.6, "min_p": 0.1},
    # The end token (SmolLM2's <|im_end|>, id 2) pushed up, held back for 6 tokens.
    {"min_tokens": 6, "logit_bias": {"2": 30.0}},
    # llama.cpp's samplers: DRY on a greedy reply; a seeded one through XTC, typical
    # sampling and DRY with its default breakers.
    {"dry_multiplier": 0.8, "dry_allowed_length": 2},
    {
        "temperature": 0.9,
        "seed": 5,
        "xtc_probability": 0.5,
        "xtc_threshold": 0.1,
        "typical_p": 0.9,
        "dry_multiplier": 0.5,
    },
)


def reference_tokens(model, prompt: list[int], steps: int, params: dict) -> list[int]:
    """Greedy decoding of the HF model with the penalties written out here on their
    own (repetition over prompt and output, frequency and presence over the output,
    then the bias)."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            scores = model(torch.tensor([tokens])).logits[0, -1].clone()
            output = tokens[len(prompt) :]
            for token in set(tokens):
                rp = params.get("repetition_penalty", 1.0)
                scores[token] = scores[token] / rp if scores[token] > 0 else scores[token] * rp
            for token in set(output):
                scores[token] -= params.get("frequency_penalty", 0.0) * output.count(token)
                scores[token] -= params.get("presence_penalty", 0.0)
            for token, bias in params.get("logit_bias", {}).items():
                scores[int(token)] += bias
            tokens.append(int(scores.argmax()))
    return tokens[len(prompt) :]


def test_penalised_greedy_text_is_the_reference_decoding(baseline, target_dir) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    for params in PENALISED[:3]:
        for prompt in PROMPTS[:2]:
            ids = tokenizer.encode(prompt)
            plain = reference_tokens(model, ids, NEW_TOKENS, {})
            want = reference_tokens(model, ids, NEW_TOKENS, params)
            assert want != plain, (params, prompt)  # the penalty changes this text
            reply = baseline.cached(prompt, **params)
            assert reply["choices"][0]["text"] == tokenizer.decode(want), (params, prompt)


def test_penalties_and_biases_are_lossless_with_speculation(
    baseline, package, target_dir, tmp_path_factory
):
    """Greedy and seeded replies with penalties, biases and min_p are the same with
    a draft model (same weights as the target: its unpenalised drafts are partly
    rejected) and with n-gram drafts, as without speculation."""
    for name, args in (
        ("draft", ("--spec-type", "draft-model", "--draft-model", str(target_dir), *fixed(4))),
        ("ngram", ("--spec-type", "ngram", "--no-spec-auto", *fixed(3))),
    ):
        with serving(package, tmp_path_factory.mktemp(f"penalties-{name}"), *args) as mesh:
            drafted = 0
            for params in PENALISED:
                for prompt in PROMPTS:
                    reply = mesh.complete(prompt, **params)
                    same_reply(reply, baseline.cached(prompt, **params))
                    drafted += timings_of(reply).get("drafted", 0)
            assert drafted > 0, name


# ---- log-probabilities -----------------------------------------------------------------


def test_logprobs_are_the_models(baseline, target_dir) -> None:
    """Completions and chat log-probabilities: each token's equals the model's own
    log-softmax at that step, the alternatives are the likeliest tokens in order,
    streamed chunks carry the same entries, and penalties shape them."""
    import json as jsonlib

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    prompt = PROMPTS[2]
    ids = tokenizer.encode(prompt)
    reply = baseline.cached(prompt, logprobs=3)
    got = reply["choices"][0]["logprobs"]
    tokens = list(ids)
    with torch.no_grad():
        for step in range(NEW_TOKENS):
            logprobs = torch.log_softmax(model(torch.tensor([tokens])).logits[0, -1], dim=-1)
            chosen = int(logprobs.argmax())
            assert got["token_logprobs"][step] == pytest.approx(float(logprobs[chosen]), abs=1e-4)
            top = torch.topk(logprobs, 3)
            alternatives = list(got["top_logprobs"][step].values())
            assert alternatives == pytest.approx(top.values.tolist(), abs=1e-4)
            assert got["tokens"][step] == tokenizer.decode([chosen])
            tokens.append(chosen)
    assert got["text_offset"][0] == 0 and "".join(got["tokens"]) == reply["choices"][0]["text"]
    # Chat, plain and streamed.
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 8,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    chat = httpx.post(baseline.url + "/v1/chat/completions", json=body, timeout=120).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == 8 and all(len(entry["top_logprobs"]) == 2 for entry in content)
    assert all(entry["logprob"] == entry["top_logprobs"][0]["logprob"] for entry in content)
    streamed = []
    with httpx.stream(
        "POST", baseline.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=120
    ) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                for choice in jsonlib.loads(line[6:])["choices"]:
                    streamed += (choice.get("logprobs") or {}).get("content") or []
    # The second request finds the first one's prompt in the prefix cache: its prompt
    # is read in two parts, which in float32 rounds within 1e-5 of one pass.
    assert [e["token"] for e in streamed] == [e["token"] for e in content]
    for got_entry, want in zip(streamed, content, strict=True):
        assert got_entry["logprob"] == pytest.approx(want["logprob"], abs=1e-4)
        assert [t["token"] for t in got_entry["top_logprobs"]] == [
            t["token"] for t in want["top_logprobs"]
        ]
    # Penalties shape the distribution the logprobs come from.
    biased = baseline.complete(prompt, logprobs=1, max_tokens=1, logit_bias={"17": 100})
    assert biased["choices"][0]["logprobs"]["token_logprobs"][0] == pytest.approx(0.0, abs=1e-4)


# ---- prompt scoring (echo with logprobs) ---------------------------------------------------


def _reference_scores(model, ids: list[int], top: int) -> tuple[list[float], list[list[float]]]:
    """The unsplit model's log-probability of each prompt token after the first, and the
    ``top`` likeliest alternatives' values at each of those positions."""
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    chosen = [float(logprobs[i - 1, ids[i]]) for i in range(1, len(ids))]
    alternatives = [torch.topk(logprobs[i - 1], top).values.tolist() for i in range(1, len(ids))]
    return chosen, alternatives


def _assert_scored(logprobs, ids: list[int], model, tokenizer, top: int) -> None:
    chosen, alternatives = _reference_scores(model, ids, top)
    count = len(ids)
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.token_logprobs[1:count] == pytest.approx(chosen, abs=1e-4)
    for got, want in zip(logprobs.top_logprobs[1:count], alternatives, strict=True):
        # The top ones, and the scored token where it is not among them.
        assert len(want) <= len(got) <= len(want) + 1
        assert sorted(got.values(), reverse=True)[: len(want)] == pytest.approx(want, abs=1e-4)
    assert logprobs.tokens[:count] == [tokenizer.decode([t]) for t in ids]


def test_echo_with_logprobs_scores_the_prompt_as_the_model_does(
    baseline, package, target_dir, tmp_path_factory
) -> None:
    """The legacy completions idiom for scoring text (``echo``, ``logprobs``,
    ``max_tokens`` 0), through the official client on 2-stage meshes: every prompt
    token's log-probability is the unsplit model's, also for a prompt read in many
    chunks (a step budget of 16 tokens) and for a prompt the prefix cache holds; with
    tokens to generate they follow the echoed prompt, greedy as without echo."""
    import openai
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    prompt = PROMPTS[1] * 3
    ids = tokenizer.encode(prompt)
    plain = baseline.complete(prompt)  # its positions stay in the prefix cache
    client = openai.OpenAI(base_url=baseline.url + "/v1", api_key="none", max_retries=0)
    scored = client.completions.create(
        model=MODEL, prompt=prompt, echo=True, logprobs=2, max_tokens=0, temperature=0
    )
    (choice,) = scored.choices
    assert choice.text == prompt and choice.finish_reason == "length"
    assert scored.usage.completion_tokens == 0 and scored.usage.prompt_tokens == len(ids)
    _assert_scored(choice.logprobs, ids, model, tokenizer, 2)
    both = client.completions.create(
        model=MODEL, prompt=prompt, echo=True, logprobs=1, max_tokens=NEW_TOKENS, temperature=0
    )
    (choice,) = both.choices
    assert choice.text == prompt + plain["choices"][0]["text"]
    _assert_scored(choice.logprobs, ids, model, tokenizer, 1)
    assert len(choice.logprobs.tokens) == len(ids) + NEW_TOKENS
    with serving(
        package,
        tmp_path_factory.mktemp("scored-chunks"),
        "--spec-type",
        "none",
        "--max-batch-tokens",
        "16",
    ) as chunked:
        client = openai.OpenAI(base_url=chunked.url + "/v1", api_key="none", max_retries=0)
        again = client.completions.create(
            model=MODEL, prompt=prompt, echo=True, logprobs=2, max_tokens=0
        )
    assert len(ids) > 3 * 16  # read in at least four chunks
    _assert_scored(again.choices[0].logprobs, ids, model, tokenizer, 2)


def test_min_tokens_ignore_eos_and_stop_token_ids(baseline, target_dir) -> None:
    """vLLM's end-of-output extensions on a 2-stage mesh: with the end token biased
    to be chosen at once, ``min_tokens`` holds it back for that many tokens (the
    text is the model's greedy text for them), ``ignore_eos`` generates to
    ``max_tokens``, and a token in ``stop_token_ids`` ends the output as the end
    token does."""
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(target_dir).eos_token_id
    prompt = PROMPTS[3]
    push = {"logit_bias": {str(eos): 100.0}}
    ended = baseline.complete(prompt, max_tokens=8, **push)
    assert ended["usage"]["completion_tokens"] == 0
    assert ended["choices"][0]["finish_reason"] == "stop"
    held = baseline.complete(prompt, max_tokens=8, min_tokens=3, **push)
    assert held["usage"]["completion_tokens"] == 3
    assert held["choices"][0]["finish_reason"] == "stop"
    plain = baseline.complete(prompt, max_tokens=3)
    assert held["choices"][0]["text"] == plain["choices"][0]["text"]
    ignored = baseline.complete(prompt, max_tokens=5, ignore_eos=True, **push)
    assert ignored["usage"]["completion_tokens"] == 5
    assert ignored["choices"][0]["finish_reason"] == "length"
    first = baseline.complete(prompt, max_tokens=1)["choices"][0]["text"]
    token = AutoTokenizer.from_pretrained(target_dir).encode(first)[0]
    stopped = baseline.complete(prompt, max_tokens=8, stop_token_ids=[token])
    assert stopped["usage"]["completion_tokens"] == 0
    assert stopped["choices"][0]["finish_reason"] == "stop"
    for bad in ({"stop_token_ids": [10**7]}, {"min_tokens": 9, "max_tokens": 4}):
        body = {"model": MODEL, "prompt": prompt, **bad}
        reply = httpx.post(baseline.url + "/v1/completions", json=body, timeout=60)
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["param"] in bad


def test_more_choices_than_the_server_ever_admits_is_a_400_not_a_429(baseline) -> None:
    """The meshes here admit 4 running and 4 queued requests: a batch of 3 prompts
    with n 3 (9 choices) could never be admitted whole, so it is refused with a 400
    that says why instead of a 429 that no retry would get past; 8 choices run."""
    body = {"model": MODEL, "prompt": list(PROMPTS[:3]), "n": 3, "max_tokens": 2}
    reply = httpx.post(baseline.url + "/v1/completions", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "prompt" and "at most 8" in error["message"]
    body = {**body, "prompt": list(PROMPTS[:2]), "n": 4}
    reply = httpx.post(baseline.url + "/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    assert [c["index"] for c in reply.json()["choices"]] == list(range(8))
