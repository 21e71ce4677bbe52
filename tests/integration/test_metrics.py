"""Metrics on every process of a real 2-stage mesh: stage 0's /metrics, each stage's
--metrics-port and the coordinator's, after requests made with the openai client
(one ended by a stop string, one stream the client abandons)."""

from __future__ import annotations

import re
from collections.abc import Callable

import httpx
import pytest
from metrics_support import naming_problems, value
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from coordinator.localmesh import MeshProcesses, wait_for

MODEL = "tiny-llama"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
DEADLINE_S = 30.0


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory, tiny_package_factory):
    package = tiny_package_factory("llama", layers=6)
    processes = MeshProcesses(
        package,
        tmp_path_factory.mktemp("metrics"),
        2,
        coordinator_args=("--metrics-port", "0"),
        stage_args=("--metrics-port", "0"),
    )
    try:
        processes.start().wait_serving()
        yield processes
    finally:
        processes.close()


def metrics_url(log: Callable[[], str]) -> str:
    """The URL a process logged for its metrics port."""

    def logged() -> str | None:
        found = re.search(r"serves metrics on (http://\S+/metrics)", log())
        return found.group(1) if found else None

    return wait_for(logged, DEADLINE_S, "a metrics URL in the log")


def scrape(url: str) -> str:
    reply = httpx.get(url, timeout=10)
    assert reply.status_code == 200
    assert reply.headers["content-type"].startswith("text/plain")
    return reply.text


def families(text: str) -> set[str]:
    return {family.name for family in text_string_to_metric_families(text)}


def test_every_process_counts_what_the_requests_did(mesh: MeshProcesses) -> None:
    stage0 = mesh.http_url + "/metrics"
    stage0_port = metrics_url(lambda: mesh.stage_log("stage-0"))
    stage1 = metrics_url(lambda: mesh.stage_log("stage-1"))
    coordinator = metrics_url(mesh.coordinator_log)
    client = OpenAI(base_url=mesh.http_url + "/v1", api_key="unused", max_retries=0, timeout=60)

    ask = [{"role": "user", "content": "Say something."}]
    assert (
        client.chat.completions.create(model=MODEL, messages=ask, max_tokens=8, temperature=0)
        .choices[0]
        .finish_reason
        == "length"
    )
    # A stop string taken from the greedy text ends the second completion early.
    text = (
        client.completions.create(
            model=MODEL, prompt="The weather today", max_tokens=16, temperature=0
        )
        .choices[0]
        .text
    )
    starts = [i for i in range(4, len(text) - 3) if not text[i : i + 3].isspace()]
    assert starts, f"the greedy text needs visible characters: {text!r}"
    stop = text[starts[0] : starts[0] + 3]
    cut = client.completions.create(
        model=MODEL, prompt="The weather today", max_tokens=16, temperature=0, stop=[stop]
    )
    assert cut.choices[0].finish_reason == "stop"
    # A stream the client leaves after three chunks; stage 1 holds its session meanwhile.
    stream = client.chat.completions.create(
        model=MODEL, messages=ask, max_tokens=400, temperature=0, stream=True
    )
    for index, _ in enumerate(stream):
        if index == 2:
            during = scrape(stage1)
            break
    stream.close()
    assert value(during, "mesh_stage_sessions") >= 1
    assert value(during, "mesh_stage_kv_bytes") > 0
    # No CUDA graphs on a CPU stage: both paths read 0.
    assert value(during, "mesh_stage_graph_frames", path="bucket") == 0
    assert value(during, "mesh_stage_graph_frames", path="session") == 0

    def stage0_saw_everything() -> str | None:
        body = scrape(stage0)
        seen = (
            value(body, "mesh_http_requests_total", endpoint=CHAT, status="499") >= 1
            and value(body, "mesh_generations_total", endpoint=CHAT, reason="cancelled") >= 1
            and value(body, "mesh_generations_total", reason="stop_string") >= 1
            and value(body, "mesh_sessions_active") == 0
        )
        return body if seen else None

    front = wait_for(stage0_saw_everything, DEADLINE_S, "stage 0 to count the abandoned stream")
    assert value(front, "mesh_http_requests_total", endpoint=COMPLETIONS, status="200") == 2
    assert value(front, "mesh_http_requests_total", endpoint=CHAT, status="200") == 1
    assert value(front, "mesh_generations_total", endpoint=CHAT, reason="length") == 1
    assert value(front, "mesh_completion_tokens_total") >= 8 + 16 + 1 + 2
    assert value(front, "mesh_time_to_first_token_seconds_count") == 4
    assert value(front, "mesh_stage_compute_seconds_count", stage="1") > 0
    assert value(front, "mesh_pipeline_round_seconds_count") > 0
    assert value(front, "mesh_step_tokens_count") > 0
    assert value(front, "mesh_speculation_rounds_total") > 0
    assert value(front, "mesh_active_requests") == 0
    # Stage 0's metrics port serves the same registry as its /metrics.
    assert families(scrape(stage0_port)) == families(front)

    # What one side of a link sent, the other received, once the mesh is idle.
    def links_agree() -> tuple[str, str] | None:
        first, second = scrape(stage0), scrape(stage1)
        pairs = (
            ("frames", "forward", first, second),
            ("bytes", "forward", first, second),
            ("frames", "return", second, first),
            ("bytes", "return", second, first),
        )
        for what, link, sender, receiver in pairs:
            sent = value(sender, f"mesh_link_{what}_sent_total", link=link)
            if sent == 0 or sent != value(receiver, f"mesh_link_{what}_received_total", link=link):
                return None
        return first, second

    _, later = wait_for(links_agree, DEADLINE_S, "both ends of each link to agree")
    term = value(later, "mesh_stage_term")
    assert term >= 1
    assert value(later, "mesh_stage_index") == 1 and value(later, "mesh_stage_loaded") == 1
    assert value(later, "mesh_stage_layers") > 0
    assert value(later, "mesh_stage_loads_total") >= 1
    assert value(later, "mesh_frame_compute_seconds_count") > 0
    assert value(later, "mesh_frame_tokens_count") > 0
    assert value(later, "mesh_stage_segments_total", kind="decode") > 0
    assert value(later, "mesh_stage_info", node_id="stage-1", device="cpu") == 1

    head = scrape(coordinator)
    assert value(head, "mesh_coordinator_term") == term
    assert value(head, "mesh_coordinator_loads_total", outcome="ok") >= 1
    assert value(head, "mesh_coordinator_load_seconds_count") >= 1
    assert value(head, "mesh_coordinator_mesh_state", state="serving") == 1
    assert value(head, "mesh_coordinator_pipeline_stages") == 2
    assert value(head, "mesh_coordinator_nodes", health="alive") == 2
    assert value(head, "mesh_coordinator_node_stage_index", node_id="stage-1") == 1
    assert value(head, "mesh_coordinator_node_up", node_id="stage-0") == 1

    for name, body in (("stage 0", front), ("stage 1", later), ("coordinator", head)):
        assert naming_problems(body) == [], name
