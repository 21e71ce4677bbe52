"""The prefix cache through a real 2-stage mesh, driven by the official clients: a
conversation's next turn starts from the positions its previous turn left on every
stage, reports them as cached tokens, and gets the text a mesh without the cache
gives; a stage that lost the prefix makes stage 0 read the prompt again, with the
same text."""

from __future__ import annotations

import re

import anthropic
import httpx
import pytest
from openai import OpenAI

from coordinator.localmesh import MeshProcesses, wait_for

MODEL = "tiny-llama"
HISTORY = "Here is the module we are editing, read it carefully before answering.\n" + "\n".join(
    f"def step_{i}(value):\n    return value * {i} + {i * i}\n" for i in range(12)
)


@pytest.fixture(scope="module")
def meshes(tmp_path_factory: pytest.TempPathFactory, tiny_package_factory):
    package = tiny_package_factory("llama", layers=6)
    settings = {
        # Every stage keeps prefixes.
        "cached": {},
        # No prefix cache at all: the reference.
        "plain": {"stage0_args": ("--prefix-cache-tokens", "0")},
        # Stage 0 keeps prefixes, stage 1 keeps none: every hit is lost there.
        "lossy": {
            "stage_args": ("--prefix-cache-mb", "0"),
            "stage0_args": ("--prefix-cache-mb", "512"),
        },
    }
    started: dict[str, MeshProcesses] = {}
    try:
        for name, extra in settings.items():
            workdir = tmp_path_factory.mktemp(f"prefix-{name}")
            started[name] = MeshProcesses(package, workdir, 2, **extra).start()
        for processes in started.values():
            processes.wait_serving()
        yield started
    finally:
        for processes in started.values():
            processes.close()


def client_of(mesh: MeshProcesses) -> OpenAI:
    return OpenAI(base_url=mesh.http_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def conversation(
    client: OpenAI, turns: int, tag: str = "", **sampling
) -> list[tuple[str, int, int]]:
    """(text, prompt tokens, cached tokens) of each turn of one conversation; ``tag``
    starts the system prompt (conversations with other tags share no prefix)."""
    messages = [
        {"role": "system", "content": f"{tag} You are a careful code reviewer."},
        {"role": "user", "content": HISTORY + "\nWhat does step_3 return for 2?"},
    ]
    out = []
    for turn in range(turns):
        reply = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=12, **sampling
        )
        text = reply.choices[0].message.content or ""
        usage = reply.usage
        out.append((text, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens))
        messages += [
            {"role": "assistant", "content": text},
            {"role": "user", "content": f"And step_{turn + 4}? Answer briefly."},
        ]
    return out


def metric(mesh: MeshProcesses, name: str) -> float:
    text = httpx.get(mesh.http_url + "/metrics", timeout=10).text
    found = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


@pytest.mark.parametrize(
    "sampling", [{"temperature": 0}, {"temperature": 0.9, "seed": 11}], ids=["greedy", "seeded"]
)
def test_later_turns_start_from_the_kept_prefix_with_the_same_text(meshes, sampling) -> None:
    tag = "Seeded." if sampling.get("seed") else "Greedy."
    cached = conversation(client_of(meshes["cached"]), 3, tag, **sampling)
    plain = conversation(client_of(meshes["plain"]), 3, tag, **sampling)
    lossy = conversation(client_of(meshes["lossy"]), 3, tag, **sampling)
    assert [t for t, _, _ in cached] == [t for t, _, _ in plain] == [t for t, _, _ in lossy]
    # Turn 1 finds nothing; later turns find almost their whole prompt kept.
    assert cached[0][2] == 0
    for _, prompt, hit in cached[1:]:
        assert hit > 0.8 * prompt and hit < prompt
    assert all(hit == 0 for _, _, hit in plain)
    # Stage 1 of the lossy mesh held nothing: each hit was read again from position 0.
    assert all(hit == 0 for _, _, hit in lossy)


