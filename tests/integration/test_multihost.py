"""The README's multi-machine recipe, run as written on hosts made of network
namespaces: a head (coordinator + stage 0 + HTTP), two workers and a client host,
each with its own 10.x address on a bridge. Nothing may dial another host's
loopback: a stage that advertised 127.0.0.1 would fail here."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from coordinator.localmesh import wait_for
from coordinator.netns_hosts import NetnsHosts, firewall_reason, unavailable_reason
from mesh.package.manifest import PackageManifest
from mesh.types import LayerRange

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
PROMPT = [1, 517, 2049, 33, 1200, 77, 4051, 9, 300]
NEW_TOKENS = 12
HOSTS = ["head", "worker-1", "worker-2", "client"]

pytestmark = pytest.mark.skipif(
    unavailable_reason() is not None, reason=f"no network namespaces: {unavailable_reason()}"
)


def readme_recipe() -> dict[str, list[str]]:
    """The commands of the README's "Across machines" block, by program and verb."""
    text = (REPO / "README.md").read_text()
    block = text.split("## Across machines", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    commands = {}
    for line in block.splitlines():
        if line.startswith("mesh-"):
            argv = shlex.split(line)
            commands[f"{argv[0]} {argv[1]}"] = argv
    assert set(commands) == {"mesh-coordinator up", "mesh-stage join", "mesh-coordinator status"}
    return commands


def recipe(verb: str, head_ip: str, package: Path) -> list[str]:
    argv = readme_recipe()[verb]
    argv = [a.replace("HEAD_IP", head_ip).replace("PACKAGE", str(package)) for a in argv]
    return [str(BIN / argv[0]), *argv[1:]]


CLIENT_SCRIPT = """
import json, sys
from openai import OpenAI
client = OpenAI(base_url=sys.argv[1], api_key="unused", max_retries=0, timeout=120)
reply = client.completions.create(
    model=sys.argv[2], prompt=json.loads(sys.argv[3]), max_tokens=int(sys.argv[4]), temperature=0
)
print(json.dumps({"text": reply.choices[0].text}))
"""


def client_completion(hosts: NetnsHosts, base_url: str, model: str) -> str:
    """A greedy completion by the openai client, run on the client host."""
    argv = [sys.executable, "-c", CLIENT_SCRIPT, base_url, model, json.dumps(PROMPT)]
    done = hosts.run("client", [*argv, str(NEW_TOKENS)], timeout=180)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])["text"]


def status_json(hosts: NetnsHosts, argv: list[str]) -> dict | None:
    done = hosts.run("client", [*argv, "--json"], timeout=60)
    return json.loads(done.stdout) if done.returncode == 0 else None


def unsplit_text(model_dir: Path) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = model.generate(
        torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=0
    )
    return AutoTokenizer.from_pretrained(model_dir).decode(out[0, len(PROMPT) :].tolist())


@pytest.fixture(scope="module")
def hosts():
    made = NetnsHosts(HOSTS).create()
    made.reach_from_test_process()  # the link test's streams run from this process
    try:
        yield made
    finally:
        made.close()


