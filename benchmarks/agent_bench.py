"""Agent loop: multi-turn tool-calling conversations on a local mesh, with the prefix
cache off and on (two meshes side by side, measured in alternating order).

Each conversation starts from a request of ``workloads.jsonl`` (its user message)
after a system prompt holding tool definitions and repository files that bring the
first prompt to about ``--history-tokens`` tokens. Each turn streams the model's
answer (greedy, ``--max-tokens``), then appends it as an assistant message carrying
a tool call, and the tool's result (a file excerpt or test output, different every
turn): every turn resends the whole conversation plus the new messages, as coding
agents do. A tag unique to the conversation and the repeat starts the system
prompt, so a conversation finds only its own earlier turns in the cache, never the
text of another conversation or of a previous repeat.

Per turn (turn 1 is the first prompt, which no cache can help): client-side time to
first token (the first streamed chunk, sent once the first token exists), decode
tokens/s of the stream, prompt and cached tokens; medians over conversations and
repeats; the TTFT ratio without / with the cache; and whether both meshes gave
identical text (they must).

    .venv/bin/python benchmarks/agent_bench.py --repeats 2
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import time
from typing import Any

from common import (
    MeshConfig,
    RunningMesh,
    WorkloadRequest,
    add_common_arguments,
    command_line,
    configure,
    default_workloads_path,
    emit,
    fmt,
    load_average,
    load_workloads,
    machine_info,
    median,
    openai_client,
    ratio,
    render_table,
    resolve_package,
    running_meshes,
    write_json,
)

from mesh.package.manifest import PackageManifest

logger = logging.getLogger("agent_bench")

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {key: {"type": "string"} for key in keys},
                "required": list(keys),
            },
        },
    }
    for name, description, keys in (
        ("read_file", "Read a file of the repository.", ("path",)),
        ("run_tests", "Run the test suite, or one test file, and return its output.", ("target",)),
        ("write_file", "Replace a file of the repository with new content.", ("path", "content")),
    )
]


def repository_context(workloads: dict[str, list[WorkloadRequest]], tokenizer, target: int) -> str:
    """Tool rules and repository files, about ``target`` tokens: the code blocks of
    every workload request, then generated modules until the target is reached."""
    parts = [
        "You are a coding agent working in a Python repository. Use the tools to read "
        "files, run tests and write files; answer briefly. The repository's files follow."
    ]
    blocks = [
        block
        for requests in workloads.values()
        for request in requests
        for message in request.messages
        for block in re.findall(r"```python\n(.*?)```", message["content"], re.DOTALL)
    ]
    index = 0
    while len(tokenizer.encode("\n\n".join(parts))) < target:
        if index < len(blocks):
            body = blocks[index]
        else:
            n = index - len(blocks)
            body = (
                f"def transform_{n}(records, scale={n % 7 + 2}):\n"
                f"    out = []\n    for record in records:\n"
                f"        if record.get('kind') == 'k{n % 5}':\n"
                f"            out.append(record['value'] * scale + {n})\n"
                f"    return sorted(out)[: {n % 11 + 3}]\n"
            )
        parts.append(f"File src/module_{index}.py:\n```python\n{body}```")
        index += 1
    return "\n\n".join(parts)


def tool_turn(turn: int, seed: WorkloadRequest) -> tuple[dict[str, Any], str]:
    """The tool call the agent makes after turn ``turn`` and the tool's result."""
    if turn % 2 == 0:
        call = {"name": "read_file", "arguments": json.dumps({"path": f"src/module_{turn}.py"})}
        result = f"# src/module_{turn}.py ({seed.request_id})\n" + "\n".join(
            f"LIMIT_{turn}_{i} = {i * 17 + turn}" for i in range(8)
        )
    else:
        call = {"name": "run_tests", "arguments": json.dumps({"target": f"tests/test_{turn}.py"})}
        result = (
            f"tests/test_{turn}.py::test_{seed.request_id.replace('-', '_')} FAILED\n"
            f"AssertionError: expected {turn * 3}, got {turn * 3 + 1}\n"
            f"{turn + 4} passed, 1 failed in 0.{turn}3s"
        )
    return call, result


