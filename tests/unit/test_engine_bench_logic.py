"""The pure parts of benchmarks/engine_bench.py and benchmarks/quant_quality.py:
arguments, prompt fitting, figures, ratios, goals, and the quality maths."""

from __future__ import annotations

import importlib
import math
import sys
from pathlib import Path

import pytest
import torch

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks"


def bench(name: str):
    if str(BENCH_DIR) not in sys.path:
        sys.path.insert(0, str(BENCH_DIR))
    return importlib.import_module(name)


# ---- arguments -----------------------------------------------------------------------


def test_engine_bench_arguments():
    engine_bench = bench("engine_bench")
    args = engine_bench.build_parser().parse_args([])
    assert (args.tokens, args.repeats, args.compile_variants) == (128, 3, True)
    assert args.threads >= 1
    assert args.out == Path("bench-results/engine.json")
    args = engine_bench.build_parser().parse_args(["--no-compile", "--threads", "2"])
    assert args.compile_variants is False and args.threads == 2


def test_engine_bench_row_invariance_rows_and_price():
    engine_bench = bench("engine_bench")
    args = engine_bench.build_parser().parse_args(["--row-invariant", "off,on"])
    assert engine_bench.row_modes(args) == ["off", "on"]
    with pytest.raises(SystemExit):
        engine_bench.row_modes(engine_bench.build_parser().parse_args(["--row-invariant", "x"]))
    variant = engine_bench.package_variants(32)[3][0]
    rows = [engine_bench.mesh_row(variant, "bfloat16", False, mode) for mode in ("off", "on")]
    assert [r.key for r in rows] == [
        f"mesh-{variant.name}-eager-ri-off",
        f"mesh-{variant.name}-eager-ri-on",
    ]
    assert engine_bench.mesh_row(variant, "bfloat16", False).key == f"mesh-{variant.name}-eager"
    summary = {
        rows[0].key: {"chat": {"decode_tok_s": 50.0}, "code": {"decode_tok_s": 40.0}},
        rows[1].key: {"chat": {"decode_tok_s": 45.0}, "code": {"decode_tok_s": 40.0}},
    }
    (price,) = engine_bench.invariance_price(rows, summary)
    assert price == {"row": f"mesh-{variant.name}-eager", "chat": 0.9, "code": 1.0}


def test_quant_quality_arguments_and_rows():
    quant_quality = bench("quant_quality")
    args = quant_quality.build_parser().parse_args([])
    assert (args.tokens, args.max_prompt_tokens, args.group_sizes) == (64, 512, [32])
    args = quant_quality.build_parser().parse_args(["--group-sizes", "32", "128"])
    labels = [c.label for c in quant_quality.candidates(args.group_sizes)]
    assert labels == [
        "dense-float32",
        "int8",
        "int4-g32",
        "int4-g128",
        "int4-g32-int4head",
        "int4-g128-int4head",
    ]
    dtypes = [c.dtype for c in quant_quality.candidates([32])]
    assert dtypes == ["float32", "bfloat16", "bfloat16", "bfloat16"]


def test_quant_quality_gguf_rows_and_prompt_spread():
    quant_quality = bench("quant_quality")
    args = quant_quality.build_parser().parse_args([])
    assert args.gguf_types[0] == "Q4_K_M" and args.gguf_forms == ["int4", "int8"]
    args = quant_quality.build_parser().parse_args(
        ["--gguf-types", "Q4_K_M", "Q6_K", "--gguf-forms", "int4", "--max-prompts", "3"]
    )
    rows = quant_quality.candidates([32], args.gguf_types, args.gguf_forms)[4:]
    assert [r.label for r in rows] == ["Q4_K_M file -> int4-g32", "Q6_K file -> int4-g32"]
    (dense,) = quant_quality.candidates([32], ["Q8_0"], ["dense"])[4:]
    assert dense.label == "Q8_0 file -> dense-bfloat16" and dense.variant.quant is None
    assert quant_quality.build_parser().parse_args(["--gguf-types"]).gguf_types == []
    with pytest.raises(SystemExit):
        quant_quality.build_parser().parse_args(["--gguf-types", "Q3_K"])
    prompts = [
        quant_quality.QualityPrompt(f"{w}-{i}", w, (1,)) for w in ("chat", "code") for i in range(3)
    ]
    chosen = quant_quality.spread_prompts(prompts, args.max_prompts)
    assert [p.request_id for p in chosen] == ["chat-0", "code-0", "chat-1"]
    assert quant_quality.spread_prompts(prompts, 0) == prompts


