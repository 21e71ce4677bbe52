"""A real multi-process mesh on one machine, for tests, benchmarks and demos.

It runs `mesh-coordinator up --no-local-stage` and starts each stage
process itself, so a test can kill one. Ports come from the OS; readiness is
polled with deadlines; every process is cleaned up, even when a test fails.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from coordinator.netns_hosts import NetnsHosts
from coordinator.thread_freeze import FrozenThreads, threads_named
from mesh.codec import StatusReply
from mesh.security import MeshSecurity

STARTUP_DEADLINE_S = 120.0
NETNS_COORDINATOR_PORT = 7070


def wait_for(condition: Callable[[], object], deadline_s: float, what: str) -> object:
    """Poll ``condition`` until it returns a truthy value or the deadline passes."""
    end = time.monotonic() + deadline_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > end:
            raise TimeoutError(f"timed out after {deadline_s:.0f}s waiting for {what}")
        time.sleep(0.1)


class MeshProcesses:
    def __init__(
        self,
        package: Path,
        workdir: Path,
        stages: int,
        *,
        wire_dtype: str = "f32",
        coordinator_args: tuple[str, ...] = (),
        threads: int = 1,
        max_sessions: int = 16,
        max_queued: int = 32,
        stage0_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        stage_args: tuple[str, ...] = (),
        security: MeshSecurity | None = None,
        hosts: NetnsHosts | None = None,
    ) -> None:
        """``env`` is added to every process's environment and ``stage_args`` to every
        stage's command line (e.g. a join token and TLS flags); ``security`` is what
        this process uses to call the mesh (``status``). With ``hosts`` (network
        namespaces whose first host is the head), the coordinator and stage 0 run on
        the head and every other stage on a host of its own, each listening on its
        own address; this process must reach them (``hosts.reach_from_test_process``)."""
        self.hosts = hosts
        self._host_of: dict[str, str] = {}
        self.package = package
        self.workdir = workdir
        self.stage_count = stages
        self.threads = threads
        self.max_sessions = max_sessions
        self.max_queued = max_queued
        self.stage0_args = stage0_args
        self.stage_args = stage_args
        self.security = security
        self.stages: dict[str, subprocess.Popen] = {}
        self.state_file = workdir / "state.json"
        self.logs = workdir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        home = {"MESH_HOME": str(workdir / "home"), "PYTHONUNBUFFERED": "1"}
        env = {**os.environ, **home, **(env or {})}
        self.env = env
        self._coordinator_argv = [
            "--model",
            str(package),
            "--no-local-stage",
            "--min-stages",
            str(stages),
            "--wire-dtype",
            wire_dtype,
            "--state-file",
            str(self.state_file),
            # Stage 0's limits travel with the Load (it is given none itself).
            "--max-concurrent-requests",
            str(max_sessions),
            "--max-queued",
            str(max_queued),
            # A rebalance reloads the pipeline when the stages' step times drift
            # apart: tests and benchmarks that want one ask for it.
            "--rebalance-spread",
            "0",
            *coordinator_args,
        ]
        self.coordinator_address = ""
        if hosts is not None:
            self.coordinator_address = f"{hosts.address(hosts.names[0])}:{NETNS_COORDINATOR_PORT}"
        self.coordinator = self._start_coordinator()
        self.http_url = ""

    def _start_coordinator(self) -> subprocess.Popen:
        # Where this start's lines begin in the (appended) log: a reused workdir's log
        # holds earlier runs' addresses.
        log = self.logs / "coordinator.log"
        self._log_start = log.stat().st_size if log.exists() else 0
        if self.hosts is not None:
            listen = f"0.0.0.0:{NETNS_COORDINATOR_PORT}"
        else:
            listen = self.coordinator_address or "127.0.0.1:0"
        command = [sys.executable, "-m", "coordinator.cli", "up", "--listen", listen]
        return subprocess.Popen(
            self._placed(self.hosts.names[0] if self.hosts else None, command)
            + self._coordinator_argv,
            env=self.env,
            stdout=open(self.logs / "coordinator.log", "ab"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def _placed(self, host: str | None, command: list[str]) -> list[str]:
        """``command`` run on namespace host ``host`` (as is without hosts)."""
        return command if self.hosts is None or host is None else self.hosts.command(host, command)

    def host_of(self, node_id: str) -> str | None:
        """The namespace host a stage runs on (None without hosts)."""
        return self._host_of.get(node_id)

    def set_link(self, node_id: str, up: bool) -> None:
        """Take the link of the host ``node_id`` runs on down or up (hosts only)."""
        if self.hosts is None:
            raise RuntimeError("link faults need network-namespace hosts")
        self.hosts.set_link(self._host_of[node_id], up)

    def reset_links(self, node_id: str, to: str | None = None) -> int:
        """Reset (``ss -K``: an RST, as a middlebox or a rebooted peer would send) every
        TCP connection between stage ``node_id`` and the other stage processes (only
        stage ``to``'s, when given): its data links. Every process, its control
        connections and the HTTP clients stay up. Loopback meshes only (the kernel
        must allow socket destruction); returns how many connections were reset."""
        if self.hosts is not None:
            raise RuntimeError("reset faults need a loopback mesh")
        pid = self.stages[node_id].pid
        others = {
            p.pid for name, p in self.stages.items() if name != node_id and to in (None, name)
        }
        listing = subprocess.run(["ss", "-tnpH"], capture_output=True, text=True, check=True)
        owners: dict[str, int] = {}
        for line in listing.stdout.splitlines():
            fields = line.split()
            if len(fields) >= 6 and "pid=" in fields[5]:
                owners[fields[3]] = int(fields[5].split("pid=", 1)[1].split(",", 1)[0])
        reset = 0
        for line in listing.stdout.splitlines():
            fields = line.split()
            if len(fields) < 6 or f"pid={pid}," not in fields[5]:
                continue
            local, peer = fields[3], fields[4]
            if owners.get(peer) not in others:
                continue
            subprocess.run(["ss", "-K", "src", local, "dst", peer], capture_output=True, check=True)
            reset += 1
        return reset

    def hang_threads(
        self,
        node_id: str,
        names: tuple[str, ...],
        seconds: float,
        frozen: threading.Event | None = None,
    ) -> int:
        """Freeze the threads named ``names`` of stage ``node_id`` for ``seconds``
        while the rest of the process (its heartbeats) runs on
        (``coordinator/thread_freeze.py``); ``frozen`` is set once they are. Returns
        how many were frozen."""
        pid = self.stages[node_id].pid
        tids = threads_named(pid, names)
        if not tids:
            raise RuntimeError(f"stage {node_id} has no thread named {' or '.join(names)}")
        with FrozenThreads(pid, tids):
            if frozen is not None:
                frozen.set()
            time.sleep(seconds)
        return len(tids)

    def kill_coordinator(self) -> None:
        self.coordinator.send_signal(signal.SIGKILL)
        self.coordinator.wait(10)

    def start_coordinator_again(self) -> None:
        self.coordinator = self._start_coordinator()

    def coordinator_log(self) -> str:
        return (self.logs / "coordinator.log").read_text(errors="replace")

    def _find_address(self) -> str:
        with open(self.logs / "coordinator.log", "rb") as log:
            log.seek(self._log_start)
            lines = log.read().decode(errors="replace").splitlines()
        for line in lines:
            if " listening on " in line:
                return line.rsplit(" ", 1)[-1].strip()
        if self.coordinator.poll() is not None:
            raise RuntimeError("coordinator exited:\n" + self.coordinator_log())
        return ""

    def wait_address(self) -> str:
        """The coordinator's HOST:PORT, once it listens."""
        if not self.coordinator_address:
            self.coordinator_address = wait_for(self._find_address, 60, "the coordinator")
        return self.coordinator_address

    def start_stage(self, node_id: str, frontend: bool = False) -> subprocess.Popen:
        self.wait_address()
        command = [
            sys.executable,
            "-m",
            "stage.cli",
            "join",
            "--coordinator",
            self.coordinator_address,
            *(
                ["--listen", "127.0.0.1:0", "--advertise", "127.0.0.1"]
                if self.hosts is None
                else ["--listen", "0.0.0.0:0"]  # advertises its address towards the head
            ),
            "--node-id",
            node_id,
            "--threads",
            str(self.threads),
            "--cache-dir",
            str(self.workdir / "cache" / node_id),
            *self.stage_args,
        ]
        if frontend:
            http_host = "127.0.0.1" if self.hosts is None else "0.0.0.0"
            command += ["--frontend", "--http-host", http_host, "--http-port", "0"]
            command += [*self.stage0_args]
        host = self._place(node_id, frontend)
        process = subprocess.Popen(
            self._placed(host, command),
            env=self.env,
            stdout=open(self.logs / f"{node_id}.log", "wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.stages[node_id] = process
        return process

    def _place(self, node_id: str, frontend: bool) -> str | None:
        """Stage 0 on the head; each other stage on the next free host (a restarted
        stage on the host it had)."""
        if self.hosts is None:
            return None
        if node_id not in self._host_of:
            if frontend:
                self._host_of[node_id] = self.hosts.names[0]
            else:
                used = set(self._host_of.values())
                free = [h for h in self.hosts.names[1:] if h not in used]
                if not free:
                    raise RuntimeError(f"no free namespace host for stage {node_id}")
                self._host_of[node_id] = free[0]
        return self._host_of[node_id]

    def start(self) -> MeshProcesses:
        for index in range(self.stage_count):
            self.start_stage(f"stage-{index}", frontend=index == 0)
        return self

    def wait_serving(self, term: int = 1, deadline_s: float = STARTUP_DEADLINE_S) -> dict:
        def serving() -> dict | None:
            if self.coordinator.poll() is not None:
                raise RuntimeError("coordinator exited:\n" + self.coordinator_log())
            if not self.state_file.exists():
                return None
            body = json.loads(self.state_file.read_text())
            return body if body.get("term", 0) >= term else None

        body = wait_for(serving, deadline_s, f"the mesh to serve term {term}")
        self.http_url = body["http_url"]
        return body

    def status(self) -> StatusReply:
        from coordinator.cli import fetch_status

        return fetch_status(self.coordinator_address, self.security)

    def stage_address(self, node_id: str) -> str:
        for stage in self.status().stages:
            if stage.node_id == node_id:
                return stage.address
        raise KeyError(node_id)

    def kill_stage(self, node_id: str) -> None:
        process = self.stages.pop(node_id)
        process.send_signal(signal.SIGKILL)
        process.wait(10)

    def signal_stage(self, node_id: str, signum: int) -> None:
        """Send ``signum`` (e.g. SIGSTOP, SIGCONT) to a running stage process."""
        self.stages[node_id].send_signal(signum)

    def stage_log(self, node_id: str) -> str:
        return (self.logs / f"{node_id}.log").read_text(errors="replace")

    def close(self) -> None:
        for process in [*self.stages.values(), self.coordinator]:
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)  # a stopped process cannot terminate
                process.terminate()
        for process in [*self.stages.values(), self.coordinator]:
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)
        self.stages.clear()
