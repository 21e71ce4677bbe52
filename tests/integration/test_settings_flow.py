"""Stage 0's settings reach it as data with the Load: a stage 0 started on its own
(`mesh-stage join --frontend`, no serving flags) serves with the limits and the
speculation given to `mesh-coordinator up`, and its own flags win over them."""

from __future__ import annotations

import httpx
import pytest
from openai import OpenAI, RateLimitError

from coordinator.localmesh import MeshProcesses

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"


def _speculation(mesh: MeshProcesses) -> dict:
    models = httpx.get(mesh.http_url + "/v1/models", timeout=30).json()
    return models["data"][0]["speculation"]


def test_a_separate_stage_0_serves_with_the_coordinators_settings(
    tmp_path, tiny_package_factory
) -> None:
    package = tiny_package_factory("llama", layers=4)
    mesh = MeshProcesses(
        package,
        tmp_path / "mesh",
        2,
        max_sessions=1,
        max_queued=0,
        coordinator_args=("--spec-type", "none"),
    )
    try:
        mesh.start().wait_serving()
        assert _speculation(mesh) == {"strategy": "none", "notes": []}
        client = OpenAI(base_url=mesh.http_url + "/v1", api_key="unused", max_retries=0)
        stream = client.completions.create(
            model=MODEL, prompt="one two three", max_tokens=200, stream=True, temperature=0
        )
        next(iter(stream))  # the first request holds the only slot
        with pytest.raises(RateLimitError):
            client.completions.create(model=MODEL, prompt="four", max_tokens=2)
        stream.close()
    finally:
        mesh.close()


def test_stage_0s_own_speculation_flags_win(tmp_path, tiny_package_factory) -> None:
    package = tiny_package_factory("llama", layers=4)
    mesh = MeshProcesses(
        package,
        tmp_path / "mesh",
        2,
        coordinator_args=("--spec-type", "none"),
        stage0_args=("--spec-type", "ngram"),
    )
    try:
        mesh.start().wait_serving()
        assert _speculation(mesh)["strategy"] == "ngram"
    finally:
        mesh.close()
