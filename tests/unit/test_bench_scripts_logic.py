"""The pure parts of benchmarks/: workloads, metrics parsing, summaries, wire sizes."""

from __future__ import annotations

import importlib
import json
import math
import os
import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from mesh.codec import bytes_per_token

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks"


def bench(name: str):
    if str(BENCH_DIR) not in sys.path:
        sys.path.insert(0, str(BENCH_DIR))
    return importlib.import_module(name)


def test_workloads_group_by_name_in_file_order(tmp_path: Path):
    common = bench("common")
    path = tmp_path / "w.jsonl"
    lines = [
        {"workload": w, "id": i, "messages": [{"role": "user", "content": c}], "max_tokens": n}
        for w, i, c, n in (("chat", "c0", "a", 8), ("code", "e0", "b", 9), ("chat", "c1", "c", 7))
    ]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    grouped = common.load_workloads(path)
    assert list(grouped) == ["chat", "code"]
    assert [r.request_id for r in grouped["chat"]] == ["c0", "c1"]
    assert grouped["code"][0].max_tokens == 9
    assert grouped["chat"][1].messages == ({"role": "user", "content": "c"},)

    path.write_text('{"workload": "chat", "id": "x"}\n')
    with pytest.raises(ValueError, match=r"w.jsonl:1: .*max_tokens"):
        common.load_workloads(path)
    with pytest.raises(FileNotFoundError, match="--workloads"):
        common.load_workloads(tmp_path / "missing.jsonl")


def test_the_shared_workload_file_parses():
    common = bench("common")
    path = common.default_workloads_path()
    if not path.is_file():
        pytest.skip(f"no shared workload file at {path}")
    grouped = common.load_workloads(path)
    assert {"chat", "code-edit"} <= set(grouped)


def test_histogram_deltas_from_the_registry_exposition():
    common = bench("common")
    registry = CollectorRegistry()
    buckets = (0.001, 0.01, 0.1)
    compute = Histogram(
        "mesh_stage_compute_seconds", "c", ("stage",), buckets=buckets, registry=registry
    )
    rounds = Histogram(
        "mesh_pipeline_round_seconds", "r", ("kind",), buckets=buckets, registry=registry
    )

    def totals(name: str) -> dict[str, tuple[float, float]]:
        # Sums in ms, as the benchmarks report them.
        return common.parse_histogram_totals(generate_latest(registry).decode(), name, 1000.0)

    compute.labels("0").observe(0.040)
    rounds.labels("prefill").observe(0.090)
    before = totals("mesh_stage_compute_seconds")
    before_rounds = totals("mesh_pipeline_round_seconds")
    for value in (0.010, 0.020):
        compute.labels("0").observe(value)
        compute.labels("1").observe(value * 3)
        rounds.labels("decode").observe(value * 5)
    after = totals("mesh_stage_compute_seconds")
    after_rounds = totals("mesh_pipeline_round_seconds")
    means = common.by_label(common.histogram_means(before, after), "stage")
    assert means == {"0": pytest.approx(15.0), "1": pytest.approx(45.0)}
    sums = common.by_label(common.histogram_sums(before, after), "stage")
    assert sums == {"0": pytest.approx(30.0), "1": pytest.approx(90.0)}
    # No new prefill round between the scrapes: only decode has a mean.
    assert common.by_label(common.histogram_means(before_rounds, after_rounds), "kind") == {
        "decode": pytest.approx(75.0)
    }


def test_spec_bench_reads_the_speculation_counters_stage_0_exposes():
    from metrics_support import process_expositions

    counters = bench("spec_bench").speculation_counters(process_expositions()["stage-0"])
    # One round of the n-gram strategy: 2 drafted, 1 accepted, 2 tokens emitted.
    assert counters == {"drafted": 2, "accepted": 1, "windows": 1, "rounds": 1, "emitted": 2}


