"""Faults through real processes (in this order, on one 3-stage mesh): random frames
thrown at a stage's data service, a stage killed mid-request, a replacement stage."""

from __future__ import annotations

import concurrent.futures
import random
import threading

import grpc
import httpx
import pytest
from openai import OpenAI

from coordinator.localmesh import MeshProcesses, wait_for
from mesh.proto.v1 import common_pb2, data_pb2, data_pb2_grpc

MODEL = "tiny-llama"
PROMPTS = [f"Request {i}: tell me about the number {i}" for i in range(4)]
TOKENS = 48


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory, tiny_package_factory):
    package = tiny_package_factory("llama", layers=6)
    processes = MeshProcesses(package, tmp_path_factory.mktemp("failover"), 3)
    try:
        processes.start().wait_serving()
        yield processes
    finally:
        processes.close()


# Half the streams ask for JSON: after a failover the last stage rebuilds each
# session's grammar state from the tokens read again.
FORMATS = [None, {"type": "json_object"}, None, {"type": "json_object"}]


def stream_text(
    client: OpenAI,
    prompt: str,
    first_chunk: threading.Event | None = None,
    response_format: dict | None = None,
) -> str:
    pieces = []
    extra = {"response_format": response_format} if response_format else {}
    stream = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=TOKENS,
        temperature=0,
        stream=True,
        extra_body=extra,
    )
    for chunk in stream:
        for choice in chunk.choices:
            pieces.append(choice.text or "")
        if first_chunk is not None and len(pieces) >= 3:
            first_chunk.set()
    return "".join(pieces)


def random_frame(rng: random.Random, index: int) -> data_pb2.Frame:
    frame = data_pb2.Frame(
        term=rng.choice([0, 1, 2, 2**63]), frame_id=rng.choice([0, index, 2**64 - 1])
    )
    for part in range(rng.randint(0, 3)):
        tokens = [rng.randint(0, 2**32 - 1) for _ in range(rng.randint(0, 6))]
        segment = frame.segments.add(
            request_id=f"fuzz-{index}-{part}",
            session_id=rng.choice(["", f"fuzz-{index}", "s" * rng.randint(1, 300)]),
            kind=rng.randint(0, 6),
            pos_start=rng.choice([0, 1, rng.randint(0, 2**40)]),
            token_count=rng.choice([len(tokens), rng.randint(0, 8)]),
            token_ids=tokens,
            sample=rng.random() < 0.5,
            epoch=rng.randint(0, 3),
        )
        if rng.random() < 0.3:
            segment.sampling.CopyFrom(
                common_pb2.SamplingParams(
                    temperature=rng.choice([0.0, 0.7, -1.0, float("nan"), 1e30]),
                    top_p=rng.choice([0.0, 0.5, 1.0, 2.0]),
                    top_k=rng.randint(0, 100),
                    seed=rng.getrandbits(64),
                )
            )
    if rng.random() < 0.7:
        rows = rng.randint(0, 6)
        cols = rng.choice([64, 63, 0, 128])
        dtype = rng.randint(0, 6)
        size = rows * cols * rng.choice([1, 2, 4])
        frame.hidden.CopyFrom(
            common_pb2.Tensor(
                dtype=dtype,
                shape=[rows, cols][: rng.randint(0, 2)] or [rows, cols],
                data=bytes(rng.getrandbits(8) for _ in range(min(size, 4096))),
                scales=bytes(rng.getrandbits(8) for _ in range(rng.choice([0, 4 * rows]))),
            )
        )
    return frame


