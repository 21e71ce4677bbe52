"""The pure parts of benchmarks/spec_bench.py: configurations, summary, table, chart."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks"


def spec_bench():
    if str(BENCH_DIR) not in sys.path:
        sys.path.insert(0, str(BENCH_DIR))
    return importlib.import_module("spec_bench")


def record(config: str, request_id: str, repeat: int, **values) -> dict:
    base = {
        "latency_ms": 5.0,
        "workload": "code-edit",
        "config": config,
        "request_id": request_id,
        "repeat": repeat,
        "wall_s": 1.0,
        "completion_tokens": 10,
        "drafted": 0,
        "accepted": 0,
        "rounds": 0,
        "emitted": 0,
        "text_sha1": "same",
    }
    return {**base, **values}


def test_configs_put_the_baseline_first_and_check_names():
    bench = spec_bench()
    configs = bench.build_configs(["cost", "ngram-fixed"], 6, None, "draft")
    assert [c.name for c in configs] == ["baseline", "cost", "ngram-fixed"]
    assert configs[0].stage0_args == ("--spec-type", "none")
    assert configs[1].stage0_args == ()  # the built-in default
    assert configs[2].stage0_args[-2:] == ("--initial-window", "6")
    assert "--no-spec-auto" in configs[2].stage0_args
    with pytest.raises(SystemExit, match="need --draft-model"):
        bench.build_configs(["draft-fixed"], 8, None, "draft")
    drafts = bench.build_configs(["draft-adaptive"], 8, "/models/d", "target as draft")
    assert drafts[1].stage0_args[:4] == ("--spec-type", "draft-model", "--draft-model", "/models/d")
    assert drafts[1].label.startswith("target as draft")


def test_summary_medians_rates_and_speedup():
    bench = spec_bench()
    records = []
    for repeat, (base_wall, spec_wall) in enumerate(((2.0, 1.0), (2.0, 0.5), (4.0, 1.0))):
        for request_id in ("a", "b"):
            records.append(record("baseline", request_id, repeat, wall_s=base_wall / 2))
            records.append(
                record(
                    "ngram-fixed",
                    request_id,
                    repeat,
                    wall_s=spec_wall / 2,
                    drafted=8,
                    accepted=6,
                    rounds=3,
                    emitted=9,
                    text_sha1="other" if (request_id, repeat) == ("b", 2) else "same",
                )
            )
    rows = {r["config"]: r for r in bench.summarize(records)}
    base, spec = rows["baseline"], rows["ngram-fixed"]
    # Per repeat: 20 tokens over the summed wall time; median over the three repeats.
    assert base["tok_s"] == pytest.approx(10.0)
    assert (base["tok_s_min"], base["tok_s_max"]) == (5.0, 10.0)
    assert spec["tok_s"] == pytest.approx(20.0)
    assert spec["wall_s"] == pytest.approx(1.0)
    assert spec["speedup"] == pytest.approx(2.0) and base["speedup"] == pytest.approx(1.0)
    # Per-repeat ratios 2, 4 and 4: the paired speedup is their median.
    assert spec["speedup_paired"] == pytest.approx(4.0)
    assert spec["accept_rate"] == pytest.approx(0.75) and base["accept_rate"] is None
    assert spec["tokens_per_round"] == pytest.approx(3.0) and base["tokens_per_round"] == 1.0
    assert spec["text_differs"] == 1 and base["text_differs"] == 0
    assert (spec["requests"], spec["repeats"]) == (2, 3)
    table = bench.table(list(rows.values()))
    assert "| 5 ms " in table and "2.00x" in table


def test_depths_make_one_config_per_depth_and_compare_with_serial():
    bench = spec_bench()
    configs = bench.with_depths(bench.build_configs(["cost"], 6, None, "draft"), ["1", "auto"])
    assert [c.name for c in configs] == ["baseline", "cost@d1", "cost@dauto"]
    assert configs[1].coordinator_args == ("--max-windows-in-flight", "1")
    assert configs[2].coordinator_args == () and "depth auto" in configs[2].label
    assert bench.with_depths(configs[:2], ["auto"]) == configs[:2]
    records = []
    for repeat, (serial_wall, deep_wall) in enumerate(((2.0, 1.0), (2.0, 0.5), (1.0, 1.0))):
        records.append(record("baseline", "a", repeat, wall_s=4.0))
        records.append(record("cost@d1", "a", repeat, wall_s=serial_wall))
        records.append(record("cost@dauto", "a", repeat, wall_s=deep_wall))
    rows = {r["config"]: r for r in bench.summarize(records)}
    deep = rows["cost@dauto"]
    # Serial rates 5, 5, 10 (median 5); deep 10, 20, 10 (median 10); per repeat 2, 4, 1.
    assert deep["vs_serial"] == pytest.approx(2.0)
    assert deep["vs_serial_paired"] == pytest.approx(2.0)
    assert rows["cost@d1"]["vs_serial"] is None and rows["baseline"]["vs_serial"] is None
    assert "2.00x" in bench.table(list(rows.values()))


def test_chart_is_written(tmp_path: Path):
    pytest.importorskip("matplotlib")
    bench = spec_bench()
    records = [
        record("baseline", "a", 0),
        record("cost", "a", 0, wall_s=0.5),
        record("baseline", "c", 0, workload="chat"),
        record("cost", "c", 0, workload="chat", wall_s=1.1),
    ]
    out = tmp_path / "chart.png"
    bench.write_chart(bench.summarize(records), out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ahead_counters_read_the_metrics_text():
    bench = spec_bench()
    text = "\n".join(
        [
            'mesh_verify_windows_ahead_total{outcome="sent"} 12.0',
            'mesh_verify_windows_ahead_total{outcome="kept"} 9.0',
            'mesh_verify_windows_ahead_total{outcome="dropped"} 3.0',
            "mesh_verify_wasted_tokens_total 14.0",
            "mesh_step_tokens_sum 300.0",
            "mesh_step_tokens_count 40.0",
        ]
    )
    got = bench.ahead_counters(text)
    assert got == {
        "sent": 12.0,
        "kept": 9.0,
        "dropped": 3.0,
        "wasted_tokens": 14.0,
        "rows_sent": 300.0,
    }
