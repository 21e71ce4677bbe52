"""The mesh as real processes: coordinator + stage processes on 127.0.0.1."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch
from conftest import reference_attention
from openai import OpenAI

from coordinator.localmesh import MeshProcesses, wait_for
from mesh.codec import (
    ClaimRequest,
    Frame,
    Segment,
    SegmentKind,
    WireDType,
    ack_from_proto,
    decode_tensor,
    encode_tensor,
    frame_to_proto,
)
from mesh.grpc_util import channel
from mesh.proto.v1 import data_pb2_grpc, stage_pb2_grpc
from mesh.runtime import load_stage_runtime
from mesh.types import LayerRange

PROMPT = [1, 517, 2049, 33, 1200, 77, 4051, 9, 300]
NEW_TOKENS = 12


def reference_tokens(package: Path, ranges: list[LayerRange], wire: WireDType) -> list[int]:
    """Greedy tokens of an in-process chain of runtimes whose boundaries apply the
    same wire encoding as the mesh."""
    chain = [load_stage_runtime(package, r) for r in ranges]
    tokens = list(PROMPT)
    pos = 0
    out: list[int] = []
    inputs = torch.tensor(tokens)
    for _ in range(NEW_TOKENS):
        value = inputs
        for index, runtime in enumerate(chain):
            value = runtime.forward("ref", pos, value)
            if index < len(chain) - 1:
                value = decode_tensor(encode_tensor(value, wire))
        token = int(torch.argmax(value[-1]))
        out.append(token)
        pos += len(inputs)
        inputs = torch.tensor([token])
    return out


def unsplit_tokens(model_dir: Path) -> list[int]:
    """HF ``generate``'s greedy tokens for the prompt, on the unsplit model (in its own
    architecture: a Phi-3 directory runs transformers' Phi-3)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, **reference_attention(model_dir)
    ).eval()
    generated = model.generate(
        torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=0
    )
    return generated[0, len(PROMPT) :].tolist()


def mesh_tokens(client: OpenAI, model: str) -> str:
    """Greedy completion text through the HTTP frontend for the token-id prompt."""
    reply = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0
    )
    return reply.choices[0].text


def stage_ranges(mesh: MeshProcesses) -> list[LayerRange]:
    stages = sorted((s for s in mesh.status().stages if s.assigned), key=lambda s: s.stage_index)
    return [s.layer_range for s in stages]


@pytest.mark.parametrize("wire", ["f32", "bf16"])
def test_three_stage_mesh_matches_unsplit_model(
    mesh_factory, tiny_package_factory, tiny_model_factory, wire
):
    from transformers import AutoTokenizer

    package = tiny_package_factory("llama", layers=6)
    mesh = mesh_factory(package, 3, wire_dtype=wire)
    mesh.wait_serving()
    ranges = stage_ranges(mesh)
    assert len(ranges) == 3 and ranges[0].start == 0 and ranges[-1].end == 6
    assert all(a.end == b.start for a, b in zip(ranges, ranges[1:], strict=False))
    client = OpenAI(base_url=mesh.http_url + "/v1", api_key="unused", max_retries=0)
    text = mesh_tokens(client, "tiny-llama")
    tokenizer = AutoTokenizer.from_pretrained(package)
    expected = reference_tokens(package, ranges, WireDType.parse(wire))
    assert text == tokenizer.decode(expected)
    if wire == "f32":
        # The f32 chain is the unsplit model: same greedy tokens as HF generate.
        assert expected == unsplit_tokens(tiny_model_factory("llama", layers=6))
    # Every session ends on every stage once its request is done.
    wait_for(
        lambda: all(s.active_sessions == 0 for s in mesh.status().stages),
        10,
        "sessions to be freed on every stage",
    )


