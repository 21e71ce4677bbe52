"""Single-stage engines for the engine and quantisation benchmarks: package builds
of the default model, prompt fitting, greedy decoding through one ``StageRuntime``
and a crash-proof probe of a package in a child process."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger("bench")

REPO_ROOT = Path(__file__).resolve().parent.parent
PROBE_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class PackageVariant:
    """One build of the default model's package: dense (``quant`` None) or quantised.
    ``dtype`` is the package dtype (for a quantised one: of the tensors left plain)."""

    dtype: str
    quant: str | None = None
    group_size: int | None = None
    head_quant: str | None = None  # None: the builder's default (int8)

    @property
    def name(self) -> str:
        """Directory name and label: ``dense-float32``, ``int8``, ``int4-g32``,
        ``int4-g32-int4head``."""
        if self.quant is None:
            return f"dense-{self.dtype}"
        name = f"{self.quant}-g{self.group_size}" if self.group_size else self.quant
        return f"{name}-{self.head_quant}head" if self.head_quant else name


def add_output_arguments(parser: Any, name: str) -> None:
    """``--workdir``, ``--workloads``, ``--out`` and ``--log-level`` of the
    single-stage benchmarks (``name``: the JSON file's stem)."""
    parser.add_argument(
        "--workdir", type=Path, default=None, help="build packages here (reused when present)"
    )
    parser.add_argument("--workloads", type=Path, default=None, help="workloads.jsonl")
    parser.add_argument("--out", type=Path, default=Path("bench-results") / f"{name}.json")
    parser.add_argument("--log-level", default="WARNING")


def ensure_package(workdir: Path, variant: PackageVariant) -> Path:
    """The package of ``variant`` under ``workdir``: reused when a manifest is already
    there, else built from the default GGUF."""
    from mesh.package.manifest import MANIFEST_NAME

    out = workdir / variant.name
    if (out / MANIFEST_NAME).is_file():
        logger.info("reusing the %s package at %s", variant.name, out)
        return out
    from mesh.package.builder import build_package

    options: dict[str, Any] = {}
    if variant.quant is not None:
        options = {
            "quant": variant.quant,
            "group_size": variant.group_size,
            "head_quant": variant.head_quant,
        }
    started = time.perf_counter()
    build_package("default", out, dtype=variant.dtype, **options)
    logger.info("built the %s package in %.1fs", variant.name, time.perf_counter() - started)
    return out


def chat_prompt_parts(
    tokenizer: Any, messages: Sequence[dict[str, str]]
) -> tuple[list[int], list[int]]:
    """Token ids of ``messages`` rendered with the chat template, split where the last
    message's content ends: ``head`` (up to there) and ``tail`` (the template's end of
    turn and assistant header), so a long prompt can be shortened without losing the
    part that asks the model to answer."""
    text = tokenizer.apply_chat_template(
        [dict(m) for m in messages], add_generation_prompt=True, tokenize=False
    )
    content = messages[-1]["content"]
    at = text.rfind(content)
    end = len(text) if at < 0 else at + len(content)
    head = tokenizer.encode(text[:end], add_special_tokens=False)
    tail = tokenizer.encode(text[end:], add_special_tokens=False) if end < len(text) else []
    return list(head), list(tail)


def fit_prompt(head: Sequence[int], tail: Sequence[int], limit: int | None) -> list[int]:
    """``head + tail``, with the end of ``head`` cut so the whole is at most ``limit``
    ids (None: no limit)."""
    if limit is None or len(head) + len(tail) <= limit:
        return [*head, *tail]
    keep = limit - len(tail)
    if keep < 1:
        raise ValueError(f"a limit of {limit} ids leaves no room beside {len(tail)} tail ids")
    return [*head[:keep], *tail]


def greedy_token(scores: Any, banned: Sequence[int] = ()) -> int:
    """Argmax of a 1-D torch score vector, never one of ``banned`` (the first of equal
    maxima wins, as in torch)."""
    import torch

    if banned:
        scores = scores.index_fill(0, torch.tensor(list(banned)), float("-inf"))
    return int(scores.argmax())


@dataclass(frozen=True)
class Generation:
    """Greedy tokens and when each was known (``time.perf_counter`` seconds);
    ``started`` is when the prompt was handed over."""

    tokens: list[int]
    started: float
    stamps: list[float]


def runtime_greedy(
    runtime: Any,
    prompt_ids: Sequence[int],
    tokens: int,
    *,
    banned: Sequence[int] = (),
    stop: Sequence[int] = (),
) -> Generation:
    """Greedy decoding through one stage runtime holding the whole model: one forward
    of the prompt at position 0, then one token per step; ``banned`` ids are never
    chosen, a ``stop`` id ends early."""
    import torch

    session = f"bench-{time.monotonic_ns()}"
    emitted: list[int] = []
    stamps: list[float] = []
    started = time.perf_counter()
    try:
        logits = runtime.forward(session, 0, torch.tensor(list(prompt_ids), dtype=torch.long))
        position = len(prompt_ids)
        while True:
            token = greedy_token(logits[-1], banned)
            stamps.append(time.perf_counter())
            emitted.append(token)
            if len(emitted) >= tokens or token in stop:
                break
            logits = runtime.forward(session, position, torch.tensor([token]))
            position += 1
    finally:
        runtime.drop_session(session)
    return Generation(emitted, started, stamps)


PROBE = """
import sys, torch
from mesh.runtime import load_config, load_stage_runtime
from mesh.types import LayerRange
torch.set_num_threads(1)
package, dtype = sys.argv[1], sys.argv[2]
layers = LayerRange(0, load_config(package).num_hidden_layers)
runtime = load_stage_runtime(package, layers, device="cpu", dtype=dtype)
runtime.forward("probe", 0, torch.arange(1, 65))
runtime.forward("probe", 64, torch.tensor([1]))
runtime.forward("probe", 65, torch.tensor([2]))
"""


def probe_failure(returncode: int, stderr: str) -> str | None:
    """What a probe child's exit says about the package: None when it ran."""
    if returncode == 0:
        return None
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"crashed ({name}) in a probe run"
    last = [line for line in stderr.strip().splitlines() if line.strip()]
    return f"probe run failed: {last[-1] if last else f'exit status {returncode}'}"


def probe_package(package: Path, dtype: str) -> str | None:
    """Prefill and one decode step of ``package`` in a child process: a native crash
    there is reported instead of ending this process."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", PROBE, str(package), dtype],
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
            cwd=REPO_ROOT,
        )
    except subprocess.TimeoutExpired:
        return f"probe run did not finish in {PROBE_TIMEOUT_S:.0f}s"
    return probe_failure(done.returncode, done.stderr)


def package_eos_ids(package: Path) -> list[int]:
    """End-of-sequence ids of a package (its generation_config.json), sorted."""
    path = package / "generation_config.json"
    if not path.is_file():
        return []
    value = json.loads(path.read_text()).get("eos_token_id")
    if value is None:
        return []
    return sorted({int(v) for v in (value if isinstance(value, list) else [value])})


# ---- machine, output -----------------------------------------------------------------