def test_package_variants_name_their_directories():
    single_stage = bench("single_stage")
    engine_bench = bench("engine_bench")
    names = [(v.name, dtype) for v, dtype in engine_bench.package_variants(64)]
    assert names == [
        ("dense-float32", "float32"),
        ("dense-bfloat16", "bfloat16"),
        ("int8", "bfloat16"),
        ("int4-g64", "bfloat16"),
        ("int4-g64-int4head", "bfloat16"),
    ]
    assert single_stage.PackageVariant("bfloat16", "int4").name == "int4"


# ---- prompts -------------------------------------------------------------------------


def test_fit_prompt_keeps_the_tail_and_cuts_the_head():
    single_stage = bench("single_stage")
    head, tail = list(range(10)), [100, 101]
    assert single_stage.fit_prompt(head, tail, None) == head + tail
    assert single_stage.fit_prompt(head, tail, 12) == head + tail
    assert single_stage.fit_prompt(head, tail, 5) == [0, 1, 2, 100, 101]
    with pytest.raises(ValueError, match="no room"):
        single_stage.fit_prompt(head, tail, 2)


def test_choose_closest_prefers_the_shortest_that_reaches_the_target():
    engine_bench = bench("engine_bench")
    assert engine_bench.choose_closest([150, 320, 480, 700], 400) == 2
    assert engine_bench.choose_closest([400, 500], 400) == 0
    assert engine_bench.choose_closest([120, 230, 90], 400) == 1
    with pytest.raises(ValueError):
        engine_bench.choose_closest([], 400)


class WordTokenizer:
    """One id per word; the template wraps the last message like a chat model's."""

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        assert add_generation_prompt and not tokenize
        body = " ".join(f"<user> {m['content']} <end>" for m in messages)
        return body + " <assistant>"

    def encode(self, text, add_special_tokens):
        return [len(word) for word in text.split()]


def test_chat_prompt_parts_split_after_the_last_content():
    single_stage = bench("single_stage")
    head, tail = single_stage.chat_prompt_parts(
        WordTokenizer(), [{"role": "user", "content": "a bb"}]
    )
    assert head == [6, 1, 2]  # <user> a bb
    assert tail == [5, 11]  # <end> <assistant>


def test_code_prompt_joins_requests_until_long_enough():
    common = bench("common")
    engine_bench = bench("engine_bench")

    def request(rid, workload, text):
        return common.WorkloadRequest(workload, rid, ({"role": "user", "content": text},), 8)

    workloads = {
        "chat": [request("c0", "chat", "hi there")],
        "code-edit": [request(f"e{i}", "code-edit", "x " * 4) for i in range(3)],
    }
    chat, code = engine_bench.build_prompts(WordTokenizer(), workloads, 10)
    assert (chat.name, chat.source, len(chat.ids)) == ("chat", "c0", 5)
    # one request: 1 + 4 + 2 = 7 ids; two: 1 + 8 + 2 = 11, cut to 10, tail kept
    assert (code.source, len(code.ids)) == ("e0+e1", 10)
    assert code.ids[-2:] == (5, 11)


# ---- engines, figures and the table --------------------------------------------------


def test_greedy_token_never_picks_a_banned_id():
    single_stage = bench("single_stage")
    scores = torch.tensor([0.1, 3.0, 2.0, 3.0])
    assert single_stage.greedy_token(scores) == 1
    assert single_stage.greedy_token(scores, [1]) == 3
    assert single_stage.greedy_token(scores, [1, 3]) == 2
    assert scores[1] == 3.0  # the caller's scores are left alone


