"""Drafter cost per proposal and acceptance on an edit replay, for the n-gram and the
suffix drafter at several corpus sizes. No model and no mesh: the "target" is the
known answer of each request, verified greedily (a draft token is accepted while it
equals the answer's next token, then the answer's token is committed).

Token streams: the repository's own Python and Markdown files, tokenized with the
SmolLM2 tokenizer (the default package's ``tokenizer.json``, or ``--tokenizer``), or
with ``--source zipf`` random Zipf-distributed tokens in lines that repeat with edits.

Per corpus size the corpus is first filled with held-out files (and edited copies of
them once the originals run out), then two workloads replay through one scope:

- ``edit``: multi-turn edit conversations, one per replay file; a turn's prompt is
  the conversation so far (instruction, file) and its answer the edited file; each
  finished turn enters the corpus.
- ``recall``: later requests that ask for a file of the edit conversations by name
  with one more edit; the prompt does not hold the file, so only the corpus can help
  (a setting that favours the corpus by construction: it shows what it can recall).

It prints two tables (propose() cost; acceptance per workload) and writes JSON:

    .venv/bin/python benchmarks/proposer_bench.py --out bench-results/proposer.json
"""

from __future__ import annotations

import argparse
import gc
import itertools
import logging
import random
import re
import statistics
import time
import tracemalloc
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import (
    REPO_ROOT,
    command_line,
    emit,
    fmt,
    load_average,
    machine_info,
    render_table,
    write_json,
)

from mesh.package.default import default_package_dir
from mesh.speculative import Drafter, MemoryNgramDrafter, SharedCorpus, SuffixDrafter

logger = logging.getLogger("proposer_bench")

SOURCE_DIRS = ("mesh", "stage", "coordinator", "tests", "benchmarks", "docs")
SCOPE = "bench"
VOCAB = 49_152
IDENTIFIER = re.compile(r"\b[a-z_][a-z0-9_]{3,}\b")


@dataclass(frozen=True)
class Request:
    workload: str
    prompt: list[int]
    answer: list[int]


@dataclass
class Tally:
    """One drafter's figures over one workload."""

    propose_ns: list[int] = field(default_factory=list)
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    generated: int = 0
    finish_s: float = 0.0
    finished_tokens: int = 0


# ---- text and edits ------------------------------------------------------------------


def edit_text(text: str, rng: random.Random) -> tuple[str, str]:
    """One small edit (rename, insert, delete or renumber) and its description."""
    lines = text.splitlines(keepends=True)
    kind = rng.choice(["rename", "insert", "delete", "number"])
    if kind == "rename":
        names = sorted(set(IDENTIFIER.findall(text)))
        if names:
            old = rng.choice(names)
            new = f"{old}_{rng.randrange(100)}"
            return re.sub(rf"\b{old}\b", new, text), f"rename {old} to {new}"
    if kind == "delete" and len(lines) > 8:
        at = rng.randrange(len(lines) - 3)
        return "".join(lines[:at] + lines[at + rng.randint(1, 3) :]), f"delete line {at + 1}"
    if kind == "number":
        digits = [m for m in re.finditer(r"\b\d+\b", text)]
        if digits:
            m = rng.choice(digits)
            return text[: m.start()] + str(int(m.group()) + 1) + text[m.end() :], "bump a number"
    at = rng.randrange(len(lines) + 1)
    note = f"# checked: case {rng.randrange(1000)}\n"
    return "".join(lines[:at] + [note] + lines[at:]), f"insert a note at line {at + 1}"


def code_documents(
    tokenizer_path: Path,
) -> tuple[list[tuple[str, str]], Callable[[str], list[int]]]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    files = sorted(
        path
        for folder in SOURCE_DIRS
        for path in (REPO_ROOT / folder).rglob("*")
        if path.suffix in (".py", ".md") and "proto/v1" not in path.as_posix()
    )
    texts = [(str(path.relative_to(REPO_ROOT)), path.read_text()) for path in files]
    return texts, lambda text: tokenizer.encode(text).ids