def converse(
    mesh: RunningMesh,
    seed: WorkloadRequest,
    context: str,
    tag: str,
    turns: int,
    max_tokens: int,
    tools: bool = True,
) -> list[dict[str, Any]]:
    """One conversation of ``turns`` turns; a record per turn. ``tools``: the
    requests declare the tools (their descriptions are part of every prompt)."""
    client = openai_client(mesh.http_url)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": f"[{tag}] {context}"},
        *[dict(m) for m in seed.messages],
    ]
    records = []
    for turn in range(1, turns + 1):
        started = time.perf_counter()
        stream = client.chat.completions.create(
            model=mesh.model_id,
            messages=messages,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            **({"tools": TOOLS} if tools else {}),
        )
        first = last = None
        usage = None
        text = []
        for chunk in stream:
            now = time.perf_counter()
            first = first if first is not None else now
            if chunk.choices:
                delta = chunk.choices[0].delta
                if delta.content:
                    text.append(delta.content)
                    last = now
                if delta.tool_calls:
                    text.append(json.dumps([c.model_dump() for c in delta.tool_calls]))
                    last = now
            if chunk.usage is not None:
                usage = chunk.usage
        tokens = usage.completion_tokens if usage is not None else 0
        decode_s = (last - first) if first is not None and last is not None else 0.0
        records.append(
            {
                "conversation": tag,
                "seed": seed.request_id,
                "turn": turn,
                "ttft_s": (first - started) if first is not None else float("nan"),
                "decode_tokens_per_s": (tokens - 1) / decode_s if tokens > 1 and decode_s else None,
                "completion_tokens": tokens,
                "prompt_tokens": usage.prompt_tokens if usage is not None else 0,
                "cached_tokens": (
                    usage.prompt_tokens_details.cached_tokens
                    if usage is not None and usage.prompt_tokens_details
                    else 0
                ),
                "text": "".join(text),
            }
        )
        call, result = tool_turn(turn, seed)
        call_id = f"call_{turn}"
        messages += [
            {
                "role": "assistant",
                "content": "".join(text),
                "tool_calls": [{"id": call_id, "type": "function", "function": call}],
            },
            {"role": "tool", "tool_call_id": call_id, "content": result},
        ]
    return records


def summarize(records: list[dict[str, Any]], turns: int) -> list[dict[str, Any]]:
    rows = []
    for turn in range(1, turns + 1):
        mine = [r for r in records if r["turn"] == turn]
        speeds = [r["decode_tokens_per_s"] for r in mine if r["decode_tokens_per_s"]]
        rows.append(
            {
                "turn": turn,
                "samples": len(mine),
                "ttft_s": median([r["ttft_s"] for r in mine]),
                "decode_tokens_per_s": median(speeds) if speeds else None,
                "prompt_tokens": median([r["prompt_tokens"] for r in mine]),
                "cached_tokens": median([r["cached_tokens"] for r in mine]),
            }
        )
    return rows