def test_statistics_rotation_table_and_json(tmp_path: Path):
    common = bench("common")
    assert common.median([3.0, float("nan"), 1.0, 2.0]) == 2.0
    assert math.isnan(common.median([]))
    assert common.spread([4.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 4.0, "n": 3}
    assert math.isnan(common.ratio(1.0, 0.0))
    assert common.rotated([1, 2, 4, 8], 1) == [2, 4, 8, 1]
    assert common.rotated([1, 2, 4, 8], 4) == [1, 2, 4, 8]
    text = common.render_table(["a", "long header"], [["1", "x"], ["22222", "y"]])
    lines = text.splitlines()
    assert len({len(line) for line in lines}) == 1 and lines[1].startswith("|---")
    out = tmp_path / "deep" / "r.json"
    common.write_json(out, {"x": float("nan"), "y": [1.5, float("inf")]})
    assert json.loads(out.read_text()) == {"x": None, "y": [1.5, None]}


def test_mesh_config_speculation_flags():
    common = bench("common")
    assert common.MeshConfig(2).stage0_args() == ("--spec-type", "none")
    assert common.MeshConfig(2, speculation="package").stage0_args() == ()
    assert common.MeshConfig(3, "bf16").label == "3 stages bf16"


def _run(stages: int, wire: str, tok_s: float, repeat: int, text: str = "same") -> dict:
    return {
        "stages": stages,
        "wire": wire,
        "repeat": repeat,
        "predicted_per_second": tok_s,
        "wall_tokens_per_s": tok_s * 0.9,
        "decode_round_ms": 1000.0 / tok_s - 1.0,
        "stage_compute_ms": {str(i): 900.0 / tok_s / stages for i in range(stages)},
        "cpu_ms_per_token": {
            "coordinator": 0.5,
            **{str(i): 80.0 / stages + 2.0 for i in range(stages)},
        },
        "runqueue_wait_ms_per_token": {"coordinator": 0.0, "0": 3.0},
        "text": text,
    }


def test_pipeline_summary_ratios_and_per_hop_overhead():
    pipeline = bench("pipeline_bench")
    common = bench("common")
    configs = pipeline.build_configs([1, 2, 3], wire_sweep=True)
    assert [(c.stages, c.wire_dtype) for c in configs] == [
        (1, "f32"), (2, "f32"), (3, "f32"), (2, "f16"), (2, "bf16"), (2, "int8")
    ]  # fmt: skip
    runs = []
    for repeat, noise in enumerate((1.0, 0.5, 2.0)):
        runs += [
            _run(1, "f32", 10.0 * noise, repeat),
            _run(2, "f32", 8.0 * noise, repeat),
            _run(3, "f32", 5.0 * noise, repeat),
        ]
    runs.append(_run(2, "int8", 9.0, 0, text="different"))
    rows = pipeline.summarize([common.MeshConfig(n) for n in (1, 2, 3)] + [configs[-1]], runs)
    one, two, three, int8 = rows
    assert one["decode_tokens_per_s"]["median"] == 10.0 and one["ratio_vs_1_stage"] == 1.0
    assert two["ratio_vs_1_stage"] == pytest.approx(0.8)
    # 100 ms/token at 1 stage, 125 at 2, 200 at 3: 25 and 50 ms per hop.
    assert two["per_hop_overhead_ms"] == pytest.approx(25.0)
    assert three["per_hop_overhead_ms"] == pytest.approx(50.0)
    assert math.isnan(one["per_hop_overhead_ms"])
    # Stage CPU per token: 80 ms of compute plus 2 ms per stage process.
    assert three["stage_cpu_ms_per_token"] == pytest.approx(86.0)
    assert three["per_hop_cpu_ms"] == pytest.approx(2.0)
    assert two["same_text_as_1_stage"] and not int8["same_text_as_1_stage"]
    assert set(three["stage_compute_ms"]) == {"0", "1", "2"}
    table = pipeline.stage_table(rows)
    assert "0.800" in table and "2 stages int8" in table
    assert "86.0" in pipeline.breakdown_table(rows)


def test_pipeline_compares_frames_inline_and_on_the_worker():
    pipeline = bench("pipeline_bench")
    configs = pipeline.build_configs([1, 2], wire_sweep=False, inline=(True, False))
    assert [(c.stages, c.inline_frames) for c in configs] == [(1, True), (2, True), (2, False)]
    assert "--no-inline-frames" in configs[2].stage_args()
    assert "--inline-frames" in configs[1].stage_args()
    runs = []
    for repeat in range(3):
        runs += [_run(1, "f32", 10.0, repeat), _run(2, "f32", 9.0, repeat)]
        worker = _run(2, "f32", 8.0, repeat)
        worker["inline"] = False
        runs.append(worker)
    rows = pipeline.summarize(configs, runs)
    assert [r["ratio_vs_1_stage"] for r in rows] == pytest.approx([1.0, 0.9, 0.8])
    assert "2 stages f32 frames on worker" in pipeline.stage_table(rows)
    assert all(r["same_text_as_1_stage"] for r in rows)


def test_wire_sizes_match_the_codec():
    pipeline = bench("pipeline_bench")
    rows = {
        r["wire"]: r
        for r in pipeline.wire_sizes(64, prompt_tokens=40, decode_tokens=30, iterations=20)
    }
    assert list(rows) == ["f32", "f16", "bf16", "int8"]
    for wire, row in rows.items():
        assert row["bytes_per_token"] == bytes_per_token(64, wire)
        assert row["decode_frame_bytes"] == row["bytes_per_token"] + row["frame_overhead_bytes"]
        assert 0 < row["frame_overhead_bytes"] < 200
        assert row["encode_decode_us"] > 0
    assert rows["f32"]["decode_frame_bytes"] > rows["f16"]["decode_frame_bytes"]
    assert rows["f16"]["decode_frame_bytes"] > rows["int8"]["decode_frame_bytes"]


def test_serving_passes_keep_every_stream_busy_and_ratios_use_one_stream():
    serving = bench("serving_bench")
    common = bench("common")
    requests = [common.WorkloadRequest("w", f"r{i}", (), 8) for i in range(4)]
    assert [r.request_id for r in serving.pass_requests(requests, 1)] == ["r0", "r1", "r2", "r3"]
    assert len(serving.pass_requests(requests, 8)) == 8
    assert [r.request_id for r in serving.pass_requests(requests, 3)][4:] == ["r0", "r1"]
    # At least 3 requests per stream: 2 streams take 6, the workload cycled.
    longer = [r.request_id for r in serving.pass_requests(requests, 2, per_stream=3)]
    assert longer == ["r0", "r1", "r2", "r3", "r0", "r1"]
    assert len(serving.pass_requests(requests, 1, per_stream=3)) == 4

    def one_pass(concurrency: int, repeat: int, aggregate: float, flipped: int = 0) -> dict:
        result = {"ttft_s": 0.2 * concurrency, "stream_tokens_per_s": aggregate / concurrency}
        result.update(completion_tokens=10, server_predicted_per_second=5.0)
        results = [
            dict(result, id=f"r{i % 2}", text=f"text {i % 2}" + " flipped" * (i < flipped))
            for i in range(concurrency)
        ]
        return {
            "workload": "w",
            "concurrency": concurrency,
            "repeat": repeat,
            "aggregate_tokens_per_s": aggregate,
            "stage_busy_fraction": {"0": 0.5, "1": 0.6},
            "cpu_cores_used": {"coordinator": 0.01, "0": 0.7, "1": 0.8, "client": 0.1},
            "runqueue_wait_fraction": {"coordinator": 0.0, "0": 0.05, "1": 0.25},
            "results": results,
        }

    passes = [
        one_pass(1, 0, 4.0), one_pass(4, 0, 6.0, flipped=1),
        one_pass(1, 1, 2.0), one_pass(4, 1, 4.0),
        one_pass(1, 2, 3.0), one_pass(4, 2, 3.0),
    ]  # fmt: skip
    rows = serving.summarize(passes)
    solo, four = rows
    assert solo["aggregate_ratio_vs_1_stream"] == 1.0
    assert four["aggregate_tokens_per_s"]["median"] == 4.0
    assert four["aggregate_ratio_vs_1_stream"] == pytest.approx(4.0 / 3.0)
    assert four["aggregate_ratio_per_repeat"]["median"] == pytest.approx(1.5)
    assert four["ttft_s"]["median"] == pytest.approx(0.8)
    assert "1.33" in serving.table(rows)
    # Texts: every request against its own text at 1 stream (r1 never ran alone, so
    # it is not compared); one of the six r0 under 4 streams flipped.
    assert solo["same_text_as_1_stream"] == [3, 3]
    assert four["same_text_as_1_stream"] == [5, 6]
    assert "5/6" in serving.table(rows)
    resources = serving.resource_table(rows)
    assert "0.70 / 0.80" in resources and "0.05 / 0.25" in resources and "50% / 60%" in resources


def test_the_performance_model_adds_compute_hops_and_wire_time() -> None:
    hosts = bench("hosts_bench")
    # One stage: no hops, no wire; only stage 0's own per-step cost on top.
    assert hosts.predict_tok_s([9.0], 1.0, 0.5, 0.0, 2304, None) == pytest.approx(100.0)
    # Two stages: two hops (Forward and Return), one boundary.
    base = hosts.predict_tok_s([4.0, 5.0], 1.0, 0.5, 0.0, 2304, None)
    assert base == pytest.approx(1000.0 / 11.0)
    delayed = hosts.predict_tok_s([4.0, 5.0], 1.0, 0.5, 20.0, 2304, None)
    assert delayed == pytest.approx(1000.0 / 51.0)
    # 100 Mbit/s: (2304 + framing) bytes cross the one boundary once per token.
    slow = hosts.predict_tok_s([4.0, 5.0], 1.0, 0.5, 0.0, 2304, 100e6)
    wire_ms = (2304 + hosts.FRAME_OVERHEAD_BYTES) * 8 / 100e6 * 1000
    assert slow == pytest.approx(1000.0 / (11.0 + wire_ms))
    assert [hosts.hops(n) for n in (1, 2, 3)] == [0, 2, 3]


def test_serving_compares_row_invariance_settings_in_one_run():
    serving = bench("serving_bench")
    args = serving.parse_args(["--row-invariant", "off,on", "--concurrency", "1,8"])
    assert args.arithmetic == ["off", "on"]
    with pytest.raises(SystemExit):
        serving.parse_args(["--row-invariant", "sometimes"])

    def row(streams: int, tokens_per_s: float, ttft: float) -> dict:
        return {
            "workload": "chat",
            "concurrency": streams,
            "aggregate_tokens_per_s": {"median": tokens_per_s},
            "ttft_s": {"median": ttft},
        }

    text = serving.price_table(
        {
            "off": [row(1, 20.0, 0.5), row(8, 80.0, 1.0)],
            "on": [row(1, 19.0, 0.5), row(8, 72.0, 1.1)],
        }
    )
    assert "tok/s on / off" in text
    assert "0.950" in text and "0.900" in text and "1.100" in text


def test_the_ceiling_replay_counts_rounds_drafts_and_time() -> None:
    ceiling = bench("spec_ceiling")
    code = tuple(range(1000, 1120))  # a file of 120 distinct tokens
    prompt = (1, 2, 3, *code, 4)
    round_s = (0.010, 0.001)
    # An answer that copies the file: the prediction drafts all of it; the suffix
    # drafter finds it in the prompt once a few tokens match.
    copy = ceiling.Answer("code-edit", "copy", prompt, (5, *code, 6), code)
    with_prediction = ceiling.replay(copy, "prediction", round_s, 0)
    assert with_prediction.tokens == len(copy.output) - 1
    assert with_prediction.accepted > 100 and with_prediction.rounds < 20
    assert with_prediction.time_s == pytest.approx(
        0.010 * with_prediction.rounds + 0.001 * with_prediction.drafted
    )
    default = ceiling.replay(copy, "default", round_s, 0)
    assert default.rounds < 30
    summary = ceiling.summarise([with_prediction], 0.010)
    assert summary["speedup"] > 3.0 and summary["tokens_per_round"] > 6.0
    # An answer in nothing the drafters have seen: one token per round, no speedup.
    fresh = ceiling.Answer("chat", "fresh", prompt, tuple(range(5000, 5060)), None)
    alone = ceiling.replay(fresh, "default", round_s, 0)
    assert (alone.rounds, alone.accepted) == (59, 0)
    assert ceiling.summarise([alone], 0.010)["speedup"] <= 1.0


@pytest.mark.parametrize("window", [1, 3])
def test_graph_bench_measures_every_mode_and_batch_on_a_cpu(
    window: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """On a CPU the graph modes run the same pieces eagerly: the table and JSON have
    every batch and mode, and the replayed path's logits equal the eager frame's."""
    graph_bench = bench("graph_bench")
    out = tmp_path / "graph.json"
    shape = "--layers 2 --hidden 64 --intermediate 128 --heads 4 --kv-heads 2 --vocab 256"
    argv = [*shape.split(), "--device", "cpu", "--dtype", "float32", "--position", "12"]
    argv += ["--batches", "1", "2", "5", "--repeats", "2", "--steps", "2"]
    graph_bench.main([*argv, "--window", str(window), "--json", str(out)])
    result = json.loads(out.read_text())
    assert [row["batch"] for row in result["rows"]] == [1, 2, 5]
    assert result["window"] == window
    for row in result["rows"]:
        assert set(row["repeats_ms"]) == {"eager", "graphs", "one by one"}
        assert all(len(times) == 2 for times in row["repeats_ms"].values())
        assert row["max_logit_difference"] <= 1e-5 * max(row["logit_scale"], 1.0)
    assert "| sessions |" in capsys.readouterr().out


def test_graph_invariance_compares_every_mode_with_a_session_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """On a CPU in float32 every mode stays within rounding of the session alone, and
    the per-session attention modes are exact; the table and JSON name every mode."""
    invariance = bench("graph_invariance")
    out = tmp_path / "invariance.json"
    shape = "--layers 2 --hidden 64 --intermediate 128 --heads 4 --kv-heads 2 --vocab 256"
    invariance.main([*shape.split(), "--device", "cpu", "--dtype", "float32", "--tokens", "3",
                     "--json", str(out)])  # fmt: skip
    rows = {row["mode"]: row for row in json.loads(out.read_text())["rows"]}
    assert list(rows) == list(invariance.MODES)
    for row in rows.values():
        assert row["positions"] == 8 * 3 and row["argmax_flips"] == 0
        assert row["max_logit_difference"] <= 1e-4 * max(row["logit_scale"], 1.0)
    assert rows["alone eager"]["max_logit_difference"] == 0.0
    assert rows["batch graphs, attention per session"]["max_logit_difference"] <= 1e-4
    assert "| batch graphs, attention per session |" in capsys.readouterr().out


def test_sampling_bench_times_every_choice_against_the_plain_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every choice on every logits shape, and a verify window's rows, timed both
    ways with the same tokens; the plain computation is the definition."""
    sampling = bench("sampling_bench")
    out = tmp_path / "sampling.json"
    sampling.main(["--vocab", "5000", "--repeats", "2", "--calls", "3", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 3 * len(sampling.CHOICES) + 2
    assert all(row["same_tokens"] for row in rows)
    assert all(len(row["repeats_us"]["this"]) == 2 and row["speedup"] > 0 for row in rows)
    assert "| 5000  | peaked | top_p 0.95" in capsys.readouterr().out


def test_the_device_options_reach_every_stage_a_benchmark_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--device``/``--cuda-graphs`` become the stages' own settings through the
    environment they inherit, and the machine record says which device ran."""
    serving = bench("serving_bench")
    common = bench("common")
    # Set, then removed: the monkeypatch then restores the variables' absence after
    # the test (configure() below writes os.environ itself).
    for name in ("MESH_STAGE_DEVICE", "MESH_STAGE_CUDA_GRAPHS"):
        monkeypatch.setenv(name, "unset by the test")
        monkeypatch.delenv(name)
    plain = serving.parse_args([])
    common.configure(plain)
    assert "MESH_STAGE_DEVICE" not in os.environ
    assert common.machine_info(1)["stage_device"] == "cpu"
    args = serving.parse_args(["--device", "cuda:1", "--cuda-graphs"])
    common.configure(args)
    assert os.environ["MESH_STAGE_DEVICE"] == "cuda:1"
    assert os.environ["MESH_STAGE_CUDA_GRAPHS"] == "true"
    machine = common.machine_info(1)
    assert (machine["stage_device"], machine["cuda_graphs"]) == ("cuda:1", "true")


def test_split_bench_times_the_whole_the_halves_and_the_gaps(
    tiny_package_factory, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The two halves give the whole model's logits, and every step and gap is timed."""
    split = bench("split_bench")
    out = tmp_path / "split.json"
    package = tiny_package_factory("llama", layers=4)
    split.main(["--package", str(package), "--repeats", "2", "--gaps-ms", "0", "1",
                "--out", str(out)])  # fmt: skip
    result = json.loads(out.read_text())
    assert result["max_logit_difference"] <= 1e-4 * max(result["logit_scale"], 1.0)
    assert set(result["back_to_back_ms"]) == {"whole", "split", "first half", "second half"}
    assert list(result["after_gap"]) == ["0 ms sleep", "1 ms sleep", "1 ms spin"]
    assert all(ms > 0 for ms in result["back_to_back_ms"].values())
    assert "| 1 ms spin" in capsys.readouterr().out
