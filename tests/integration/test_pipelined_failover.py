"""A stage killed while a request has verify windows drafted ahead in the pipe: the
request resumes on the new pipeline and its text is the text it gets without the
fault (a 3-stage mesh, 15 ms on every hop, the target as its own draft model so
windows are sure and the depth rule goes deep)."""

from __future__ import annotations

import threading

import httpx
import pytest
from openai import OpenAI

from coordinator.localmesh import MeshProcesses

MODEL = "tiny-llama"
PROMPT = "Count with me: one two three four five six seven eight nine ten"
TOKENS = 300


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory, tiny_package_factory, tiny_model_factory):
    package = tiny_package_factory("llama", layers=6)
    draft = tiny_model_factory("llama", layers=6)
    spec = ("--spec-type", "draft-model", "--draft-model", str(draft), "--window-policy")
    processes = MeshProcesses(
        package,
        tmp_path_factory.mktemp("pipelined-failover"),
        3,
        max_sessions=4,
        stage0_args=(*spec, "fixed", "--initial-window", "3", "--max-window", "3"),
        stage_args=("--inject-delay-ms", "15"),
    )
    try:
        processes.start().wait_serving()
        yield processes
    finally:
        processes.close()


def stream_text(client: OpenAI, started: threading.Event | None = None) -> str:
    pieces = []
    stream = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=TOKENS, temperature=0, stream=True
    )
    for chunk in stream:
        for choice in chunk.choices:
            pieces.append(choice.text or "")
        if started is not None and len(pieces) >= 8:
            started.set()
    return "".join(pieces)


def test_a_kill_with_windows_in_flight_changes_nothing(mesh: MeshProcesses):
    reply = httpx.post(
        mesh.http_url + "/v1/completions",
        json={"model": MODEL, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0},
        timeout=120,
    ).json()
    timings = reply["timings"]
    assert timings.get("windows_ahead", 0) > 0 and timings.get("depth", 1) > 1
    client = OpenAI(base_url=mesh.http_url + "/v1", api_key="unused", max_retries=0, timeout=180)
    baseline = stream_text(client)
    assert baseline == reply["choices"][0]["text"]
    middle = next(s for s in mesh.status().stages if s.assigned and s.stage_index == 1)
    started = threading.Event()
    result: list[str] = []
    worker = threading.Thread(target=lambda: result.append(stream_text(client, started)))
    worker.start()
    assert started.wait(60), "the stream should be producing tokens before the kill"
    mesh.kill_stage(middle.node_id)
    worker.join(240)
    assert result == [baseline]
    metrics = httpx.get(mesh.http_url + "/metrics").text
    recoveries = [
        line for line in metrics.splitlines() if line.startswith("mesh_request_recoveries_total")
    ]
    assert recoveries and float(recoveries[0].split()[-1]) >= 1