def table(off: list[dict[str, Any]], on: list[dict[str, Any]]) -> str:
    headers = [
        "turn",
        "prompt tok",
        "cached tok (on)",
        "TTFT off s",
        "TTFT on s",
        "TTFT off/on",
        "decode tok/s off",
        "decode tok/s on",
        "decode on/off",
    ]
    rows = []
    for a, b in zip(off, on, strict=True):
        rows.append(
            [
                str(a["turn"]),
                fmt(a["prompt_tokens"], 0),
                fmt(b["cached_tokens"], 0),
                fmt(a["ttft_s"], 3),
                fmt(b["ttft_s"], 3),
                fmt(ratio(a["ttft_s"], b["ttft_s"])),
                fmt(a["decode_tokens_per_s"]),
                fmt(b["decode_tokens_per_s"]),
                fmt(ratio(b["decode_tokens_per_s"] or 0.0, a["decode_tokens_per_s"] or 0.0), 3),
            ]
        )
    return render_table(headers, rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_arguments(parser, "agent")
    parser.add_argument("--stages", type=int, default=2, help="stage processes of each mesh")
    parser.add_argument("--turns", type=int, default=4, help="turns per conversation")
    parser.add_argument(
        "--conversations", type=int, default=2, help="conversations per workload per repeat"
    )
    parser.add_argument(
        "--history-tokens", type=int, default=2000, help="tokens of the first prompt's context"
    )
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per answer")
    parser.add_argument(
        "--no-tools",
        action="store_true",
        help="leave the tool definitions out of the requests (tool calls and results stay "
        "in the conversation); for models with a short context",
    )
    parser.add_argument(
        "--prefix-cache-tokens", type=int, default=16384, help="the cached mesh's cache size"
    )
    args = parser.parse_args(argv)
    if args.turns < 2:
        parser.error("--turns must be at least 2: turn 1 has nothing to reuse")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure(args)
    package = resolve_package(args.package)
    manifest = PackageManifest.load(package)
    workloads = load_workloads(args.workloads or default_workloads_path())
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(package)
    context = repository_context(workloads, tokenizer, args.history_tokens)
    seeds = [r for requests in workloads.values() for r in requests[: args.conversations]]
    configs = [
        MeshConfig(args.stages, prefix_cache_tokens=0),
        MeshConfig(args.stages, prefix_cache_tokens=args.prefix_cache_tokens),
    ]
    machine = machine_info(args.threads)
    started = time.time()
    records: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    with running_meshes(
        package,
        configs,
        threads=args.threads,
        workdir=args.workdir,
        heartbeat_timeout_s=args.heartbeat_timeout,
    ) as meshes:
        by_mode = dict(zip(("off", "on"), meshes, strict=True))
        warm = seeds[0]
        for mesh in meshes:  # one short conversation each, not measured
            converse(mesh, warm, context[:400], f"warm-up {time.time()}", 2, 4, not args.no_tools)
        for repeat in range(args.repeats):
            for number, seed in enumerate(seeds):
                tag = f"r{repeat}-c{number}-{time.time():.6f}"
                order = ("off", "on") if (repeat + number) % 2 == 0 else ("on", "off")
                for mode in order:
                    got = converse(
                        by_mode[mode],
                        seed,
                        context,
                        tag,
                        args.turns,
                        args.max_tokens,
                        not args.no_tools,
                    )
                    for record in got:
                        record["repeat"] = repeat
                    records[mode].extend(got)
                    logger.info(
                        "repeat %s %s %s: TTFT %s",
                        repeat,
                        seed.request_id,
                        mode,
                        [round(r["ttft_s"], 2) for r in got],
                    )
    identical = sum(
        a["text"] == b["text"] for a, b in zip(records["off"], records["on"], strict=True)
    )
    off = summarize(records["off"], args.turns)
    on = summarize(records["on"], args.turns)
    later = [ratio(a["ttft_s"], b["ttft_s"]) for a, b in zip(off[1:], on[1:], strict=True)]
    machine["load_average_at_end"] = load_average()
    payload = {
        "benchmark": "agent",
        "command": command_line(),
        "machine": machine,
        "settings": {
            "model_id": manifest.model_id,
            "stages": args.stages,
            "turns": args.turns,
            "conversations": len(seeds),
            "repeats": args.repeats,
            "history_tokens": args.history_tokens,
            "max_tokens": args.max_tokens,
            "prefix_cache_tokens": args.prefix_cache_tokens,
            "tools": not args.no_tools,
            "duration_s": round(time.time() - started, 1),
        },
        "summary": {"off": off, "on": on},
        "ttft_ratio_later_turns": later,
        "identical_turns": identical,
        "turns_compared": len(records["on"]),
        "records": records,
    }
    write_json(args.out, payload)
    emit(
        f"agent loop: {manifest.model_id}, {args.stages} stages, {len(seeds)} conversations x "
        f"{args.turns} turns x {args.repeats} repeats, {args.threads} torch thread(s) per stage"
    )
    emit(table(off, on))
    emit(
        f"\nTTFT without / with the prefix cache, turns 2-{args.turns}: "
        + ", ".join(fmt(r) for r in later)
        + f"; identical text in {identical} of {len(records['on'])} turns"
    )
    emit(f"\nJSON: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
