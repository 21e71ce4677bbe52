"""SmolLM2 on the int4 and bfloat16 packages (half-precision compute), split across
2 stage processes: greedy and seeded answers are the same with speculation on
(the n-gram default) and off, alone and with 4 or 8 concurrent streams
(row-invariant arithmetic, mesh/runtime/invariant.py: on by default for the int4
package, asked for with ``--row-invariant on`` for bfloat16)."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import pytest
from openai import OpenAI

from coordinator.localmesh import MeshProcesses

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
CODE = (
    "def mean(values):\n    total = 0\n    for value in values:\n        total += value\n"
    "    return total / len(values)\n"
)
# (prompt, seed): None answers greedily; a seed samples at temperature 0.8.
REQUESTS = [
    (f"Repeat this function exactly, then rename `total` to `acc`:\n\n{CODE}", None),
    (f"Add a docstring to this function and return the whole function:\n\n{CODE}", None),
    ("List four metals that conduct electricity well.", None),
    ("Write two sentences about a lighthouse keeper.", None),
    ("Explain what a hash table is in one short paragraph.", None),
    ("Give three tips for writing clear emails.", 11),
    ("Describe a sunrise over the sea.", 12),
    (f"Copy this code and add type hints:\n\n{CODE}", None),
]
MAX_TOKENS = 28


@pytest.fixture(scope="module", params=["int4", "bfloat16"])
def half_precision_package(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, Path]:
    from mesh.package.builder import build_package

    out = tmp_path_factory.mktemp(f"smollm2-{request.param}") / "pkg"
    if request.param == "int4":
        build_package("default", out, dtype="float32", model_id=MODEL, quant="int4")
    else:
        build_package("default", out, dtype="bfloat16", model_id=MODEL)
    return request.param, out


def answers(mesh: MeshProcesses, streams: int) -> list[str]:
    client = OpenAI(base_url=mesh.http_url + "/v1", api_key="unused", max_retries=0)

    def ask(request: tuple[str, int | None]) -> str:
        prompt, seed = request
        reply = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=MAX_TOKENS,
            temperature=0 if seed is None else 0.8,
            seed=seed,
        )
        return reply.choices[0].message.content or ""

    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        return list(pool.map(ask, REQUESTS))


def test_answers_do_not_change_with_speculation_or_load(
    tmp_path: Path, half_precision_package: tuple[str, Path]
) -> None:
    fmt, package = half_precision_package
    # The default (auto) covers the int4 package; a dense one asks for it.
    stage_args = ("--row-invariant", "on") if fmt == "bfloat16" else ()
    got: dict[str, list[str]] = {}
    for speculation, stage0_args, stream_counts in (
        ("off", ("--spec-type", "none"), (1, 8)),
        ("on", (), (1, 4, 8)),
    ):
        mesh = MeshProcesses(
            package,
            tmp_path / f"mesh-{speculation}",
            2,
            max_sessions=8,
            stage0_args=stage0_args,
            stage_args=stage_args,
        )
        try:
            mesh.start().wait_serving(deadline_s=300)
            for streams in stream_counts:
                got[f"speculation {speculation}, {streams} streams"] = answers(mesh, streams)
        finally:
            mesh.close()
    reference = got["speculation off, 1 streams"]
    assert all(reference), reference
    for label, texts in got.items():
        changed = [i for i, (a, b) in enumerate(zip(texts, reference, strict=True)) if a != b]
        assert not changed, f"{label}: requests {changed} differ from speculation off, alone"
