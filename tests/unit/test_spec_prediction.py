"""Drafting from a client's prediction (Predicted Outputs): the cursor follows the
output through insertions and deletions, a rollback restores it exactly, the counts
mean what OpenAI says, and speculation from any prediction is lossless."""

from __future__ import annotations

import random
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mesh.config import WindowPolicySpec
from mesh.sampling import sample_token
from mesh.speculative import RoundContext, make_policy, plan_window, truncate_at_stop, verify_window
from mesh.speculative.ngram import NgramDrafter
from mesh.speculative.prediction import AnchorIndex, PredictionDrafter, prediction_counts
from mesh.types import SamplingParams

PROMPT = [90, 91, 92]
PREDICTION = list(range(10, 50))


def drafter_after(output: list[int], prediction=PREDICTION, fallback=None) -> PredictionDrafter:
    drafter = PredictionDrafter(prediction, fallback)
    drafter.begin(PROMPT)
    if output:
        drafter.extend(output)
    return drafter


def test_an_exact_prediction_is_proposed_from_the_cursor() -> None:
    drafter = drafter_after([])
    assert drafter.propose(5) == [10, 11, 12, 13, 14]
    drafter.accept(5, 15)
    assert drafter.cursor == 6 and drafter.accepted_tokens == 6
    assert drafter.propose(3) == [16, 17, 18]
    drafter.accept(1, 99)  # the target disagreed after one token
    assert drafter.cursor is None and drafter.accepted_tokens == 7


def test_the_cursor_comes_back_after_an_insertion() -> None:
    output = PREDICTION[:10] + [1, 2, 3] + PREDICTION[10:14]
    drafter = drafter_after(output)
    assert drafter.cursor == 14
    assert drafter.propose(4) == PREDICTION[14:18]


def test_the_cursor_comes_back_after_a_deletion() -> None:
    output = PREDICTION[:10] + PREDICTION[20:24]
    drafter = drafter_after(output)
    assert drafter.cursor == 24
    assert drafter.propose(2) == PREDICTION[24:26]


def test_a_repeated_passage_aligns_forward_not_backward() -> None:
    block = [5, 6, 7, 8]
    prediction = block + [1, 2] + block + [3, 4]
    drafter = drafter_after(block + [1, 2] + [9] + block, prediction)
    # The second occurrence of the block follows the place already reached.
    assert drafter.cursor == 10 and drafter.propose(2) == [3, 4]


def test_the_servers_drafter_proposes_where_the_prediction_has_nothing() -> None:
    fallback = NgramDrafter(2, 4)
    drafter = drafter_after([7, 7, 1, 2, 3, 1, 2], [100, 101], fallback)
    assert drafter.cursor is None
    assert drafter.propose(2) == [3, 1]  # the n-gram drafter's continuation of "1 2"
    drafter.accept(2, 2)
    assert fallback.committed == drafter.committed


def test_empty_prediction_and_prediction_past_its_end() -> None:
    drafter = drafter_after([], [])
    assert drafter.propose(4) == []
    drafter = drafter_after([10, 11], [10, 11])
    assert drafter.cursor == 2 and drafter.propose(4) == []


@settings(max_examples=60, deadline=None)
@given(
    steps=st.lists(
        st.tuples(st.lists(st.integers(8, 20), min_size=1, max_size=5), st.integers(0, 6)),
        min_size=1,
        max_size=12,
    )
)
def test_rollback_restores_the_state_exactly(steps) -> None:
    prediction = list(range(8, 21)) + list(range(8, 21))
    drafter = drafter_after([], prediction)
    for tokens, back in steps:
        drafter.extend(tokens)
        length = max(len(PROMPT), drafter.committed_length - back)
        drafter.rollback(length)
        fresh = drafter_after(drafter.committed[len(PROMPT) :], prediction)
        assert (drafter.cursor, drafter.accepted_tokens) == (fresh.cursor, fresh.accepted_tokens)
        assert drafter.propose(3) == fresh.propose(3)