class Recipe:
    """The README recipe started on the namespace hosts."""

    def __init__(
        self,
        hosts: NetnsHosts,
        package: Path,
        workdir: Path,
        extra=None,
        hide_package: bool = False,
    ) -> None:
        """``hide_package``: the workers run in a mount namespace where the package's
        directory is an empty file system (no shared file system with the head)."""
        self.hosts = hosts
        self.head_ip = hosts.address("head")
        self.workdir = workdir
        extra = extra or {}
        up = recipe("mesh-coordinator up", self.head_ip, package) + extra.get("head", [])
        self.head = hosts.popen("head", up, workdir / "head.log", self._home("head"))
        self.package = package
        self.extra = extra
        self.hide_package = hide_package
        self.workers = {}
        for name in ("worker-1", "worker-2"):
            self.start_worker(name)
        self.status_argv = recipe("mesh-coordinator status", self.head_ip, package)
        self.status_argv += extra.get("client", [])

    def start_worker(self, name: str) -> None:
        join = recipe("mesh-stage join", self.head_ip, self.package) + self.extra.get(name, [])
        if self.hide_package:
            hide = f"mount -t tmpfs tmpfs {shlex.quote(str(self.package.parent))}"
            join = ["unshare", "-m", "sh", "-c", f"{hide} && exec {shlex.join(join)}"]
        log = self.workdir / f"{name}.log"
        self.workers[name] = self.hosts.popen(name, join, log, self._home(name))

    def _home(self, name: str) -> dict[str, str]:
        # Each host has its own cache (its own disk); the shared package path stands
        # for a shared file system.
        return {"MESH_HOME": str(self.workdir / name / "home"), "PYTHONUNBUFFERED": "1"}

    def status(self) -> dict | None:
        return status_json(self.hosts, self.status_argv)

    def wait_serving(self, stages: int, above_term: int = 0) -> dict:
        def serving() -> dict | None:
            if self.head.poll() is not None:
                raise RuntimeError("the head exited:\n" + self.log("head"))
            status = self.status()
            if status is None or status["state"] != "serving" or status["term"] <= above_term:
                return None
            assigned = [s for s in status["stages"] if s["assigned"]]
            return status if len(assigned) == stages else None

        return wait_for(serving, 180, f"the mesh to serve on {stages} stages")

    def log(self, name: str) -> str:
        return (self.workdir / f"{name}.log").read_text(errors="replace")

    def kill(self, name: str) -> None:
        process = self.workers.pop(name)
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)

    def stop(self) -> None:
        for process in [self.head, *self.workers.values()]:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in [self.head, *self.workers.values()]:
            try:
                process.wait(30)
            except Exception:  # noqa: BLE001 - cleanup goes on; close() kills the rest
                pass


@pytest.fixture(scope="module")
def package(tiny_package_factory) -> Path:
    return tiny_package_factory("llama", layers=6)


@pytest.fixture(scope="module")
def expected(tiny_model_factory) -> str:
    return unsplit_text(tiny_model_factory("llama", layers=6))


def test_the_readme_recipe_serves_a_client_on_another_host_and_fails_over(
    hosts, package, expected, tmp_path
):
    mesh = Recipe(hosts, package, tmp_path)
    try:
        status = mesh.wait_serving(stages=3)
        addresses = {s["node_id"]: s["address"] for s in status["stages"] if s["assigned"]}
        # Every stage advertised its own namespace address, never loopback.
        hosts_of = {a.rsplit(":", 1)[0] for a in addresses.values()}
        assert hosts_of == {hosts.address(h) for h in ("head", "worker-1", "worker-2")}
        assert status["http_url"] == f"http://{mesh.head_ip}:8000"
        # A client on a fourth host gets the unsplit model's greedy output.
        assert client_completion(hosts, status["http_url"] + "/v1", "tiny-llama") == expected
        # A worker host's processes die: the mesh fails over to the two hosts left.
        mesh.kill("worker-2")
        status = mesh.wait_serving(stages=2, above_term=status["term"])
        assert client_completion(hosts, status["http_url"] + "/v1", "tiny-llama") == expected
    finally:
        mesh.stop()


