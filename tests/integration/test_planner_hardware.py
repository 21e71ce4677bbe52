"""Real stage processes tell the coordinator what their hardware offers: memory
(stated or measured) and the measured cost of a layer and of the LM head."""

from __future__ import annotations

import subprocess
import sys

from openai import OpenAI

from coordinator.localmesh import wait_for


def test_stages_report_measured_memory_and_step_times(mesh_factory, tiny_package_factory):
    package = tiny_package_factory("llama", layers=4)
    mesh = mesh_factory(package, 2, stage0_args=("--memory", "3GiB"))
    mesh.wait_serving()
    stages = {s.node_id: s for s in mesh.status().stages}
    head, tail = stages["stage-0"], stages["stage-1"]
    assert (head.memory_bytes, head.memory_source) == (3 << 30, "stated")
    assert tail.memory_source == "measured" and tail.memory_bytes > 0
    assert head.layer_ms > 0 and head.head_ms == 0
    assert tail.layer_ms > 0 and tail.head_ms > 0
    assert head.planned_step_ms > 0 and tail.planned_step_ms > 0
    client = OpenAI(base_url=mesh.http_url + "/v1", api_key="unused", max_retries=0)
    client.completions.create(model="tiny-llama", prompt="hello", max_tokens=8, temperature=0)
    measured = wait_for(
        lambda: all(s.measured_step_ms > 0 for s in mesh.status().stages),
        15,
        "every stage to report its step time",
    )
    assert measured
    shown = subprocess.run(
        [sys.executable, "-m", "coordinator.cli", "status", "--coordinator", mesh.wait_address()],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert "3.0 GiB stated" in shown and "GiB measured" in shown
    assert "ms" in shown.split("step", 1)[1]


def test_memory_below_one_stage_is_a_clear_error(mesh_factory, tiny_package_factory, tmp_path):
    package = tiny_package_factory("llama", layers=4)
    mesh = mesh_factory(package, 1, stage0_args=("--memory", "1MiB"))
    error = wait_for(lambda: mesh.status().error, 60, "the coordinator to refuse the plan")
    assert "stage 0 (stage-0) alone needs" in error
    assert "the 1 stage(s) offer 0.00 GiB (stage-0 0.00 GiB)" in error
    # A margin larger than the host's RAM: the stage refuses to start, and says why.
    refused = subprocess.run(
        [
            sys.executable,
            "-m",
            "stage.cli",
            "join",
            "--memory-margin",
            "100000GiB",
            "--listen",
            "127.0.0.1:0",
            "--cache-dir",
            str(tmp_path / "cache"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2
    assert "lower --memory-margin or state the memory with --memory" in refused.stderr