def test_counts_split_the_prediction() -> None:
    assert prediction_counts(PREDICTION, PREDICTION) == (40, 0)
    assert prediction_counts(PREDICTION, PREDICTION[:10]) == (10, 30)
    accepted, rejected = prediction_counts(PREDICTION, PREDICTION[:10] + [1, 2] + PREDICTION[10:])
    assert accepted + rejected == len(PREDICTION) and accepted >= 34
    assert prediction_counts([], [1, 2, 3]) == (0, 0)
    assert prediction_counts(PREDICTION, [1, 2, 3]) == (0, 40)
    # An output that repeats the predicted text accepts each predicted token once:
    # the counts still split the prediction (before: 39 accepted of 10, -29 rejected).
    short = PREDICTION[:10]
    assert prediction_counts(short, short * 4) == (10, 0)
    assert prediction_counts(short, short[:6] + [1, 2] + short * 3) == (10, 0)


# ---- lossless: the speculation loop over a toy target --------------------------------

V = 100


def toy_table(seed: int) -> torch.Tensor:
    table = torch.randn(V, V, generator=torch.Generator().manual_seed(seed))
    for token in range(V):
        table[token, (token * 7 + 3) % V] += 5.0
    return table


def plain(table, params, max_tokens) -> list[int]:
    out: list[int] = []
    while len(out) < max_tokens:
        out.append(sample_token(table[(PROMPT + out)[-1]], params, position=len(PROMPT) + len(out)))
    return out


def with_prediction(table, params, max_tokens, prediction) -> tuple[list[int], int]:
    drafter = PredictionDrafter(prediction, NgramDrafter(2, 4))
    policy = make_policy(WindowPolicySpec("cost", 4, 1, 32))
    drafter.begin(PROMPT)
    first = sample_token(table[PROMPT[-1]], params, position=len(PROMPT))
    out, reason = truncate_at_stop([first], set(), max_tokens)
    drafter.accept(0, first)
    accepted = 0
    while reason is None:
        state = RoundContext(tokens_left=max_tokens - len(out))
        drafts = drafter.propose(plan_window(policy, state))
        window = [drafter.last_token, *drafts]
        started = time.perf_counter()
        logits = table[torch.tensor(window)]
        result = verify_window(logits, window, params, pos_first=drafter.committed_length)
        tokens, reason = truncate_at_stop(result.emitted, set(), max_tokens - len(out))
        drafter.accept(result.accepted_count, result.emitted[-1])
        policy.observe(len(drafts), result.accepted_count, time.perf_counter() - started, 0.0)
        accepted += result.accepted_count
        out += tokens
    return out, accepted


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_speculation_from_any_prediction_is_lossless(temperature: float) -> None:
    helped = 0
    for seed in range(6):
        table = toy_table(seed)
        params = SamplingParams(temperature=temperature, seed=seed)
        reference = plain(table, params, 48)
        edited = reference[:20] + [1, 2, 3] + reference[26:]
        predictions = {
            "exact": reference,
            "edited": edited,
            "wrong": [(t * 5 + 1) % V for t in reference],
            "empty": [],
            "longer": reference + reference,
        }
        for name, prediction in predictions.items():
            got, accepted = with_prediction(table, params, 48, prediction)
            assert got == reference, f"seed {seed}, {name} prediction changed the output"
            if name in ("exact", "edited") and temperature == 0.0:
                helped += accepted >= 20
    if temperature == 0.0:
        assert helped == 12, "an exact or edited prediction should be accepted at length"


@pytest.mark.parametrize("vocab", [3, 50, 200_000])
def test_the_anchor_index_finds_every_run_a_dict_of_runs_finds(vocab: int) -> None:
    rng = random.Random(vocab)
    tokens = [rng.randrange(vocab) for _ in range(600)]
    index = AnchorIndex(tokens, 4)
    runs: dict[tuple[int, ...], list[int]] = {}
    for start in range(len(tokens) - 3):
        runs.setdefault(tuple(tokens[start : start + 4]), []).append(start)
    for run, starts in runs.items():
        assert index.starts(list(run)) == starts
    for _ in range(200):  # runs that may not occur
        run = [rng.randrange(vocab) for _ in range(4)]
        assert index.starts(run) == runs.get(tuple(run), [])
    assert AnchorIndex(tokens[:3], 4).starts(tokens[:3] + [0]) == []