def test_the_recipe_with_tls_certificates_naming_the_host_addresses(
    hosts, package, expected, tmp_path
):
    ips = [hosts.address(h) for h in ("head", "worker-1", "worker-2")]
    certs = tmp_path / "tls"
    made = hosts.run("head", [str(BIN / "mesh-coordinator"), "certs", "--out", str(certs),
                              "--hosts", ",".join(ips)])  # fmt: skip
    assert made.returncode == 0, made.stderr

    def tls(ip: str) -> list[str]:
        return ["--tls-cert", str(certs / f"node-{ip}.pem"), "--tls-key",
                str(certs / f"node-{ip}-key.pem"), "--tls-ca", str(certs / "ca.pem")]  # fmt: skip

    extra = {
        "head": tls(ips[0]),
        "worker-1": tls(ips[1]),
        "worker-2": tls(ips[2]),
        "client": ["--tls-ca", str(certs / "ca.pem")],
    }
    mesh = Recipe(hosts, package, tmp_path, extra)
    try:
        status = mesh.wait_serving(stages=3)
        assert client_completion(hosts, status["http_url"] + "/v1", "tiny-llama") == expected
        # Without the CA, status cannot talk to the TLS coordinator.
        assert status_json(hosts, recipe("mesh-coordinator status", mesh.head_ip, package)) is None
    finally:
        mesh.stop()


def test_a_worker_that_cannot_reach_stage_0_fails_naming_the_address(hosts, package, tmp_path):
    # The head advertises an address of its own that the workers have no route to:
    # the coordinator (on the head) reaches stage 0, the last stage cannot.
    unreachable = hosts.add_private_address("head")
    extra = {"head": ["--advertise", unreachable, "--load-attempts", "1"]}
    mesh = Recipe(hosts, package, tmp_path, extra)
    try:
        started = time.monotonic()
        assert mesh.head.wait(240) == 1, mesh.log("head")
        log = mesh.log("head")
        assert f"cannot reach {unreachable}:" in log and "could not be loaded" in log
        assert time.monotonic() - started < 240
    finally:
        mesh.stop()


def test_a_worker_link_down_and_up_during_streams_corrupts_nothing(hosts, package, tmp_path):
    """A link fault, not a process fault: worker-2's link goes down for 6 s while
    four streams run, then comes back. The coordinator fails over; when the link
    returns, the worker learns its term is over and the mesh grows back to three
    stages. Every stream equals its no-fault output: the stages compute row-
    invariantly, so the prefill that replays a stream after the failover gives its
    tokens the logits their decode steps gave them (a dense float32 package without
    it keeps the text only up to float rounding: a near-tie at temperature 0.8 can
    flip, seen once in three runs on one VM)."""
    from coordinator.chaos import StreamSpec, classify, run_stream

    exact = ["--row-invariant", "on"]
    mesh = Recipe(hosts, package, tmp_path, {"head": exact, "worker-1": exact, "worker-2": exact})
    try:
        status = mesh.wait_serving(stages=3)
        url = status["http_url"]
        specs = [
            StreamSpec(f"Link test {i}: a story about {topic}", 160, 0.8 if i % 2 else 0.0, i)
            for i, topic in enumerate(["ships", "bees", "rain", "clocks"])
        ]
        expected = [run_stream(url, "tiny-llama", spec) for spec in specs]
        assert all(e.error is None for e in expected)
        started = [threading.Event() for _ in specs]
        with ThreadPoolExecutor(len(specs)) as pool:
            futures = [
                pool.submit(run_stream, url, "tiny-llama", spec, started[i])
                for i, spec in enumerate(specs)
            ]
            for event in started:
                assert event.wait(60)
            hosts.set_link("worker-2", up=False)
            time.sleep(6.0)
            hosts.set_link("worker-2", up=True)
            outcomes = [f.result(timeout=300) for f in futures]
        verdicts = [classify(o, e) for o, e in zip(outcomes, expected, strict=True)]
        assert verdicts == ["identical"] * len(specs), [o.error for o in outcomes]
        after = mesh.wait_serving(stages=3, above_term=status["term"])
        assert after["term"] > status["term"]
        assert "this stage still held term" in mesh.log("worker-2")
    finally:
        mesh.stop()