def zipf_documents(count: int, rng: random.Random) -> tuple[list[tuple[str, str]], Callable]:
    """Documents of lines of Zipf tokens (vocab 49,152, s = 1.1); lines recur within
    and across documents, as statements do in code. Tokens are written as numbers;
    other words (instructions, inserted notes) map to a token by their CRC."""
    cumulative = list(itertools.accumulate(1.0 / (rank**1.1) for rank in range(1, VOCAB + 1)))

    def line() -> str:
        return " ".join(map(str, rng.choices(range(VOCAB), cum_weights=cumulative, k=12)))

    pool = [line() for _ in range(3000)]
    docs = []
    for number in range(count):
        lines = [
            rng.choice(pool) if rng.random() < 0.6 else line() for _ in range(rng.randint(40, 300))
        ]
        docs.append((f"doc{number}", "\n".join(lines) + "\n"))

    def encode(text: str) -> list[int]:
        return [int(w) if w.isdigit() else zlib.crc32(w.encode()) % VOCAB for w in text.split()]

    return docs, encode


# ---- workloads -------------------------------------------------------------------------


def build_requests(
    docs: list[tuple[str, str]],
    encode: Callable[[str], list[int]],
    files: int,
    turns: int,
    seed: int,
) -> tuple[list[list[int]], list[Request], list[Request]]:
    """(corpus filler documents, edit requests, recall requests)."""
    rng = random.Random(seed)
    sized = [d for d in docs if 600 <= len(d[1]) // 3 <= 3000]
    chosen = rng.sample(sized, files)
    fill_docs = [encode(text) for name, text in docs if (name, text) not in chosen and text]
    edits: list[Request] = []
    recalls: list[Request] = []
    for name, text in chosen:
        conversation: list[int] = []
        version = text
        for turn in range(turns):
            edited, what = edit_text(version, rng)
            conversation += encode(f"<user>\nIn {name}, {what}; reply with the whole file.\n")
            if turn == 0:
                conversation += encode(version)
            answer = encode(edited)
            edits.append(Request("edit", list(conversation), answer))
            conversation += answer
            version = edited
        edited, what = edit_text(version, rng)
        prompt = encode(f"<user>\nShow {name} as we left it, then {what}.\n")
        recalls.append(Request("recall", prompt, encode(edited)))
    return fill_docs, edits, recalls


def filler(docs: list[list[int]], tokens: int, rng: random.Random) -> list[list[int]]:
    """Documents totalling at least ``tokens``: the originals, then edited copies."""
    out, total, round_ = [], 0, 0
    while total < tokens and docs:
        for doc in docs if round_ == 0 else rng.sample(docs, len(docs)):
            if round_:
                at = rng.randrange(len(doc))
                doc = doc[:at] + [rng.randrange(VOCAB) for _ in range(4)] + doc[at + 2 :]
            out.append(doc)
            total += len(doc)
            if total >= tokens:
                break
        round_ += 1
    return out


# ---- replay --------------------------------------------------------------------------------


def replay(drafter: Drafter, request: Request, window: int, tally: Tally) -> None:
    """Drive ``drafter`` as stage 0 does, the request's answer standing in for the target."""
    answer = request.answer
    drafter.begin(request.prompt)
    drafter.accept(0, answer[0])  # the prefill's token
    done = 1
    while done < len(answer):
        k = min(window, len(answer) - done - 1)
        started = time.perf_counter_ns()
        proposal = drafter.propose(k)
        tally.propose_ns.append(time.perf_counter_ns() - started)
        accepted = 0
        while accepted < len(proposal) and proposal[accepted] == answer[done + accepted]:
            accepted += 1
        drafter.accept(accepted, answer[done + accepted])
        tally.rounds += 1
        tally.drafted += len(proposal)
        tally.accepted += accepted
        done += accepted + 1
    tally.generated += len(answer) - 1
    started = time.perf_counter_ns()
    drafter.finish()
    tally.finish_s += (time.perf_counter_ns() - started) / 1e9
    tally.finished_tokens += len(request.prompt) + len(answer)


def percentile(values: list[int], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1000 if ordered else float("nan")


def fill(corpus: SharedCorpus, docs: list[list[int]]) -> float:
    started = time.perf_counter()
    for doc in docs:
        corpus.add(SCOPE, doc)
    return time.perf_counter() - started


def corpus_bytes(size: int, docs: list[list[int]]) -> int:
    """Python memory held by a corpus filled to ``size`` tokens (tracemalloc)."""
    gc.collect()
    tracemalloc.start()
    corpus = SharedCorpus(size)
    fill(corpus, docs)
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del corpus
    return held


def run_size(
    name: str,
    size: int | None,
    make: Callable[[SharedCorpus | None], Drafter],
    fill_docs,
    edits,
    recalls,
    args,
) -> dict[str, Any]:
    corpus = SharedCorpus(size) if size else None
    docs = filler(fill_docs, size or 0, random.Random(args.seed))
    fill_s = fill(corpus, docs) if corpus is not None else 0.0
    tallies = {"edit": Tally(), "recall": Tally()}
    for request in [*edits, *recalls]:
        replay(make(corpus), request, args.window, tallies[request.workload])
    row: dict[str, Any] = {"drafter": name, "corpus_tokens": size, "fill_s": fill_s}
    if corpus is not None:
        row["corpus"] = corpus.stats().__dict__
        row["fill_us_per_token"] = 1e6 * fill_s / max(1, sum(len(d) for d in docs))
        if args.memory:
            row["corpus_bytes"] = corpus_bytes(size, docs)
    every = tallies["edit"].propose_ns + tallies["recall"].propose_ns
    row["propose_us"] = {
        "median": statistics.median(every) / 1000,
        "p90": percentile(every, 0.9),
        "p99": percentile(every, 0.99),
        "calls": len(every),
    }
    finished = sum(t.finished_tokens for t in tallies.values())
    row["finish_us_per_token"] = 1e6 * sum(t.finish_s for t in tallies.values()) / finished
    row["workloads"] = {
        workload: {
            "requests": len(edits if workload == "edit" else recalls),
            "generated": t.generated,
            "rounds": t.rounds,
            "drafted": t.drafted,
            "accepted": t.accepted,
            "accept_rate": t.accepted / t.drafted if t.drafted else float("nan"),
            "tokens_per_round": t.generated / t.rounds if t.rounds else float("nan"),
        }
        for workload, t in tallies.items()
    }
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", choices=["code", "zipf"], default="code")
    parser.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        help="tokenizer.json (default: the default package's)",
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=[0, 10_000, 100_000, 1_000_000])
    parser.add_argument("--window", type=int, default=8, help="k asked of every propose()")
    parser.add_argument("--files", type=int, default=6, help="edit conversations")
    parser.add_argument("--turns", type=int, default=3, help="turns per conversation")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--memory", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--out", type=Path, default=Path("bench-results") / "proposer.json")
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper())
    load_at_start = load_average()
    if args.source == "code":
        docs, encode = code_documents(args.tokenizer or default_package_dir() / "tokenizer.json")
    else:
        docs, encode = zipf_documents(400, random.Random(args.seed))
    fill_docs, edits, recalls = build_requests(docs, encode, args.files, args.turns, args.seed)
    rows = [
        run_size("ngram", None, lambda _: MemoryNgramDrafter(2, 6), fill_docs, edits, recalls, args)
    ]
    for size in args.sizes:

        def make(corpus: SharedCorpus | None) -> Drafter:
            return SuffixDrafter(2, 6, corpus=corpus.view(SCOPE) if corpus else None)

        rows.append(run_size("suffix", size, make, fill_docs, edits, recalls, args))
    emit(
        render_table(
            [
                "drafter",
                "corpus",
                "propose median µs",
                "p90 µs",
                "p99 µs",
                "calls",
                "finish µs/token",
                "fill µs/token",
                "corpus MB",
            ],
            [
                [
                    r["drafter"],
                    "-" if r["corpus_tokens"] is None else f"{r['corpus_tokens']:,}",
                    fmt(r["propose_us"]["median"], 1),
                    fmt(r["propose_us"]["p90"], 1),
                    fmt(r["propose_us"]["p99"], 1),
                    str(r["propose_us"]["calls"]),
                    fmt(r["finish_us_per_token"], 2),
                    fmt(r.get("fill_us_per_token"), 2),
                    fmt(r["corpus_bytes"] / 2**20, 1) if "corpus_bytes" in r else "-",
                ]
                for r in rows
            ],
        )
    )
    emit("")
    emit(
        render_table(
            [
                "drafter",
                "corpus",
                "workload",
                "generated",
                "rounds",
                "drafted",
                "accept rate",
                "tokens/round",
            ],
            [
                [
                    r["drafter"],
                    "-" if r["corpus_tokens"] is None else f"{r['corpus_tokens']:,}",
                    w,
                    str(v["generated"]),
                    str(v["rounds"]),
                    str(v["drafted"]),
                    fmt(v["accept_rate"]),
                    fmt(v["tokens_per_round"]),
                ]
                for r in rows
                for w, v in r["workloads"].items()
            ],
        )
    )
    machine = machine_info(1)
    machine["load_average_at_start"] = load_at_start
    machine["load_average_at_end"] = load_average()
    write_json(
        args.out,
        {
            "benchmark": "proposer_bench",
            "command": command_line(),
            "machine": machine,
            "source": args.source,
            "window": args.window,
            "edit_requests": len(edits),
            "recall_requests": len(recalls),
            "rows": rows,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
