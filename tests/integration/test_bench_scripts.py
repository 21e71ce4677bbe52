"""Both benchmark scripts end to end against a tiny model on real local meshes.

Checks what the scripts report (structure, counts, ratios to their own baseline),
never how fast anything ran.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks"

pytestmark = pytest.mark.slow


def bench(name: str):
    if str(BENCH_DIR) not in sys.path:
        sys.path.insert(0, str(BENCH_DIR))
    return importlib.import_module(name)


@pytest.fixture
def workloads(tmp_path: Path) -> Path:
    lines = [
        ("chat", "chat-a", "Say hello.", 4),
        ("chat", "chat-b", "Count to three.", 5),
        ("code-edit", "edit-a", "Rename x to y: `x = 1`", 6),
    ]
    path = tmp_path / "workloads.jsonl"
    path.write_text(
        "\n".join(
            json.dumps(
                {
                    "workload": w,
                    "id": i,
                    "messages": [{"role": "user", "content": c}],
                    "max_tokens": n,
                }
            )
            for w, i, c, n in lines
        )
        + "\n"
    )
    return path


def test_pipeline_bench_reports_each_stage_count(tiny_package_factory, workloads, tmp_path):
    pipeline = bench("pipeline_bench")
    package = tiny_package_factory("llama", layers=6)
    out = tmp_path / "pipeline.json"
    argv = ["--package", str(package), "--workloads", str(workloads), "--out", str(out)]
    argv += ["--stages", "1,2", "--repeats", "1", "--max-tokens", "6", "--workdir", str(tmp_path)]
    assert pipeline.main(argv) == 0
    body = json.loads(out.read_text())
    assert body["settings"]["prompt_id"] == "chat-a"
    assert body["machine"]["torch_threads_per_stage"] == 1
    one, two = body["summary"]
    assert (one["stages"], two["stages"]) == (1, 2)
    assert one["ratio_vs_1_stage"] == 1.0 and two["ratio_vs_1_stage"] > 0
    assert two["per_hop_overhead_ms"] is not None
    # The f32 split reproduces the unsplit model's greedy text.
    assert two["same_text_as_1_stage"] is True
    assert set(two["stage_compute_ms"]) == {"0", "1"}
    assert set(two["cpu_ms_per_token"]) == {"coordinator", "0", "1"}
    runs = body["runs"]
    assert len(runs) == 2 and all(0 < r["completion_tokens"] <= 6 for r in runs)
    assert [w["wire"] for w in body["wire_sizes"]] == ["f32", "f16", "bf16", "int8"]


def test_serving_bench_reports_each_workload_and_concurrency(
    tiny_package_factory, workloads, tmp_path
):
    serving = bench("serving_bench")
    package = tiny_package_factory("llama", layers=6)
    out = tmp_path / "serving.json"
    argv = ["--package", str(package), "--workloads", str(workloads), "--out", str(out)]
    argv += ["--concurrency", "1,2", "--repeats", "1", "--workdir", str(tmp_path)]
    assert serving.main(argv) == 0
    body = json.loads(out.read_text())
    assert body["settings"]["stages"] == 2 and body["settings"]["workloads"] == {
        "chat": 2,
        "code-edit": 1,
    }
    keys = [(row["workload"], row["concurrency"]) for row in body["summary"]]
    assert keys == [("chat", 1), ("chat", 2), ("code-edit", 1), ("code-edit", 2)]
    passes = {(p["workload"], p["concurrency"]): p for p in body["passes"]}
    # Every stream stays busy: the single code-edit request runs twice with 2 streams.
    assert passes[("code-edit", 2)]["requests"] == 2
    assert passes[("chat", 1)]["requests"] == 2
    for p in passes.values():
        assert p["completion_tokens"] == sum(r["completion_tokens"] for r in p["results"])
        assert all(r["ttft_s"] > 0 for r in p["results"])
        assert set(p["stage_busy_fraction"]) == {"0", "1"}
    for row in body["summary"]:
        assert row["aggregate_tokens_per_s"]["median"] > 0
        if row["concurrency"] == 1:
            assert row["aggregate_ratio_vs_1_stream"] == 1.0
        else:
            assert row["aggregate_ratio_vs_1_stream"] > 0


def test_chaos_bench_judges_every_stream_of_every_round(tiny_package_factory, workloads, tmp_path):
    chaos = bench("chaos")
    package = tiny_package_factory("llama", layers=6)
    out = tmp_path / "chaos.json"
    argv = ["--package", str(package), "--model", "tiny-llama", "--workloads", str(workloads)]
    argv += ["--faults", "2", "--kinds", "kill,throttle", "--streams", "2", "--max-tokens", "40"]
    argv += ["--embeddings", "1", "--embedding-inputs", "3"]
    argv += ["--out", str(out), "--workdir", str(tmp_path / "w")]
    assert chaos.main(argv) == 0
    body = json.loads(out.read_text())
    # Its own prompts, each workload line twice, the feature requests (n, logprobs,
    # tools, schema, predictions, stop strings), one embeddings request.
    assert body["requests"] == 8 + 2 * 3 + 7 + 1
    assert len(body["rounds"]) == 2 and all(len(r["outcomes"]) == 2 for r in body["rounds"])
    kinds = {kind for r in body["rounds"] for kind in r["requests"]}
    assert all(k == "embeddings" or k.split("+")[0] == "chat" for k in kinds)
    assert all(len(r["requests"]) == 2 for r in body["rounds"])
    totals = body["summary"]["totals"]
    assert totals["faults"] == 2 and totals["corrupted"] == 0
    assert totals["identical"] + totals["failed"] == 4


def test_hosts_bench_predicts_every_measured_point(tiny_package_factory, workloads, tmp_path):
    from coordinator.netns_hosts import unavailable_reason

    if unavailable_reason() is not None:
        pytest.skip(f"no network namespaces: {unavailable_reason()}")
    hosts = bench("hosts_bench")
    package = tiny_package_factory("llama", layers=6)
    out = tmp_path / "hosts.json"
    argv = ["--package", str(package), "--workloads", str(workloads), "--repeats", "1"]
    argv += ["--tokens", "8", "--delays", "0", "5", "--rates", "100mbit"]
    argv += ["--slice-rate", "100mbit", "--out", str(out), "--workdir", str(tmp_path / "w")]
    assert hosts.main(argv) == 0
    body = json.loads(out.read_text())
    configs = [r["config"] for r in body["rows"]]
    assert configs == [
        "loopback, 1 stage(s)",
        "loopback, 2 stage(s)",
        "namespaces, 0 ms/hop",
        "namespaces, 100mbit",
        "namespaces, 5 ms/hop",
    ]
    assert all(r["predicted_tok_s"] > 0 and len(r["stage_ms"]) == r["stages"] for r in body["rows"])
    transfer = body["slice_transfer"]
    assert transfer["bytes"] > 0 and transfer["fraction_of_link"] > 0


def test_agent_bench_compares_the_prefix_cache_off_and_on(
    tiny_package_factory, workloads, tmp_path
):
    agent = bench("agent_bench")
    package = tiny_package_factory("llama", layers=6)
    out = tmp_path / "agent.json"
    argv = ["--package", str(package), "--workloads", str(workloads), "--out", str(out)]
    argv += ["--turns", "3", "--conversations", "1", "--repeats", "1", "--history-tokens", "100"]
    argv += ["--max-tokens", "4", "--no-tools", "--workdir", str(tmp_path)]
    assert agent.main(argv) == 0
    body = json.loads(out.read_text())
    # One conversation per workload (chat, code-edit), 3 turns each, on both meshes.
    assert body["turns_compared"] == 6 and body["identical_turns"] == 6
    off, on = body["summary"]["off"], body["summary"]["on"]
    assert [r["turn"] for r in off] == [1, 2, 3] and all(r["samples"] == 2 for r in on)
    assert off[0]["prompt_tokens"] >= 100
    assert all(r["cached_tokens"] == 0 for r in off) and on[0]["cached_tokens"] == 0
    # Later turns reuse (nearly) the whole prompt of the turn before.
    for before, after in zip(on[:-1], on[1:], strict=True):
        assert before["prompt_tokens"] - 8 <= after["cached_tokens"] < after["prompt_tokens"]
    assert len(body["ttft_ratio_later_turns"]) == 2
