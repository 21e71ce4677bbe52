"""The prefix cache's parts: stage 0's index of kept token sequences, and a stage
keeping a session's positions and starting later sessions from a copy of them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from runtime_support import SPLITS, load_chain, max_diff, package_of

from mesh.errors import PrefixMissing
from mesh.runtime import Span, StageRuntime
from mesh.types import SamplingParams
from stage.frontend.prefix_index import BLOCK, PrefixIndex

# ---- the index --------------------------------------------------------------------


def test_lookup_finds_the_longest_kept_prefix_token_by_token() -> None:
    index = PrefixIndex(10_000)
    base = list(range(1000, 1100))
    assert index.add("a", [*base[:40], 7, 7]) == (True, [])
    assert index.add("b", [*base[:70], 5, 6]) == (True, [])
    hit = index.lookup([*base[:75], 1, 2])
    # "b" shares 70 tokens (4 whole blocks and 6 more), "a" only 40.
    assert hit is not None and (hit.name, hit.length) == ("b", 70)
    hit = index.lookup([*base[:37], 9, 9, 9])
    assert hit is not None and (hit.name, hit.length) in {("a", 37), ("b", 37)}


def test_a_hit_leaves_the_prompts_last_token_to_read() -> None:
    index = PrefixIndex(10_000)
    tokens = list(range(1, 50))
    index.add("a", tokens)
    hit = index.lookup(tokens)
    assert hit is not None and hit.length == len(tokens) - 1
    hit = index.lookup(tokens[:20])
    assert hit is not None and hit.length == 19


def test_short_or_unmatched_prompts_miss() -> None:
    index = PrefixIndex(10_000)
    index.add("a", list(range(1, 50)))
    assert index.lookup(list(range(1, 10))) is None  # under one block
    assert index.lookup([0, *range(1, 50)]) is None  # differs at the first token
    assert index.add("tiny", [1, 2, 3]) == (False, [])


def test_a_newer_sequence_replaces_the_one_it_extends_and_capacity_is_kept() -> None:
    index = PrefixIndex(100)
    index.add("turn1", list(range(1, 41)))
    kept, dropped = index.add("turn2", list(range(1, 61)))
    assert kept and dropped == ["turn1"] and len(index) == 1 and index.held_tokens == 60
    kept, dropped = index.add("other", list(range(500, 550)))
    assert kept and dropped == ["turn2"] and index.held_tokens == 50
    assert index.add("huge", list(range(1, 200))) == (False, [])


def test_touch_protects_a_prefix_from_eviction() -> None:
    index = PrefixIndex(3 * BLOCK * 2)
    for name, start in (("a", 0), ("b", 100), ("c", 200)):
        index.add(name, list(range(start, start + 2 * BLOCK)))
    index.touch("a")
    _, dropped = index.add("d", list(range(300, 300 + 2 * BLOCK)))
    assert dropped == ["b"] and "a" in index and index.lookup(list(range(0, 40))) is not None


def test_what_was_neither_kept_nor_used_within_the_idle_time_expires() -> None:
    now = [0.0]
    index = PrefixIndex(10_000, clock=lambda: now[0])
    index.add("a", list(range(0, 40)))
    now[0] = 10.0
    index.add("b", list(range(100, 140)))
    now[0] = 20.0
    index.add("c", list(range(200, 240)))
    now[0] = 25.0
    index.touch("a")  # used again: as new as the newest
    assert index.expire(0) == []  # 0: never
    now[0] = 31.0
    assert index.expire(20.0) == ["b"]
    assert "b" not in index and index.lookup(list(range(100, 140))) is None
    assert index.held_tokens == 80
    now[0] = 100.0
    assert sorted(index.expire(20.0)) == ["a", "c"] and len(index) == 0


def test_removed_prefixes_are_not_found() -> None:
    index = PrefixIndex(1000)
    index.add("a", list(range(1, 50)))
    assert index.remove("a") and not index.remove("a")
    assert index.lookup(list(range(1, 50))) is None and index.held_tokens == 0


def test_a_tenants_prefixes_are_found_only_by_that_tenant() -> None:
    index = PrefixIndex(10_000)
    prompt = list(range(1, 60))
    assert index.add("alice-1", prompt, "alice") == (True, [])
    assert index.lookup(prompt + [7], "bob") is None
    assert index.lookup(prompt + [7]) is None  # nor by requests without a key
    hit = index.lookup(prompt + [7], "alice")
    assert hit is not None and (hit.name, hit.length) == ("alice-1", len(prompt))
    # The same tokens kept for bob are bob's; a longer turn of bob's replaces only his.
    assert index.add("bob-1", prompt, "bob") == (True, [])
    kept, dropped = index.add("bob-2", prompt + [8, 9], "bob")
    assert kept and dropped == ["bob-1"]
    hit = index.lookup(prompt + [8, 9, 10], "alice")
    assert hit is not None and hit.name == "alice-1"
    assert index.remove("alice-1") and index.lookup(prompt + [7], "alice") is None
    assert index.lookup(prompt + [8, 9, 10], "bob") is not None
    index.clear()
    assert index.lookup(prompt + [8, 9, 10], "bob") is None and index.held_tokens == 0


# ---- the stages -------------------------------------------------------------------


@pytest.fixture(scope="module")
def package(tiny_model_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory):
    model_dir = tiny_model_factory("llama", layers=6)
    return package_of(model_dir, tmp_path_factory.mktemp("prefix") / "pkg")


def run(stages: list[StageRuntime], span: Span, ids: torch.Tensor) -> torch.Tensor:
    activations: torch.Tensor = ids
    for stage in stages:
        out = stage.forward_batch([span], activations)
        if out.errors:
            raise out.errors[0]
        activations = out.of(0)
    return activations


def test_a_session_started_from_a_kept_prefix_gets_the_logits_of_a_full_prefill(
    package: Path,
) -> None:
    stages = load_chain(package, SPLITS[2])
    torch.manual_seed(0)
    tokens = torch.randint(0, 1000, (48,))
    run(stages, Span("a", 0, 40), tokens[:40])
    for step in range(40, 44):  # decode rows become part of the prefix too
        run(stages, Span("a", step, 1), tokens[step : step + 1])
    for stage in stages:
        assert stage.keep_prefix("a", 42)
        assert stage.sessions() == [] and stage.prefixes() == {"a": 42}
    started = run(stages, Span("b", 42, 6, prefix_from="a"), tokens[42:48])
    alone = run(stages, Span("c", 0, 48), tokens[:48])[-6:]
    assert max_diff(started, alone) < 1e-4
    # The prefix stays for the next session, and a copy is independent of it.
    run(stages, Span("b", 10, 3), tokens[:3])
    again = run(stages, Span("d", 42, 6, prefix_from="a"), tokens[42:48])
    assert max_diff(again, started) == 0


def test_a_missing_or_short_prefix_is_refused_with_prefix_missing(package: Path) -> None:
    stages = load_chain(package, SPLITS[1])
    tokens = torch.arange(1, 33)
    with pytest.raises(PrefixMissing, match="send the prompt"):
        run(stages, Span("b", 20, 4, prefix_from="nothing"), tokens[20:24])
    run(stages, Span("a", 0, 16), tokens[:16])
    stages[0].keep_prefix("a", 16)
    with pytest.raises(PrefixMissing):
        run(stages, Span("b", 20, 4, prefix_from="a"), tokens[20:24])
    assert stages[0].sessions() == []
    stages[0].forget_prefix("a")
    assert stages[0].prefixes() == {}


def test_kept_prefixes_stay_within_the_stage_byte_budget(package: Path) -> None:
    (stage,) = load_chain(package, SPLITS[1])
    tokens = torch.arange(1, 65)
    per_token = stage.kv_bytes_per_token
    stage.set_prefix_bytes(per_token * 70)
    for name in ("a", "b", "c"):
        run([stage], Span(name, 0, 32), tokens[:32])
        stage.keep_prefix(name, 32)
    # Kept prefixes are shrunk to their positions: two of 32 fit in 70.
    assert list(stage.prefixes()) == ["b", "c"] and stage.prefix_nbytes() <= per_token * 70
    stage.set_prefix_bytes(0)
    run([stage], Span("d", 0, 8), tokens[:8])
    assert not stage.keep_prefix("d", 8) and stage.sessions() == []


def test_the_last_stage_keeps_token_ids_with_a_prefix_for_penalties(package: Path) -> None:
    (stage,) = load_chain(package, SPLITS[1])
    tokens = list(range(5, 45))
    run([stage], Span("a", 0, 40), torch.tensor(tokens))
    stage.record_history("a", 0, tokens)
    stage.keep_prefix("a", 30)
    penalised = SamplingParams(repetition_penalty=1.3)
    span = Span("b", 30, 2, prefix_from="a", sampling=penalised)
    run([stage], span, torch.tensor(tokens[30:32]))
    assert stage.record_history("b", 30, tokens[30:32]) == tokens[:30]


def test_a_session_forks_from_a_live_session_without_changing_it(package: Path) -> None:
    # n > 1: the other choices start from the first choice's session while it runs.
    stages = load_chain(package, SPLITS[2])
    torch.manual_seed(1)
    tokens = torch.randint(0, 1000, (30,))
    first = run(stages, Span("q", 0, 24), tokens[:24])
    forked = run(stages, Span("q-1", 23, 1, prefix_from="q"), tokens[23:24])
    assert max_diff(forked, first[-1:]) < 1e-4
    # Both sessions go on on their own; the first one is still live, not kept.
    for stage in stages:
        assert sorted(stage.sessions()) == ["q", "q-1"] and stage.prefixes() == {}
    a = run(stages, Span("q", 24, 2), tokens[24:26])
    b = run(stages, Span("q-1", 24, 2), tokens[24:26])
    assert max_diff(a, b) < 1e-4