def test_unique_param_bytes_counts_shared_tensors_once():
    engine_bench = bench("engine_bench")
    embed = torch.zeros(10, 4)
    norm = torch.zeros(4, dtype=torch.bfloat16)
    assert engine_bench.unique_param_bytes([embed, norm, embed]) == 10 * 4 * 4 + 4 * 2


def test_generation_figures_exclude_prefill_from_decode():
    single_stage = bench("single_stage")
    engine_bench = bench("engine_bench")
    generation = single_stage.Generation([5, 6, 7, 8, 9], started=10.0, stamps=[12, 13, 14, 15, 16])
    figures = engine_bench.generation_figures(generation, prompt_tokens=400)
    assert figures["prefill_tok_s"] == pytest.approx(200.0)
    assert figures["decode_tok_s"] == pytest.approx(1.0)
    assert figures["tokens"] == [5, 6, 7, 8, 9]
    single = engine_bench.generation_figures(single_stage.Generation([5], 0.0, [1.0]), 4)
    assert math.isnan(single["decode_tok_s"])


def test_summarize_takes_medians_and_first_tokens():
    engine_bench = bench("engine_bench")
    runs = {
        "chat": [
            {"prefill_tok_s": p, "decode_tok_s": d, "tokens": [i]}
            for i, (p, d) in enumerate([(100, 10), (300, 30), (200, 20)])
        ],
        "code": [],
    }
    summary = engine_bench.summarize(runs)
    assert summary["chat"] == {"prefill_tok_s": 200, "decode_tok_s": 20, "runs": 3, "tokens": [0]}
    assert math.isnan(summary["code"]["decode_tok_s"]) and summary["code"]["tokens"] == []


def test_first_difference():
    engine_bench = bench("engine_bench")
    assert engine_bench.first_difference([1, 2, 3, 4], [1, 2, 3, 9], 3) is None
    assert engine_bench.first_difference([1, 2, 3, 4], [1, 2, 3, 9], 4) == 3
    assert engine_bench.first_difference([1, 2], [1, 2, 3], 3) == 2


def _engines_and_summary(engine_bench):
    Engine = engine_bench.Engine

    def figures(chat, code, tokens=(1, 2, 3)):
        return {
            "chat": {"decode_tok_s": chat, "prefill_tok_s": 100.0, "tokens": list(tokens)},
            "code": {"decode_tok_s": code, "prefill_tok_s": 50.0, "tokens": list(tokens)},
        }

    engines = [
        Engine("hf-float32", "HF generate", "float32", "float32", param_bytes=538_000_000),
        Engine("hf-bfloat16", "HF generate", "bfloat16", "bfloat16"),
        Engine("mesh-dense-float32-eager", "mesh", "float32", "float32", compile=False),
        Engine("mesh-int4-g32-eager", "mesh", "int4-g32 @ bfloat16", "bfloat16", compile=False),
        Engine("mesh-int8-eager", "mesh", "int8 @ bfloat16", "bfloat16", compile=False),
        Engine(engine_bench.LLAMA_KEY, "llama.cpp", "GGUF Q4_1", None, param_note=" (GGUF file)"),
    ]
    engines[3].param_bytes = 120_000_000
    engines[4].error = "crashed (SIGSEGV) in a probe run"
    summary = {
        "hf-float32": figures(10.0, 8.0),
        "hf-bfloat16": figures(12.0, 10.0),
        "mesh-dense-float32-eager": figures(20.0, 10.0, tokens=(1, 2, 4)),
        "mesh-int4-g32-eager": figures(60.0, 40.0),
        "mesh-int8-eager": figures(math.nan, math.nan, tokens=()),
        engine_bench.LLAMA_KEY: figures(80.0, 50.0),
    }
    return engines, summary