def stage_0_on_worker_1(
    hosts: NetnsHosts, package: Path, workdir: Path, worker_2: list[str] | None = None
) -> Recipe:
    """A 2-stage mesh whose stage 0 (with the frontend) runs on worker-1, not on the
    head, which runs the coordinator alone; worker-2 is the last stage (with the
    flags ``worker_2`` more). A token a round (no speculation), each round slowed
    down on worker-2's links: streams are still running when a fault comes."""
    exact = ["--row-invariant", "on"]
    frontend = ["--frontend", "--http-host", "0.0.0.0", "--http-port", "8000"]
    return Recipe(
        hosts,
        package,
        workdir,
        {
            "head": ["--no-local-stage", "--min-stages", "2", *exact],
            "worker-1": [*frontend, "--spec-type", "none", *exact],
            "worker-2": ["--inject-delay-ms", "40", *exact, *(worker_2 or [])],
        },
    )


def test_stage_0_cut_off_from_the_coordinator_stops_waiting_for_the_stage_it_lost(
    hosts, package, tmp_path
):
    """Stage 0 (the frontend, on a host of its own) and the coordinator cannot reach
    each other for about 15 s while streams run; the data links between the stages stay
    up. The coordinator takes stage 0 for dead and releases the other stage, which
    closes the link stage 0 sends its frames on: stage 0's requests wait for the
    next pipeline and /health says 503 with the reason. Before, the released stage
    dropped the frames without a word, stage 0 waited for answers for the whole
    partition and more (until the round timeout, 120 s) and /health said 200. When
    the network heals, stage 0 is heard again within seconds (gRPC's own reconnect
    backoff no longer grows past 5 s) and every stream ends with its no-fault
    text."""
    import httpx

    from coordinator.chaos import StreamSpec, classify, run_stream

    mesh = stage_0_on_worker_1(hosts, package, tmp_path)
    try:
        status = mesh.wait_serving(stages=2)
        url = status["http_url"]
        assert hosts.address("worker-1") in url
        specs = [
            StreamSpec(f"Cut test {i}: a story about {topic}", 300, 0.8 if i % 2 else 0.0, i)
            for i, topic in enumerate(["ships", "bees"])
        ]
        expected = [run_stream(url, "tiny-llama", spec) for spec in specs]
        assert all(e.error is None for e in expected)
        started = [threading.Event() for _ in specs]
        with ThreadPoolExecutor(len(specs)) as pool:
            futures = [
                pool.submit(run_stream, url, "tiny-llama", spec, started[i])
                for i, spec in enumerate(specs)
            ]
            for event in started:
                assert event.wait(60)
            hosts.cut_between("head", "worker-1")
            try:
                wait_for(
                    lambda: httpx.get(url + "/health", timeout=5).status_code == 503,
                    20,
                    "stage 0's /health to say 503 while its pipeline is gone",
                )
                reason = httpx.get(url + "/health", timeout=5).json()["reason"]
                assert "broken" in reason, reason
                assert not any(f.done() for f in futures), [f.result() for f in futures if f.done()]
                time.sleep(12.0)
            finally:
                hosts.cut_between("head", "worker-1", cut=False)
            outcomes = [f.result(timeout=300) for f in futures]
        verdicts = [classify(o, e) for o, e in zip(outcomes, expected, strict=True)]
        assert verdicts == ["identical"] * len(specs), [o.error for o in outcomes]
        after = mesh.wait_serving(stages=2, above_term=status["term"])
        assert after["term"] > status["term"]
        assert httpx.get(url + "/health", timeout=5).status_code == 200
        # worker-2 closed stage 0's link because it let go of its layers: either at the
        # release itself ("let go of its layers") or, when a frame of the released term
        # came in first (the release ends its sessions before it closes the links), at
        # that frame ("let go of the layers of term N").
        closed = [
            line
            for line in mesh.log("worker-2").splitlines()
            if "closing" in line and "let go of" in line
        ]
        assert closed, [line for line in mesh.log("worker-2").splitlines() if "DEBUG" not in line]
    finally:
        mesh.stop()


