"""Structured output end to end: what ``response_format`` costs a request on a local
mesh, against the same requests as plain text, in the same run.

Every chat request of the workload file (and a few prompts of its own, which ask
for data) is sent as plain text, with ``{"type": "json_object"}`` and with a
``json_schema`` (a small record: a summary string, a list of up to 5 short items, a
confidence between 0 and 1, a category out of an enum), greedy, in an order that
rotates with the repeat so that load from elsewhere falls on all modes alike. Per
mode it reports the medians over requests and repeats of the decode rate (the
server's ``predicted_per_second``: tokens after the first over their time), the
prompt time, completion tokens, how many answers stopped on their own, and how many
answers parse as JSON (and follow the schema's keys, for ``json_schema``); and the
ratio of each mode's decode rate to plain text's. The grammar's own per-token cost
is in ``grammar_bench.py``.

    .venv/bin/python benchmarks/structured_bench.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from typing import Any

from common import (
    MeshConfig,
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
    rotated,
    running_meshes,
    write_json,
)

logger = logging.getLogger("structured_bench")

RECORD_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "summary": {"type": "string", "maxLength": 300},
        "items": {
            "type": "array",
            "items": {"type": "string", "maxLength": 80},
            "maxItems": 5,
        },
        "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        "category": {"enum": ["code", "chat", "fact", "other"]},
    },
    "required": ["summary", "items", "confidence", "category"],
    "additionalProperties": False,
}
MODES: dict[str, dict[str, Any] | None] = {
    "text": None,
    "json_object": {"type": "json_object"},
    "json_schema": {
        "type": "json_schema",
        "json_schema": {"name": "record", "schema": RECORD_SCHEMA, "strict": True},
    },
}
OWN_PROMPTS = (
    "List three planets of the solar system and one fact about each, as JSON.",
    "Describe a cat as JSON: name, age, color and favourite food.",
    "Give me a short shopping list for a pancake breakfast in JSON.",
)


def prompts_of(args: argparse.Namespace) -> list[tuple[str, list[dict[str, str]]]]:
    """(name, messages) of every request: the workload file's and the script's own."""
    out: list[tuple[str, list[dict[str, str]]]] = []
    path = args.workloads or default_workloads_path()
    if path.is_file():
        for requests in load_workloads(path).values():
            out += [(r.request_id, list(r.messages)) for r in requests[: args.per_workload]]
    else:
        logger.warning("no workload file at %s: the script's own prompts only", path)
    out += [(f"own-{i}", [{"role": "user", "content": p}]) for i, p in enumerate(OWN_PROMPTS)]
    return out


def follows(mode: str, text: str) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    if mode == "json_schema":
        return isinstance(value, dict) and list(value) == list(RECORD_SCHEMA["properties"])
    return isinstance(value, dict)


def measure(client: Any, model: str, messages: list, mode: str, max_tokens: int) -> dict:
    extra = {} if MODES[mode] is None else {"response_format": MODES[mode]}
    started = time.perf_counter()
    reply = client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, **extra
    )
    wall = time.perf_counter() - started
    choice = reply.choices[0]
    timings = reply.model_extra.get("timings") or {}
    text = choice.message.content or ""
    return {
        "wall_s": wall,
        "decode_tok_s": float(timings.get("predicted_per_second") or 0.0),
        "prompt_ms": float(timings.get("prompt_ms") or 0.0),
        "completion_tokens": reply.usage.completion_tokens,
        "stopped": choice.finish_reason == "stop",
        "json_ok": mode != "text" and follows(mode, text),
        "text": text,
    }


def summarize(records: list[dict], baseline: float) -> dict[str, Any]:
    rate = median([r["decode_tok_s"] for r in records])
    return {
        "requests": len(records),
        "decode_tok_s": rate,
        "ratio_to_text": ratio(rate, baseline),
        "prompt_ms": median([r["prompt_ms"] for r in records]),
        "completion_tokens": median([float(r["completion_tokens"]) for r in records]),
        "stopped": sum(r["stopped"] for r in records),
        "json_ok": sum(r["json_ok"] for r in records),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser, "structured_bench")
    parser.add_argument("--stages", type=int, default=2, help="stage processes of the mesh")
    parser.add_argument("--max-tokens", type=int, default=160, help="tokens per answer")
    parser.add_argument("--per-workload", type=int, default=3, help="requests per workload")
    parser.add_argument(
        "--speculation", default="package", help="--spec-type of stage 0 (package: default)"
    )
    args = parser.parse_args(argv)
    configure(args)
    package = resolve_package(args.package)
    requests = prompts_of(args)
    machine = machine_info(args.threads)
    records: dict[str, list[dict]] = {mode: [] for mode in MODES}
    started = time.time()
    config = MeshConfig(args.stages, speculation=args.speculation)
    with running_meshes(
        package,
        [config],
        threads=args.threads,
        workdir=args.workdir,
        heartbeat_timeout_s=args.heartbeat_timeout,
    ) as (mesh,):
        client = openai_client(mesh.http_url)
        measure(client, mesh.model_id, requests[0][1], "json_schema", 8)  # compile, warm
        for repeat in range(args.repeats):
            for number, (name, messages) in enumerate(requests):
                for mode in rotated(list(MODES), repeat + number):
                    got = measure(client, mesh.model_id, messages, mode, args.max_tokens)
                    got.update(request=name, repeat=repeat)
                    records[mode].append(got)
                    logger.info("%s %s %s: %.1f tok/s", repeat, name, mode, got["decode_tok_s"])
    baseline = median([r["decode_tok_s"] for r in records["text"]])
    summary = {mode: summarize(got, baseline) for mode, got in records.items()}
    machine["load_average_at_end"] = load_average()
    payload = {
        "benchmark": "structured",
        "command": command_line(),
        "machine": machine,
        "settings": {
            "stages": args.stages,
            "max_tokens": args.max_tokens,
            "speculation": args.speculation,
            "requests": len(requests),
            "repeats": args.repeats,
            "duration_s": round(time.time() - started, 1),
        },
        "summary": summary,
        "records": records,
    }
    write_json(args.out, payload)
    headers = ["mode", "requests", "decode tok/s", "vs text", "prompt ms", "tokens", "stopped"]
    headers.append("JSON ok")
    rows = [
        [
            mode,
            str(s["requests"]),
            fmt(s["decode_tok_s"]),
            fmt(s["ratio_to_text"]),
            fmt(s["prompt_ms"], 1),
            fmt(s["completion_tokens"], 0),
            str(s["stopped"]),
            "-" if mode == "text" else str(s["json_ok"]),
        ]
        for mode, s in summary.items()
    ]
    emit(
        f"structured output: {args.stages} stages, {len(requests)} requests x "
        f"{args.repeats} repeats, greedy, max_tokens {args.max_tokens}, "
        f"{args.threads} torch thread(s) per stage (medians)"
    )
    emit(render_table(headers, rows))
    emit(f"\nJSON: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
