"""Stage 0's status page over a real 2-stage mesh with an API key: the JSON it
polls, after requests from the openai client, and the page itself in a real
browser (Debian's chromium driven by Playwright; CHROMIUM names another one), up
to a stage killed and the failover it shows. The tests run in order on one mesh:
the last one kills a stage."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from coordinator.localmesh import MeshProcesses, wait_for

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"
API_KEY = "sk-status-page-5d2e91"
DEADLINE_S = 60.0


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory, tiny_package_factory):
    package = tiny_package_factory("llama", layers=6)
    processes = MeshProcesses(
        package, tmp_path_factory.mktemp("status"), 2, env={"MESH_API_KEY": API_KEY}
    )
    try:
        processes.start().wait_serving()
        yield processes
    finally:
        processes.close()


@pytest.fixture(scope="module")
def client(mesh: MeshProcesses) -> OpenAI:
    return OpenAI(base_url=mesh.http_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def status(mesh: MeshProcesses, key: str | None = API_KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return httpx.get(mesh.http_url + "/status.json", headers=headers, timeout=30)


def ask(client: OpenAI, content: str, tokens: int = 12) -> int:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": content}],
        max_tokens=tokens,
        temperature=0,
    )
    return reply.usage.completion_tokens


def test_the_status_json_needs_the_key_and_the_page_does_not(mesh: MeshProcesses):
    assert status(mesh, key=None).status_code == 401
    refused = status(mesh, key="sk-wrong")
    assert refused.status_code == 401
    assert refused.headers["www-authenticate"] == "Bearer"
    assert "stage-1" not in refused.text
    page = httpx.get(mesh.http_url + "/status", timeout=30)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert httpx.get(mesh.http_url + "/status.js", timeout=30).status_code == 200
    home = httpx.get(mesh.http_url + "/", timeout=30)
    assert home.status_code == 307 and home.headers["location"] == "/status"


def test_the_status_json_describes_the_mesh_after_requests(mesh: MeshProcesses, client):
    generated = sum(ask(client, f"Tell me about the number {i}.") for i in range(3))
    coordinator = mesh.status()
    models = client.models.list().data[0].model_extra

    def sessions_ended_keeping_their_prefixes() -> dict | None:
        # Each stage's figures come with its heartbeat, once a second.
        body = status(mesh).json()
        settled = all(
            s["prefix_bytes"] > 0
            and s["kv_bytes"] == 0
            and s["sessions"] == 0
            and s["state"] == "serving"  # a stage's own state also comes by heartbeat
            for s in body["stages"]
        )
        return body if settled else None

    body = wait_for(sessions_ended_keeping_their_prefixes, DEADLINE_S, "both stages' KV")
    stages = body["stages"]
    assigned = sorted((s for s in coordinator.stages if s.assigned), key=lambda s: s.stage_index)
    assert [(s["index"], s["node_id"], s["address"]) for s in stages] == [
        (s.stage_index, s.node_id, s.address) for s in assigned
    ]
    assert [s["node_id"] for s in stages] == ["stage-0", "stage-1"]
    split = stages[0]["layers"][1]
    assert [s["layers"] for s in stages] == [[0, split], [split, 6]]
    for stage, known in zip(stages, assigned, strict=True):
        assert (stage["state"], stage["health"], stage["term"]) == ("serving", "alive", 1)
        assert stage["param_bytes"] == known.param_bytes > 0
        # Every frame of these requests ran on both stages.
        assert stage["frames"] > 0 and stage["step_ms"] > 0 and stage["queue_ms"] >= 0
    assert body["throughput"]["tokens_total"] == generated
    assert body["throughput"]["round_ms"] > 0
    assert body["requests"] == {
        "running": 0,
        "queued": 0,
        "max_running": mesh.max_sessions,
        "max_queued": mesh.max_queued,
        "recoveries": 0,
    }
    model = body["model"]
    assert (model["id"], model["package"], model["layer_count"]) == (MODEL, str(mesh.package), 6)
    assert (model["dtype"], model["weights"], model["wire_dtype"]) == ("float32", "float32", "f32")
    assert model["context_length"] == models["context_length"] > 0
    assert body["mesh"]["reachable"] and body["mesh"]["state"] == "serving"
    assert body["mesh"]["coordinator_id"] == coordinator.coordinator_id
    assert body["ready"] and body["uptime_s"] >= body["pipeline_uptime_s"] > 0
    served = models["speculation"]["strategy"]
    assert body["speculation"]["strategy"] == ("" if served == "none" else served)
    assert any(e["kind"] == "load" and "term 1, 2 stage(s)" in e["message"] for e in body["events"])

    def tokens_per_second_after_a_request() -> float:
        ask(client, "One more question.", tokens=4)
        return status(mesh).json()["throughput"]["tokens_per_s"]

    assert wait_for(tokens_per_second_after_a_request, DEADLINE_S, "tokens per second") > 0


def chromium_executable() -> str | None:
    named = os.environ.get("CHROMIUM")
    if named:
        return shutil.which(named) or (named if Path(named).is_file() else None)
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def browser():
    executable = chromium_executable()
    if executable is None:
        pytest.skip(
            "no chromium to run the status page in: install Debian's chromium "
            "(`make browser`) or name one with CHROMIUM=/path/to/chromium"
        )
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=executable, headless=True)
        try:
            yield launched
        finally:
            launched.close()


@pytest.fixture
def page(browser):
    opened = browser.new_page()
    opened.set_default_timeout(DEADLINE_S * 1000)
    yield opened
    opened.close()


def test_the_page_asks_for_the_api_key(page, mesh: MeshProcesses):
    from playwright.sync_api import expect

    page.goto(mesh.http_url + "/status")
    expect(page.locator("#key-prompt")).to_be_visible()
    expect(page.locator("#key-message")).to_have_text(re.compile("needs its API key"))
    expect(page.locator("#board")).to_be_hidden()
    page.fill("#key-input", "sk-wrong")
    page.click("#key-form button")
    expect(page.locator("#key-message")).to_have_text(re.compile("refused"))
    expect(page.locator("#board")).to_be_hidden()
    page.fill("#key-input", API_KEY)
    page.click("#key-form button")
    expect(page.locator("#key-prompt")).to_be_hidden()
    expect(page.locator("#model")).to_have_text(MODEL)


def stage_rows(page):
    return page.locator("#stages tbody tr")


def test_the_page_shows_the_stages_and_the_tokens_going_through(page, mesh: MeshProcesses, client):
    from playwright.sync_api import expect

    page.goto(f"{mesh.http_url}/status#key={API_KEY}")
    expect(page.locator("#model-id")).to_have_text(MODEL)
    expect(page.locator("#mesh-state")).to_have_text("serving")
    rows = stage_rows(page)
    expect(rows).to_have_count(2)
    split = status(mesh).json()["stages"][0]["layers"][1]
    expect(rows.nth(0)).to_contain_text("stage-0")
    expect(rows.nth(0)).to_contain_text(f"[0, {split})")
    expect(rows.nth(1)).to_contain_text("stage-1")
    expect(rows.nth(1)).to_contain_text(f"[{split}, 6)")
    for row in (rows.nth(0), rows.nth(1)):
        expect(row.locator("td").nth(5)).to_have_text("serving")
    expect(page.locator("#context")).to_have_text(re.compile(r"^\d+ tokens$"))
    before = int(page.locator("#tokens-total").text_content())
    generated = sum(ask(client, f"Count to {i}.", tokens=16) for i in range(3, 6))
    expect(page.locator("#tokens-total")).to_have_text(str(before + generated))

    def shows_tokens_per_second() -> bool:
        seen = page.locator("#tokens-total").text_content()
        ask(client, "And once more.", tokens=4)
        page.wait_for_function(
            "(seen) => document.getElementById('tokens-total').textContent !== seen", arg=seen
        )
        return page.locator("#tok-s").text_content() != "0.0 tok/s"

    assert wait_for(shows_tokens_per_second, DEADLINE_S, "the page to show tok/s")
    expect(page.locator("#events")).to_contain_text("pipeline loaded")


def test_a_killed_stage_shows_as_a_failover(page, mesh: MeshProcesses):
    from playwright.sync_api import expect

    page.goto(f"{mesh.http_url}/status#key={API_KEY}")
    expect(stage_rows(page)).to_have_count(2)
    term = mesh.status().term
    mesh.kill_stage("stage-1")
    mesh.wait_serving(term=term + 1)
    # The mesh serves on stage 0 alone; the page says what happened.
    expect(stage_rows(page)).to_have_count(1)
    expect(stage_rows(page).nth(0)).to_contain_text("[0, 6)")
    events = page.locator("#events li")
    expect(events.filter(has_text="failover").filter(has_text="stage-1")).to_have_count(1)
    expect(events.filter(has_text=f"pipeline reloaded: term {term + 1}")).to_have_count(1)
    expect(page.locator("#spare-nodes tbody tr")).to_contain_text("stage-1")
    expect(page.locator("#spare-nodes tbody tr")).to_contain_text("dead")