@pytest.mark.skipif(firewall_reason() is not None, reason=str(firewall_reason()))
def test_a_data_link_that_drops_its_packets_past_the_send_timeout_with_no_coordinator_heals(
    hosts, package, tmp_path
):
    """The coordinator is gone and worker-2's host drops its data port's packets
    while a stream runs, long enough for stage 0's send timeout (30 s) to break its
    link; then the port passes packets again. Every stage still serves the term, so
    stage 0 opens its link again itself (it asks worker-2 over gRPC, whose port
    answers, which term it serves) and the stream ends with its no-fault text.
    Before, the broken link stayed broken: the stream failed 60 s after the break and
    the mesh answered 503 until a coordinator was started again."""
    import httpx

    from coordinator.chaos import StreamSpec, classify, run_stream

    port = 7082
    mesh = stage_0_on_worker_1(hosts, package, tmp_path, ["--data-port", str(port)])
    try:
        status = mesh.wait_serving(stages=2)
        url = status["http_url"]
        spec = StreamSpec("Dropped packets and no coordinator: a story about tides", 400)
        expected = run_stream(url, "tiny-llama", spec)
        assert expected.error is None, expected.error
        started = threading.Event()
        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(run_stream, url, "tiny-llama", spec, started)
            assert started.wait(60)
            os.killpg(mesh.head.pid, signal.SIGKILL)
            mesh.head.wait(10)
            hosts.block_port("worker-2", port)
            try:
                wait_for(
                    lambda: "broke" in mesh.log("worker-1") and port_named(mesh, port),
                    90,
                    "stage 0's link to worker-2 to break at its send timeout",
                )
                time.sleep(3.0)  # opening it again fails while the port drops packets
                assert not future.done(), future.result()
            finally:
                hosts.block_port("worker-2", port, blocked=False)
            outcome = future.result(timeout=300)
        assert classify(outcome, expected) == "identical", outcome.error
        assert "opened the forward link of term" in mesh.log("worker-1")
        wait_for(lambda: httpx.get(url + "/health", timeout=5).status_code == 200, 30, "200")
    finally:
        hosts.block_port("worker-2", port, blocked=False)
        mesh.stop()


def port_named(mesh: Recipe, port: int) -> bool:
    """Whether stage 0's log names a broken forward link to ``port``."""
    return any(
        "forward link to" in line and f":{port} broke" in line
        for line in mesh.log("worker-1").splitlines()
    )


def test_a_coordinator_cut_off_from_every_stage_fences_nothing_when_the_cut_heals(
    hosts, package, tmp_path
):
    """The coordinator's host cannot reach either stage host for about 12 s while
    streams run (stage 0 with the frontend on worker-1, the data links between the
    stages up). The stages serve on, and the coordinator, hearing no stage at all,
    judges none of them: when the cut heals they are heard again and the pipeline
    keeps its term. Before, it declared both dead and, when they came back, loaded a
    new term that fenced the pipeline serving the streams."""
    from coordinator.chaos import StreamSpec, classify, run_stream

    mesh = stage_0_on_worker_1(hosts, package, tmp_path)
    try:
        status = mesh.wait_serving(stages=2)
        url = status["http_url"]
        specs = [StreamSpec("Isolation test: a story about owls", 300, 0.8, 7)]
        expected = [run_stream(url, "tiny-llama", spec) for spec in specs]
        started = threading.Event()
        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(run_stream, url, "tiny-llama", specs[0], started)
            assert started.wait(60)
            for worker in ("worker-1", "worker-2"):
                hosts.cut_between("head", worker)
            try:
                time.sleep(12.0)
            finally:
                for worker in ("worker-1", "worker-2"):
                    hosts.cut_between("head", worker, cut=False)
            outcome = future.result(timeout=300)
        assert classify(outcome, expected[0]) == "identical", outcome.error

        def heard() -> bool:
            now = mesh.status()
            return now is not None and all(
                s["heartbeat_age_s"] < 2.0 for s in now["stages"] if s["assigned"]
            )

        wait_for(heard, 60, "the stages of the pipeline to be heard again")
        time.sleep(20.0)  # past the grace the others get to be heard
        after = mesh.status()
        assert after is not None and after["state"] == "serving", after
        assert after["term"] == status["term"], after
        assert "this coordinator's network may be cut off" in mesh.log("head")
    finally:
        mesh.stop()