def test_random_frames_crash_nothing_and_change_no_output(mesh: MeshProcesses):
    client = OpenAI(base_url=mesh.http_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    expected = stream_text(client, PROMPTS[1])
    target = next(s for s in mesh.status().stages if s.assigned and s.stage_index == 1)
    rng = random.Random(20261122)
    frames = [random_frame(rng, i) for i in range(300)]
    answers: list[str] = []
    worker = threading.Thread(target=lambda: answers.append(stream_text(client, PROMPTS[1])))
    worker.start()
    channel = grpc.insecure_channel(target.address)
    acks = list(data_pb2_grpc.StageDataStub(channel).Forward(iter(frames), timeout=60))
    channel.close()
    worker.join(120)
    assert answers == [expected]
    # Every frame refused whole was answered with a typed error.
    assert acks and all(ack.error.code for ack in acks)
    assert {ack.error.code for ack in acks} <= {
        "INVALID_ARGUMENT",
        "NOT_FOUND",
        "FAILED_PRECONDITION",
        "RESOURCE_EXHAUSTED",
    }
    # The stage is alive, and the mesh still serves the same output.
    status = mesh.status()
    assert all(s.health == "alive" for s in status.stages if s.assigned)
    assert stream_text(client, PROMPTS[1]) == expected


def test_killing_a_middle_stage_during_four_streams_loses_nothing(mesh: MeshProcesses):
    client = OpenAI(base_url=mesh.http_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    baseline = [stream_text(client, p, None, f) for p, f in zip(PROMPTS, FORMATS, strict=True)]
    assert baseline[1].startswith("{") and baseline[3].startswith("{")
    started = [threading.Event() for _ in PROMPTS]
    middle = next(s for s in mesh.status().stages if s.assigned and s.stage_index == 1)
    term = mesh.status().term
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [
            pool.submit(stream_text, client, p, started[i], FORMATS[i])
            for i, p in enumerate(PROMPTS)
        ]
        for event in started:
            assert event.wait(60), "every stream should be producing tokens before the kill"
        mesh.kill_stage(middle.node_id)
        results = [f.result(timeout=180) for f in futures]
    assert results == baseline
    # The coordinator learns of the death from missed heartbeats: streams that left
    # the dead stage's hands early may end before it loads the next term.
    status = wait_for(
        lambda: (s := mesh.status()).term > term and s.state == "serving" and s,
        60,
        "the mesh to serve a new term without the killed stage",
    )
    assert any(s.node_id == middle.node_id and s.health == "dead" for s in status.stages)
    metrics = httpx.get(mesh.http_url + "/metrics").text
    recoveries = [
        line for line in metrics.splitlines() if line.startswith("mesh_request_recoveries_total")
    ]
    assert recoveries and float(recoveries[0].split()[-1]) >= 1


def ask_while_reloading(client: OpenAI, stop: threading.Event, answers: list, errors: list):
    """Until ``stop``: whenever ``/health`` says the pipeline is not loaded (a reload
    in progress), send a short request; each answer or error kept."""
    health = str(client.base_url).removesuffix("/").removesuffix("/v1") + "/health"
    while not stop.is_set():
        if httpx.get(health).status_code != 503:
            stop.wait(0.005)
            continue
        try:
            answer = client.completions.create(
                model=MODEL, prompt=PROMPTS[1], max_tokens=4, temperature=0
            )
            answers.append(answer.choices[0].text)
        except Exception as error:  # noqa: BLE001 - the test reports every failure
            errors.append(error)


def test_a_replacement_stage_joins_and_the_mesh_serves(mesh: MeshProcesses):
    client = OpenAI(base_url=mesh.http_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    expected = stream_text(client, PROMPTS[0])
    short = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=4, temperature=0)
    last = max((s for s in mesh.status().stages if s.assigned), key=lambda s: s.stage_index)
    term = mesh.status().term
    # Requests that arrive while the pipeline reloads (twice below) are served once
    # the new pipeline is up, not refused.
    stop, answers, errors = threading.Event(), [], []
    asker = threading.Thread(target=ask_while_reloading, args=(client, stop, answers, errors))
    asker.start()
    try:
        mesh.kill_stage(last.node_id)
        mesh.wait_serving(term=term + 1)
        shrunk = sum(s.assigned for s in mesh.status().stages)
        mesh.start_stage("replacement")
        # The mesh serves on fewer stages than --min-stages 3, and a spare joined: the
        # coordinator plans again (stage 0 is idle) and the replacement takes a stage.
        mesh.wait_serving(term=term + 2)
    finally:
        stop.set()
        asker.join(timeout=180)
    assert not errors, errors
    assert answers and set(answers) == {short.choices[0].text}
    status = mesh.status()
    assert status.state == "serving"
    assert any(s.node_id == "replacement" and s.assigned for s in status.stages)
    assert sum(s.assigned for s in status.stages) == shrunk + 1
    assert stream_text(client, PROMPTS[0]) == expected
