"""How long decoding streams pause while a long prompt is read, with stage 0's
``--decode-stall-ms`` (prompt rows of a frame cut to about that cost while requests
decode) against ``--decode-stall-ms 0`` (the step token budget alone), same run.

Each repeat starts one local mesh per setting, in turn (never two at once: they
would share the cores), sends the long prompt alone (its time to first token, and
the prompt frames the cut is fitted on), then ``--streams`` greedy streams of
``--stream-tokens`` tokens and, ``--long-after`` seconds later, the long prompt
again (another cache salt: no prefix is reused). Reported per setting, medians of
the repeats: the streams' longest and 99th-percentile pause between tokens, their
median pause, the long prompt's time to first token among them and alone, and
when the last stream ended.

    .venv/bin/python benchmarks/stall_bench.py --package <int4 package> --stages 2
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

TOPICS = ("cats", "rain", "ships", "bread", "stars", "rivers", "clocks", "maps")


def long_prompt(words: int, salt: int) -> str:
    """A prompt of about ``words`` words no other request shares."""
    items = (
        f"item{(i * 7919 + salt) % 10007} is {TOPICS[i % len(TOPICS)]}" for i in range(words // 3)
    )
    text = " ".join(items)
    return f"Summarise this list: {text}"


async def stream(client: Any, model: str, content: str, tokens: int, salt: str) -> list[float]:
    """Send one greedy chat stream; the times its content chunks arrived."""
    times: list[float] = []
    reply = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": content}],
        max_tokens=tokens,
        temperature=0,
        stream=True,
        extra_body={"cache_salt": salt, "ignore_eos": True},
    )
    ended = 0.0
    async for chunk in reply:
        if chunk.choices and chunk.choices[0].delta.content:
            times.append(time.perf_counter())
        elif chunk.choices and chunk.choices[0].finish_reason:
            ended = time.perf_counter()
    # Tokens that decode to no text yet (held back): the answer's end stands for them.
    return times or [ended]


async def one_pass(url: str, model: str, args: argparse.Namespace, salt: int) -> dict[str, float]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    prompt = long_prompt(args.long_words, salt)
    started = time.perf_counter()
    alone = await stream(client, model, prompt, 2, f"alone-{salt}")
    alone_ttft = alone[0] - started

    async def late() -> tuple[float, list[float]]:
        await asyncio.sleep(args.long_after)
        sent = time.perf_counter()
        return sent, await stream(client, model, prompt, 2, f"late-{salt}")

    began = time.perf_counter()
    streams = [
        stream(client, model, f"Write a poem about {t}.", args.stream_tokens, f"s{i}-{salt}")
        for i, t in enumerate(TOPICS[: args.streams])
    ]
    *timed, (sent, long_times) = await asyncio.gather(*streams, late())
    gaps = [b - a for times in timed for a, b in zip(times, times[1:], strict=False)]
    gaps.sort()
    await client.close()
    return {
        "max_pause_s": gaps[-1],
        "p99_pause_s": gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))],
        "median_pause_s": statistics.median(gaps),
        "long_ttft_s": long_times[0] - sent,
        "long_alone_ttft_s": alone_ttft,
        "streams_done_s": max(times[-1] for times in timed) - began,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_arguments(parser, "stall_bench")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--stall-ms", type=float, nargs="+", default=[250.0, 0.0])
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--stream-tokens", type=int, default=200)
    parser.add_argument("--long-words", type=int, default=1000)
    parser.add_argument("--long-after", type=float, default=2.0)
    args = parser.parse_args()
    common.configure(args)
    if not 1 <= args.streams <= len(TOPICS):
        parser.error(f"--streams takes 1 to {len(TOPICS)}")
    package = common.resolve_package(args.package)
    runs: dict[float, list[dict[str, float]]] = {ms: [] for ms in args.stall_ms}
    for repeat in range(args.repeats):
        for ms in common.rotated(args.stall_ms, repeat):
            config = common.MeshConfig(stages=args.stages, decode_stall_ms=ms)
            with common.running_meshes(
                package,
                [config],
                threads=args.threads,
                workdir=args.workdir,
                heartbeat_timeout_s=args.heartbeat_timeout,
            ) as (mesh,):
                salt = repeat * 1000 + int(ms)
                runs[ms].append(asyncio.run(one_pass(mesh.http_url, mesh.model_id, args, salt)))
    keys = ("max_pause_s", "p99_pause_s", "median_pause_s", "long_ttft_s", "long_alone_ttft_s",
            "streams_done_s")  # fmt: skip
    medians = {ms: {k: common.median([r[k] for r in runs[ms]]) for k in keys} for ms in runs}
    base = medians[args.stall_ms[-1]]
    rows = [
        [f"{ms:g}", *(common.fmt(medians[ms][k]) for k in keys),
         common.fmt(common.ratio(medians[ms]["max_pause_s"], base["max_pause_s"]))]
        for ms in args.stall_ms
    ]  # fmt: skip
    headers = ["decode-stall-ms", "max pause s", "p99 pause s", "median pause s",
               "long TTFT s", "long alone TTFT s", "streams done s",
               f"max pause vs {args.stall_ms[-1]:g}"]  # fmt: skip
    common.emit(common.render_table(headers, rows))
    common.write_json(
        args.out,
        {
            "benchmark": "stall_bench",
            "command": common.command_line(),
            "machine": common.machine_info(args.threads),
            "package": str(package),
            "stages": args.stages,
            "streams": args.streams,
            "stream_tokens": args.stream_tokens,
            "long_words": args.long_words,
            "runs": {f"{ms:g}": runs[ms] for ms in runs},
            "medians": {f"{ms:g}": medians[ms] for ms in medians},
        },
    )


if __name__ == "__main__":
    main()
