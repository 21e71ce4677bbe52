"""Per-request speculation telemetry and its aggregation."""

from __future__ import annotations

from mesh.speculative import Telemetry


def test_record_rounds_and_rates() -> None:
    telemetry = Telemetry()
    telemetry.record_round(proposed=4, accepted=4, emitted=5, round_time_s=0.02)
    telemetry.record_round(proposed=4, accepted=1, emitted=2, round_time_s=0.02)
    telemetry.record_round(proposed=0, accepted=0, emitted=1, round_time_s=0.01)
    assert (telemetry.drafted, telemetry.accepted) == (8, 5)
    assert (telemetry.windows, telemetry.rounds, telemetry.emitted) == (2, 3, 8)
    assert telemetry.accept_rate == 5 / 8
    assert telemetry.mean_tokens_per_round == 8 / 3
    assert telemetry.to_dict() == {
        "drafted": 8,
        "accepted": 5,
        "accept_rate": 0.625,
        "windows": 2,
        "rounds": 3,
        "mean_tokens_per_round": 2.6667,
    }


def test_empty_telemetry_has_zero_rates() -> None:
    assert Telemetry().accept_rate == 0.0
    assert Telemetry().mean_tokens_per_round == 0.0


def test_merge_sums_counters() -> None:
    a, b = Telemetry(), Telemetry()
    a.record_round(3, 2, 3, 0.1, 0.01)
    b.record_round(5, 0, 1, 0.2, 0.02)
    b.record_round(0, 0, 1, 0.1, 0.0)
    total = a + b
    assert (total.drafted, total.accepted, total.windows, total.rounds) == (8, 2, 2, 3)
    assert abs(total.round_time_s - 0.4) < 1e-9
    assert total.accept_rate == 0.25
    assert (a.drafted, b.drafted) == (3, 5)  # inputs unchanged
    assert sum([a, b], Telemetry()).drafted == 8