@pytest.mark.skipif(firewall_reason() is not None, reason=str(firewall_reason()))
def test_a_worker_whose_data_port_a_firewall_drops_is_planned_around(
    hosts, package, expected, tmp_path
):
    """worker-1's host drops its data port while its control port answers: its
    heartbeats arrive, but no stage can open a data link to it. The load that fails
    at that link is held against worker-1, not against the stage that could not reach
    it (stage 0 cannot be left out, and a plan of the same nodes would fail the same
    way for as long as the firewall stays): worker-1 is left out for a quarantine
    and the mesh serves on the head and worker-2; with the port open again, it grows
    back to three stages."""
    port = 7072
    hosts.block_port("worker-1", port)
    extra = {"worker-1": ["--listen", "0.0.0.0:7071", "--data-port", str(port)]}
    mesh = Recipe(hosts, package, tmp_path, extra)
    try:
        status = mesh.wait_serving(stages=2)
        worker_1 = f"{hosts.address('worker-1')}:7071"
        assigned = [s["address"] for s in status["stages"] if s["assigned"]]
        assert worker_1 not in assigned
        assert client_completion(hosts, status["http_url"] + "/v1", "tiny-llama") == expected
        # Found by the data-port probe before a load (or, where the probe passed, by
        # the load's link): either way worker-1 is named and left out.
        log = mesh.log("head")
        address = f"{hosts.address('worker-1')}:{port}"
        probed = f"its data port {address} does not accept connections" in log
        loaded = "could not open its data link to it at Load" in log
        assert probed or (loaded and f"cannot reach {address}" in log)
        hosts.block_port("worker-1", port, blocked=False)
        grown = mesh.wait_serving(stages=3, above_term=status["term"])
        assert worker_1 in [s["address"] for s in grown["stages"] if s["assigned"]]
        assert client_completion(hosts, grown["http_url"] + "/v1", "tiny-llama") == expected
    finally:
        hosts.block_port("worker-1", port, blocked=False)
        mesh.stop()


def test_workers_that_cannot_reach_each_other_are_found_before_a_load(
    hosts, package, expected, tmp_path
):
    """worker-1 and worker-2 stop reaching each other while the mesh serves on all
    three hosts and the head still reaches both (a partition between worker hosts).
    The next request's frames stall between them: the stage holding them is left
    out for a quarantine and the request continues on two stages with the same
    text. When the quarantine ends, the stage that would open the link between the
    workers is asked first whether it can (ProbeLink): the node is left out again
    before anything is fenced, so the two-stage pipeline keeps its term and no load
    fails at that link (before: every quarantine's end fenced the serving pipeline
    and cost 12-13 s without an answer)."""
    mesh = Recipe(hosts, package, tmp_path, {"head": ["--stall-timeout", "3"]})
    try:
        three = mesh.wait_serving(stages=3)
        hosts.cut_between("worker-1", "worker-2")
        assert client_completion(hosts, three["http_url"] + "/v1", "tiny-llama") == expected
        two = mesh.wait_serving(stages=2, above_term=three["term"])
        wait_for(
            lambda: "cannot open its data link to" in mesh.log("head"),
            120,
            "the coordinator to find the cut link before a load",
        )
        log = mesh.log("head")
        assert "could not open its data link to it at Load" not in log
        assert "its load failed at" not in log
        status = mesh.status()
        assert status is not None and status["term"] == two["term"], status
        assert client_completion(hosts, two["http_url"] + "/v1", "tiny-llama") == expected
    finally:
        hosts.cut_between("worker-1", "worker-2", cut=False)
        mesh.stop()