@pytest.mark.parametrize("transport", ["tcp", "grpc"])
def test_frames_travel_over_the_transport_each_stage_offers(
    mesh_factory, tiny_package_factory, transport
):
    """Framed TCP (the default) and the gRPC streams carry the same frames: the same
    greedy text as the in-process chain, and each stage tells its senders which
    one it takes."""
    from transformers import AutoTokenizer

    from mesh.proto.v1 import data_pb2

    package = tiny_package_factory("llama", layers=6)
    mesh = mesh_factory(package, 3, stage_args=("--data-transport", transport))
    mesh.wait_serving()
    for stage in mesh.status().stages:
        with channel(stage.address) as ch:
            reply = data_pb2_grpc.StageDataStub(ch).Endpoint(data_pb2.EndpointRequest(), timeout=10)
        assert bool(reply.tcp) == (transport == "tcp") and not reply.tls
        if reply.tcp:
            assert reply.tcp.rsplit(":", 1)[0] == stage.address.rsplit(":", 1)[0]
    client = OpenAI(base_url=mesh.http_url + "/v1", api_key="unused", max_retries=0)
    tokenizer = AutoTokenizer.from_pretrained(package)
    expected = tokenizer.decode(reference_tokens(package, stage_ranges(mesh), WireDType.F32))
    for _ in range(3):
        assert mesh_tokens(client, "tiny-llama") == expected


@pytest.mark.parametrize("family", ["phi3", "qwen2_moe", "gemma2", "gemma3", "glm4", "glm4_moe"])
def test_a_newer_family_is_served_split_with_transformers_greedy_tokens(
    mesh_factory, tiny_package_factory, tiny_model_factory, family
):
    """Phi-3 (fused projections, packaged as Llama), Qwen2-MoE (a shared expert
    beside the routed ones), Gemma 2 (capped scores and logits), Gemma 3 (two
    rotary tables), GLM-4 (rotary on half of each head, pairs interleaved) and
    GLM-4.5 (grouped sigmoid routing, an ungated shared expert), split in two: the
    text is that of transformers' own model generating greedily, unsplit."""
    from transformers import AutoTokenizer

    package = tiny_package_factory(family, layers=4)
    mesh = mesh_factory(package, 2)
    mesh.wait_serving()
    assert len(stage_ranges(mesh)) == 2
    client = OpenAI(base_url=mesh.http_url + "/v1", api_key="unused", max_retries=0)
    expected = unsplit_tokens(tiny_model_factory(family, layers=4))
    text = mesh_tokens(client, f"tiny-{family}")
    assert text == AutoTokenizer.from_pretrained(package).decode(expected)


def test_an_answer_ends_at_any_end_token_the_generation_config_lists(
    mesh_factory, tiny_model_factory, tmp_path
):
    """A chat model's end-of-turn token that is not its tokenizer's EOS (Gemma's
    ``<end_of_turn>``, Phi-3's ``<|end|>``) is listed in ``generation_config.json``;
    the answer ends there, as ``generate`` ends, with finish_reason ``stop``."""
    import json

    from transformers import AutoTokenizer

    from mesh.package.builder import build_package

    source = tmp_path / "src"
    shutil.copytree(tiny_model_factory("qwen2", layers=4), source)
    expected = unsplit_tokens(source)
    # A greedy token from the fourth on, not seen before it, ends the answer now.
    at = next(i for i in range(3, NEW_TOKENS) if expected[i] not in expected[:i])
    config_path = source / "generation_config.json"
    config = json.loads(config_path.read_text())
    config["eos_token_id"] = [config["eos_token_id"], expected[at]]
    config_path.write_text(json.dumps(config))
    package = tmp_path / "pkg"
    build_package(str(source), package, model_id="tiny-ends")
    mesh = mesh_factory(package, 2)
    mesh.wait_serving()
    client = OpenAI(base_url=mesh.http_url + "/v1", api_key="unused", max_retries=0)
    reply = client.completions.create(
        model="tiny-ends", prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0
    )
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].text == AutoTokenizer.from_pretrained(package).decode(expected[:at])
    assert reply.usage.completion_tokens == at