def test_compare_uses_the_same_dtype_hf_row_and_llama_cpp():
    engine_bench = bench("engine_bench")
    engines, summary = _engines_and_summary(engine_bench)
    dense = engine_bench.compare(engines[2], summary, check_tokens=32)
    assert dense["vs_hf"] == {"chat": 2.0, "code": 1.25}
    assert dense["vs_llama"] == {"chat": 0.25, "code": 0.2}
    assert dense["first_token_difference"] == {"chat": 2, "code": 2}
    int4 = engine_bench.compare(engines[3], summary, check_tokens=32)
    assert int4["vs_hf"] == {"chat": 5.0, "code": 4.0}  # against HF bfloat16
    assert int4["first_token_difference"] == {"chat": None, "code": None}
    failed = engine_bench.compare(engines[4], summary, check_tokens=32)
    assert math.isnan(failed["vs_hf"]["chat"]) and failed["first_token_difference"]["chat"] == "n/a"


def test_goals_judge_the_worse_prompt_and_never_raise():
    engine_bench = bench("engine_bench")
    engines, summary = _engines_and_summary(engine_bench)
    rows = {e.key: engine_bench.compare(e, summary, 32) for e in engines}
    goals = {g["goal"]: g for g in engine_bench.goals(engines, rows, gguf_bytes=100_000_000)}
    dense = goals["mesh-dense-float32-eager decode >= 1.5x HF float32"]
    assert (dense["value"], dense["met"]) == (1.25, False)
    assert goals["mesh-int4-g32-eager decode >= 1.5x HF bfloat16"]["met"] is True
    llama = goals["mesh-int4-g32-eager decode >= 0.7x llama.cpp"]
    assert (llama["value"], llama["met"]) == (0.75, True)
    assert goals["mesh-int8-eager decode >= 1.5x HF bfloat16"]["met"] is None
    memory = goals["mesh-int4-g32-eager parameter bytes <= 1.3x GGUF file"]
    assert (memory["value"], memory["met"]) == (1.2, True)
    no_int4 = engine_bench.goals(engines[:3], rows, gguf_bytes=100_000_000)
    assert not any("parameter bytes" in g["goal"] for g in no_int4)


def test_table_rows_show_figures_ratios_and_failures():
    engine_bench = bench("engine_bench")
    engines, summary = _engines_and_summary(engine_bench)
    rows = {e.key: engine_bench.compare(e, summary, 32) for e in engines}
    table = {(r[0], r[1]): r for r in engine_bench.table_rows(engines, summary, rows)}
    assert all(len(r) == len(engine_bench.TABLE_HEADERS) for r in table.values())
    assert table[("mesh", "float32")][2:9] == [
        "off",
        "100.0 / 50.0",
        "20.0 / 10.0",
        "-",
        "2.00x / 1.25x",
        "0.25x / 0.20x",
        "no@2 / no@2",
    ]
    assert table[("HF generate", "float32")][5:7] == ["538.0", "1.00x / 1.00x"]
    assert table[("mesh", "int8 @ bfloat16")][3] == "-"
    assert table[("mesh", "int8 @ bfloat16")][-1] == "crashed (SIGSEGV) in a probe run"
    assert table[("llama.cpp", "GGUF Q4_1")][5:8] == ["- (GGUF file)", "-", "-"]


def test_probe_failure_reads_the_child_exit():
    single_stage = bench("single_stage")
    assert single_stage.probe_failure(0, "noise") is None
    assert single_stage.probe_failure(-11, "") == "crashed (SIGSEGV) in a probe run"
    message = single_stage.probe_failure(1, "Traceback\n  ...\nTypeError: bad\n\n")
    assert message == "probe run failed: TypeError: bad"


def test_package_eos_ids(tmp_path: Path):
    single_stage = bench("single_stage")
    assert single_stage.package_eos_ids(tmp_path) == []
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [2, 0, 2]}')
    assert single_stage.package_eos_ids(tmp_path) == [0, 2]
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": 7}')
    assert single_stage.package_eos_ids(tmp_path) == [7]