def test_workers_without_the_package_fetch_their_slices_from_the_head(
    hosts, package, expected, tmp_path
):
    """The package exists only on the head: each worker's file system hides it, so
    the workers fetch the files of their own layer range from the coordinator."""
    mesh = Recipe(hosts, package, tmp_path, hide_package=True)
    try:
        status = mesh.wait_serving(stages=3)
        assert client_completion(hosts, status["http_url"] + "/v1", "tiny-llama") == expected
        manifest = PackageManifest.load(package)
        workers = {hosts.address(n): n for n in ("worker-1", "worker-2")}
        for stage in status["stages"]:
            if not stage["assigned"] or stage["stage_index"] == 0:
                continue
            worker = workers[stage["address"].rsplit(":", 1)[0]]
            assert "from the coordinator at" in mesh.log(worker)
            cache = tmp_path / worker / "home" / "slices"
            cached = {p.name for p in cache.rglob("*") if p.is_file()}
            wanted = manifest.files_for(LayerRange(*stage["layer_range"]))
            assert cached == {Path(e.path).name for e in wanted} | {"model-package.json"}
    finally:
        mesh.stop()


def test_a_newcomer_fetching_its_slice_over_a_slow_link_does_not_stop_serving(
    hosts, package, expected, tmp_path
):
    """The mesh grows back onto a worker that must fetch its layers over a slow link:
    the pipeline serving now goes on answering while the newcomer downloads (before,
    the coordinator fenced the serving stages first and the mesh answered 503 for the
    whole download); only the load itself pauses it."""
    mesh = Recipe(hosts, package, tmp_path, hide_package=True)
    try:
        status = mesh.wait_serving(stages=3)
        mesh.kill("worker-2")
        shrunk = mesh.wait_serving(stages=2, above_term=status["term"])
        shutil.rmtree(tmp_path / "worker-2" / "home")  # its cache is gone: it fetches again
        hosts.limit_rate("worker-2", "4mbit")
        mesh.start_worker("worker-2")
        marker = "prepared while term"
        wait_for(lambda: marker in mesh.log("head"), 120, "the newcomer to start preparing")

        def loading() -> bool:
            return "loading" in mesh.log("head").split(marker, 1)[1]

        # Requests sent while the newcomer downloads (before the coordinator begins
        # the load that fences the serving stages) are answered.
        answers = []
        while not loading():
            try:
                answers.append(client_completion(hosts, shrunk["http_url"] + "/v1", "tiny-llama"))
            except AssertionError:
                assert loading(), "a request failed while the newcomer was downloading"
        assert len(answers) >= 2 and set(answers) == {expected}, answers
        grown = mesh.wait_serving(stages=3, above_term=shrunk["term"])
        assert client_completion(hosts, grown["http_url"] + "/v1", "tiny-llama") == expected
    finally:
        hosts.limit_rate("worker-2", None)
        mesh.stop()


@pytest.mark.parametrize("listen", ["wildcard", "address"])
def test_workers_joined_with_coordinator_auto_find_the_head(
    hosts, package, expected, tmp_path, listen: str
):
    """`mesh-stage join --coordinator auto` finds the head by UDP broadcast on the
    bridge; with a join token the head's answer proves it has the token. A head that
    listens on its one address (not 0.0.0.0) is found too (before, its discovery
    socket was bound to that address and never received a broadcast)."""
    token = tmp_path / "token"
    token.write_text("a-join-token-for-discovery-0123456789")
    secured = ["--join-token-file", str(token)]
    auto = ["--coordinator", "auto", *secured]
    head = secured + (["--listen", f"{hosts.address('head')}:7070"] if listen == "address" else [])
    extra = {"head": head, "worker-1": auto, "worker-2": auto, "client": secured}
    mesh = Recipe(hosts, package, tmp_path, extra)
    try:
        status = mesh.wait_serving(stages=3)
        assert client_completion(hosts, status["http_url"] + "/v1", "tiny-llama") == expected
        for worker in ("worker-1", "worker-2"):
            assert f"found the coordinator at {mesh.head_ip}:7070" in mesh.log(worker)
    finally:
        mesh.stop()