def test_a_request_without_sampling_parameters_gets_the_models_recommended_ones(
    mesh_factory, tiny_model_factory, tmp_path
):
    """The model's generation_config.json recommends temperature 0 here: a request
    that sets none is greedy (at OpenAI's temperature 1 it would draw other tokens);
    /props says so."""
    import json

    import httpx
    from transformers import AutoTokenizer

    from mesh.package.builder import build_package

    source = tmp_path / "src"
    shutil.copytree(tiny_model_factory("qwen2", layers=4), source)
    expected = unsplit_tokens(source)
    config_path = source / "generation_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "temperature": 0.0}))
    package = tmp_path / "pkg"
    build_package(str(source), package, model_id="tiny-defaults")
    mesh = mesh_factory(package, 2)
    mesh.wait_serving()
    client = OpenAI(base_url=mesh.http_url + "/v1", api_key="unused", max_retries=0)
    text = AutoTokenizer.from_pretrained(package).decode(expected)
    for seed in (1, 2):
        reply = client.completions.create(
            model="tiny-defaults", prompt=PROMPT, max_tokens=NEW_TOKENS, seed=seed
        )
        assert reply.choices[0].text == text
    props = httpx.get(mesh.http_url + "/props", timeout=30).json()
    assert props["default_generation_settings"]["params"]["temperature"] == 0.0


def test_int4_mesh_serves_the_quantised_model_and_reports_its_memory(
    mesh_factory, tiny_package_factory
):
    from transformers import AutoTokenizer

    package = tiny_package_factory("qwen2", layers=4, quant="int4")
    mesh = mesh_factory(package, 2)
    mesh.wait_serving()
    ranges = stage_ranges(mesh)
    client = OpenAI(base_url=mesh.http_url + "/v1", api_key="unused", max_retries=0)
    text = mesh_tokens(client, "tiny-qwen2")
    expected = reference_tokens(package, ranges, WireDType.F32)
    assert text == AutoTokenizer.from_pretrained(package).decode(expected)
    # Each stage reports the parameter bytes it holds, in their quantised form.
    held = {s.layer_range: s.param_bytes for s in mesh.status().stages if s.assigned}
    for layer_range in ranges:
        assert held[layer_range] == load_stage_runtime(package, layer_range).param_bytes
    dense = load_stage_runtime(tiny_package_factory("qwen2", layers=4), LayerRange(0, 4))
    assert sum(held.values()) < 0.5 * dense.param_bytes


def test_corrupt_slice_rolls_back_the_whole_attempt(mesh_factory, tiny_package_factory, tmp_path):
    source = tiny_package_factory("llama", layers=6)
    package = tmp_path / "corrupt-pkg"
    shutil.copytree(source, package)
    victim = package / "layers" / "00005.safetensors"
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    mesh = mesh_factory(package, 3, coordinator_args=("--load-attempts", "2"))
    # The worker whose slice fails is quarantined and the next attempt comes at once
    # without it; it fails too (every copy of the package is corrupt), and after the
    # second failure `up` gives up and exits non-zero, saying why (scripts see the
    # exit code).
    assert mesh.coordinator.wait(180) == 1
    log = mesh.coordinator_log()
    first = next(line for line in log.splitlines() if "load of term 1 failed" in line)
    assert "stage 2" in first and "Prepare" in first and "127.0.0.1:" in first
    assert "00005.safetensors" in first and "sha256" in first
    # Every stage of each attempt was released (a release that fails is logged).
    assert "release of stage" not in log
    assert "could not be loaded after 2 attempts" in log and "00005.safetensors" in log
    assert not any("loaded layers" in mesh.stage_log(f"stage-{i}") for i in range(3))