def test_metrics_count_hits_and_lost_prefixes(meshes) -> None:
    conversation(client_of(meshes["cached"]), 2, "Metrics.")
    conversation(client_of(meshes["lossy"]), 2, "Metrics.")
    assert metric(meshes["cached"], "mesh_prefix_cache_hits_total") >= 1
    assert metric(meshes["cached"], "mesh_prefix_cache_tokens_total") > 100
    assert metric(meshes["lossy"], "mesh_prefix_cache_lost_total") >= 1
    assert metric(meshes["plain"], "mesh_prefix_cache_lookups_total") == 0


def test_streamed_usage_and_anthropic_usage_report_cached_tokens(meshes) -> None:
    mesh = meshes["cached"]
    client = client_of(mesh)
    prompt = HISTORY + "\nSummarise step_7 in one line."
    messages = [{"role": "user", "content": prompt}]
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = [chunk.usage for chunk in stream if chunk.usage is not None][-1]
    assert 0 < usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens
    claude = anthropic.Anthropic(base_url=mesh.http_url, api_key="unused", max_retries=0)
    message = claude.messages.create(model=MODEL, max_tokens=4, messages=messages)
    assert message.usage.cache_read_input_tokens > 0
    total = message.usage.input_tokens + message.usage.cache_read_input_tokens
    assert total == usage.prompt_tokens


def test_sessions_are_freed_and_only_prefixes_stay(meshes) -> None:
    mesh = meshes["cached"]
    conversation(client_of(mesh), 2, "Freed.")
    # Sessions end with the next frame; stages report their count with a heartbeat.
    wait_for(
        lambda: all(s.active_sessions == 0 for s in mesh.status().stages if s.assigned),
        15,
        "every stage to free the finished sessions",
    )


def test_a_cache_salt_keeps_prefixes_among_requests_of_that_salt(meshes) -> None:
    client = client_of(meshes["cached"])
    salted = conversation(client, 2, "Salted.", temperature=0, extra_body={"cache_salt": "a"})
    assert salted[0][2] == 0 and salted[1][2] > 0
    other = conversation(client, 1, "Salted.", temperature=0, extra_body={"cache_salt": "b"})
    unsalted = conversation(client, 1, "Salted.", temperature=0)
    assert other[0][2] == 0 and unsalted[0][2] == 0
    assert other[0][0] == unsalted[0][0] == salted[0][0]
    again = conversation(client, 1, "Salted.", temperature=0, extra_body={"cache_salt": "a"})
    assert again[0][2] > 0


def test_tenants_of_a_key_file_never_start_from_each_others_prefixes(
    tmp_path, tiny_package_factory
) -> None:
    """Two API keys: a conversation's later turns start from the prefix its own
    tenant left, while the other tenant, sending the very same turns, reads them all
    (and gets the same text)."""
    keys = tmp_path / "keys"
    keys.write_text("alice sk-alice-0001\nbob sk-bob-0002\n")
    package = tiny_package_factory("llama", layers=6)
    processes = MeshProcesses(
        package, tmp_path / "mesh", 2, stage0_args=("--api-key-file", str(keys))
    )
    try:
        processes.start().wait_serving()

        def client(key: str) -> OpenAI:
            return OpenAI(base_url=processes.http_url + "/v1", api_key=key, max_retries=0)

        alice = conversation(client("sk-alice-0001"), 2, "Tenants.", temperature=0)
        bob = conversation(client("sk-bob-0002"), 2, "Tenants.", temperature=0)
        assert [t for t, _, _ in alice] == [t for t, _, _ in bob]
        assert alice[0][2] == 0 and alice[1][2] > 0.8 * alice[1][1]
        assert bob[0][2] == 0
        # Bob's second turn finds his own first turn, never alice's second.
        assert 0 < bob[1][2] <= alice[1][2]
        again = conversation(client("sk-bob-0002"), 1, "Tenants.", temperature=0)
        assert again[0][2] > 0  # bob's first turn, kept for bob
    finally:
        processes.close()
