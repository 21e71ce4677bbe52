"""benchmarks/balance_bench.py end to end against a tiny model on two real local
meshes: what it reports (structure, plans, figures present), never how fast."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks"

pytestmark = pytest.mark.slow


def test_balance_bench_compares_the_even_and_the_balanced_mesh(tiny_package_factory, tmp_path):
    if str(BENCH_DIR) not in sys.path:
        sys.path.insert(0, str(BENCH_DIR))
    balance_bench = importlib.import_module("balance_bench")
    package = tiny_package_factory("llama", layers=6)
    out = tmp_path / "balance.json"
    argv = ["--package", str(package), "--out", str(out), "--workdir", str(tmp_path)]
    argv += ["--repeats", "1", "--warmups", "1", "--streams", "2", "--max-tokens", "4"]
    argv += ["--rebalance-wait", "1", "--memory", "1GiB"]
    assert balance_bench.main(argv) == 0
    body = json.loads(out.read_text())
    even, balanced = body["summaries"]
    assert (even["mesh"], balanced["mesh"]) == ("even", "balanced")
    # Both start on the even split (every stage states the same memory).
    assert body["balanced_settling"]["first_plan"]["layers"] == [[0, 2], [2, 4], [4, 6]]
    assert even["layers"] == [[0, 2], [2, 4], [4, 6]] and even["terms"] == [1]
    for summary in (even, balanced):
        layers = summary["layers"]
        assert layers[0][0] == 0 and layers[-1][1] == 6
        assert all(a[1] == b[0] for a, b in zip(layers, layers[1:], strict=False))
        assert len(summary["measured_step_ms"]) == 3
        assert summary["errors"] == 0 and summary["tokens_per_s"] > 0
    for rounds in body["rounds"].values():
        assert all(all(ms > 0 for ms in r["measured_step_ms"]) for r in rounds)
        assert all(r["load_average"] for r in rounds)