def test_stale_term_bad_frame_and_dead_stage(mesh_factory, tiny_package_factory):
    package = tiny_package_factory("llama", layers=6)
    mesh = mesh_factory(package, 3)
    mesh.wait_serving()
    status = mesh.status()
    middle = next(s for s in status.stages if s.assigned and s.stage_index == 1)

    # A stale term is refused with FAILED_PRECONDITION and changes nothing.
    ch = channel(middle.address)
    stub = stage_pb2_grpc.StageControlStub(ch)
    with pytest.raises(grpc.RpcError) as refused:
        stub.Claim(ClaimRequest(0, "intruder", "tiny-llama").to_proto(), timeout=5)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "term" in refused.value.details()

    # Bytes that are not the method's message: INVALID_ARGUMENT naming it, on a
    # stage and on the coordinator.
    garbage = b"\xff\xff\xff\xff\x0f"
    coordinator = channel(mesh.coordinator_address)
    for conn, method, message in (
        (ch, "/mesh.v1.StageControl/Claim", "mesh.v1.ClaimRequest"),
        (coordinator, "/mesh.v1.Coordinator/Join", "mesh.v1.JoinRequest"),
    ):
        with pytest.raises(grpc.RpcError) as garbled:
            conn.unary_unary(method)(garbage, timeout=5)
        assert garbled.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in garbled.value.details()
    coordinator.close()

    # A bad frame (wrong hidden size) fails only its own request, while a real
    # request through the same stage completes with the right tokens.
    client = OpenAI(base_url=mesh.http_url + "/v1", api_key="unused", max_retries=0)
    answers: list[str] = []
    worker = threading.Thread(target=lambda: answers.append(mesh_tokens(client, "tiny-llama")))
    worker.start()
    segment = Segment("bad-request", "bad-session", SegmentKind.PREFILL, 0, (1, 2, 3))
    bad = Frame(status.term, 77, (segment,), hidden=torch.zeros(3, 17))
    data = data_pb2_grpc.StageDataStub(ch)
    acks = data.Forward(iter([frame_to_proto(bad)]), timeout=10)
    ack = ack_from_proto(next(acks))
    assert ack.frame_id == 77
    assert ack.error is not None and ack.error.code == "INVALID_ARGUMENT"
    assert "hidden" in ack.error.message
    worker.join(60)
    ranges = stage_ranges(mesh)
    from transformers import AutoTokenizer

    expected = AutoTokenizer.from_pretrained(package).decode(
        reference_tokens(package, ranges, WireDType.F32)
    )
    assert answers == [expected]
    ch.close()

    # Killing the last stage is noticed within seconds and shown in status.
    last = next(s for s in status.stages if s.assigned and s.stage_index == 2)
    killed_at = time.monotonic()
    mesh.kill_stage(last.node_id)

    def dead():
        for stage in mesh.status().stages:
            if stage.node_id == last.node_id and stage.health == "dead":
                return True
        return False

    wait_for(dead, 10, "the coordinator to mark the killed stage dead")
    assert time.monotonic() - killed_at < 10
    # The coordinator plans again with the two stages left and serves.
    mesh.wait_serving(term=status.term + 1, deadline_s=120)
    assert len(stage_ranges(mesh)) == 2
    again = mesh_tokens(client, "tiny-llama")
    assert again == expected


def test_a_reused_workdir_finds_the_coordinator_it_started(tiny_package_factory, tmp_path):
    """The harness appends to its logs: an earlier run's address in a reused
    workdir's coordinator log is not taken for the new coordinator's."""
    workdir = tmp_path / "reused"
    (workdir / "logs").mkdir(parents=True)
    (workdir / "logs" / "coordinator.log").write_text(
        "12:00:00 INFO coordinator listening on 127.0.0.1:9\n"
    )
    mesh = MeshProcesses(tiny_package_factory("llama", layers=2), workdir, 1)
    try:
        address = mesh.wait_address()
        assert address != "127.0.0.1:9" and address.startswith("127.0.0.1:")
        assert mesh.status().term >= 0  # the address answers: it is this coordinator's
    finally:
        mesh.close()
