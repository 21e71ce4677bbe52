"""How the chaos harness judges a request run under a fault (coordinator/chaos.py)."""

from __future__ import annotations

import random

from coordinator.chaos import (
    EMBEDDING_TOLERANCE,
    Fault,
    RoundRecord,
    StreamOutcome,
    classify,
    embedding_specs,
    feature_specs,
    render_table,
    request_kind,
    summarize,
)


def test_texts_must_be_equal_and_errors_are_failures() -> None:
    want = StreamOutcome("a b c", "stop")
    assert classify(StreamOutcome("a b c", "stop"), want) == "identical"
    assert classify(StreamOutcome("a b d", "stop"), want) == "corrupted"
    assert classify(StreamOutcome("a b c", "length"), want) == "corrupted"
    assert classify(StreamOutcome("a", None, error="503"), want) == "failed"


def test_embeddings_are_equal_within_the_tolerance() -> None:
    want = StreamOutcome("", "embeddings", vectors=((0.6, 0.8), (1.0, 0.0)))
    close = ((0.6 + EMBEDDING_TOLERANCE / 2, 0.8), (1.0, 0.0))
    far = ((0.6, 0.8), (1.0, 10 * EMBEDDING_TOLERANCE))
    assert classify(StreamOutcome("", "embeddings", vectors=close), want) == "identical"
    assert classify(StreamOutcome("", "embeddings", vectors=far), want) == "corrupted"
    assert classify(StreamOutcome("", "embeddings", vectors=close[:1]), want) == "corrupted"


def test_embedding_requests_hold_long_varied_texts() -> None:
    specs = embedding_specs(2, 5, random.Random(3))
    assert [len(s.inputs) for s in specs] == [5, 5]
    texts = [t for s in specs for t in s.inputs]
    assert len(set(texts)) == len(texts) and min(len(t.split()) for t in texts) > 100


def test_rounds_are_counted_by_request_kind_too() -> None:
    specs = embedding_specs(1, 2, random.Random(1))
    assert request_kind(specs[0]) == "embeddings"
    record = RoundRecord(Fault("kill", "stage-1"), ["identical", "failed"], failover=True)
    record.requests = ["embeddings", "chat"]
    summary = summarize([record])
    assert summary["by_request"] == {
        "embeddings": {"identical": 1, "failed": 0, "corrupted": 0},
        "chat": {"identical": 0, "failed": 1, "corrupted": 0},
    }
    assert "embeddings 1 identical, 0 failed, 0 corrupted" in render_table(summary)


def test_log_probabilities_are_equal_within_the_tolerance_and_tokens_exactly() -> None:
    want = StreamOutcome('[{"tokens": [["a", ["a", "b"]]]}]', "stop", logprobs=(-0.5, -0.5, -2.0))
    close = (-0.5 + EMBEDDING_TOLERANCE / 2, -0.5, -2.0)
    assert classify(StreamOutcome(want.text, "stop", logprobs=close), want) == "identical"
    far = (-0.5, -0.5, -2.0 + 10 * EMBEDDING_TOLERANCE)
    assert classify(StreamOutcome(want.text, "stop", logprobs=far), want) == "corrupted"
    assert classify(StreamOutcome(want.text, "stop", logprobs=close[:2]), want) == "corrupted"
    other = want.text.replace('"b"', '"c"')
    assert classify(StreamOutcome(other, "stop", logprobs=want.logprobs), want) == "corrupted"


def test_feature_requests_cover_the_frontends_paths_and_are_labelled() -> None:
    specs = feature_specs(32, random.Random(2))
    features = {spec.feature for spec in specs}
    assert {"n", "logprobs", "tools", "schema", "prediction", "stop"} <= features
    assert all(spec.messages and request_kind(spec).startswith("chat+") for spec in specs)
    fields = {key for spec in specs for key, _ in spec.extra}
    assert {"n", "tools", "tool_choice", "response_format", "prediction", "stop"} <= fields
    # Seeded where sampled, greedy otherwise: every answer is reproducible.
    assert all((spec.seed is not None) == (spec.temperature > 0) for spec in specs)