# ---- quality maths -------------------------------------------------------------------


def test_generated_rows_predict_the_generated_tokens():
    quant_quality = bench("quant_quality")
    # prompt of 3 ids, 2 generated: rows 2 and 3 predict sequence positions 3 and 4
    assert quant_quality.generated_rows(3, 2) == slice(2, 4)
    assert list(range(5))[quant_quality.generated_rows(3, 2)] == [2, 3]
    with pytest.raises(ValueError):
        quant_quality.generated_rows(0, 2)


def test_greedy_agreement_counts_matching_argmaxes():
    quant_quality = bench("quant_quality")
    reference = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 9.0], [1.0, 2.0, 0.0]])
    other = torch.tensor([[0.0, 4.0, 1.0], [0.0, 3.0, 1.0], [0.0, 1.0, 7.0], [2.0, 1.0, 0.0]])
    assert quant_quality.greedy_agreement(reference, other) == pytest.approx(0.5)
    assert quant_quality.greedy_agreement(reference, reference) == 1.0
    with pytest.raises(ValueError, match="equal"):
        quant_quality.greedy_agreement(reference, other[:2])


def test_mean_kl_matches_the_definition():
    quant_quality = bench("quant_quality")
    p = torch.tensor([0.5, 0.25, 0.25])
    q = torch.tensor([0.25, 0.5, 0.25])
    expected = float((p * (p / q).log()).sum())  # 0.5 ln 2 - 0.25 ln 2 = 0.25 ln 2
    assert expected == pytest.approx(0.25 * math.log(2))
    # logits are log-probabilities up to a constant per row, which softmax removes
    reference = torch.stack([p.log() + 3.0, p.log()]).to(torch.bfloat16)
    other = torch.stack([q.log() - 1.0, p.log()]).to(torch.bfloat16)
    per_row = quant_quality.kl_per_position(reference, other)
    assert per_row.dtype == torch.float32
    assert per_row[1].item() == pytest.approx(0.0, abs=1e-6)
    assert quant_quality.mean_kl(reference, other) == pytest.approx(expected / 2, rel=0.05)
    assert quant_quality.mean_kl(other, other) == pytest.approx(0.0, abs=1e-6)
    # the reference's distribution weighs the log ratio: KL is not symmetric
    sure, unsure = torch.tensor([[0.9, 0.1]]).log(), torch.tensor([[0.5, 0.5]]).log()
    assert quant_quality.mean_kl(sure, unsure) == pytest.approx(
        0.9 * math.log(1.8) + 0.1 * math.log(0.2), rel=1e-5
    )
    assert quant_quality.mean_kl(unsure, sure) == pytest.approx(
        0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1), rel=1e-5
    )


def test_pooled_weighs_prompts_by_positions():
    quant_quality = bench("quant_quality")
    figures = quant_quality.pooled(
        [
            {"positions": 3, "agreement": 1.0, "mean_kl": 0.1},
            {"positions": 1, "agreement": 0.0, "mean_kl": 0.5},
        ]
    )
    assert figures["positions"] == 4
    assert figures["agreement"] == pytest.approx(0.75)
    assert figures["mean_kl"] == pytest.approx(0.2)
    assert figures["worst_kl"] == 0.5
    assert math.isnan(quant_quality.pooled([])["agreement"])


def test_goal_lines_print_verdicts():
    engine_bench = bench("engine_bench")
    engines, summary = _engines_and_summary(engine_bench)
    rows = {e.key: engine_bench.compare(e, summary, 32) for e in engines}
    goal_list = engine_bench.goals(engines, rows, gguf_bytes=100_000_000)
    text = "\n".join(engine_bench.goal_lines(engines, goal_list, 100_000_000))
    assert "int4 parameter bytes / GGUF file size 1.20" in text
    assert "mesh-dense-float32-eager decode >= 1.5x HF float32: 1.25 -> NOT met" in text
    assert "mesh-int8-eager decode >= 1.5x HF bfloat16: - -> not measured" in text
