"""Hosts for multi-host tests and benchmarks: one network namespace per host, each with its own
10.x address on a veth pair plugged into one bridge, so that processes in different
"hosts" talk over a real (virtual) link and cannot use each other's loopback.

    hosts = NetnsHosts(["head", "worker-1", "client"]).create()
    hosts.address("head")                      # '10.213.N.1'
    hosts.popen("head", [...], log_path)       # a process inside the head namespace
    hosts.close()                              # kill processes, remove everything

Needs root and iproute2 (`ip`); ``unavailable_reason()`` says why not, for a skip.
Only addresses inside these namespaces are used.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

SUBNET_PREFIX = "10.213"
# Addresses on a network no other test host is on.
PRIVATE_PREFIX = "10.214"


def _ip(*args: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    command = ["ip", *(["netns", "exec", netns, "ip"] if netns else []), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=30, check=check)


def firewall_reason() -> str | None:
    """Why ``block_port`` cannot work here (None when it can)."""
    if shutil.which("iptables") is None:
        return "iptables is not installed (`make test` installs it where apt-get can)"
    return None


def unavailable_reason() -> str | None:
    """None when namespaces can be made here, else why not."""
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"mprobe{os.getpid() % 100000}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


class NetnsHosts:
    def __init__(self, names: list[str]) -> None:
        tag = os.getpid() % 10000
        self.prefix = f"m{tag}"
        self.subnet = f"{SUBNET_PREFIX}.{20 + tag % 200}"
        self.names = list(names)
        self._index = {name: i for i, name in enumerate(names)}
        self.bridge = f"{self.prefix}br"
        self.processes: list[subprocess.Popen] = []

    def netns(self, name: str) -> str:
        return f"{self.prefix}-{name}"

    def address(self, name: str) -> str:
        return f"{self.subnet}.{self._index[name] + 1}"

    def host_link(self, name: str) -> str:
        """The bridge-side end of ``name``'s veth pair (traffic *to* that host)."""
        return f"{self.prefix}v{self._index[name]}"

    def inner_link(self, name: str) -> str:
        """The namespace-side end (traffic *from* that host)."""
        return f"{self.prefix}p{self._index[name]}"

    def create(self) -> NetnsHosts:
        self._remove()  # leftovers of an earlier run that had the same pid
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "up")
            for name in self.names:
                ns, outer, inner = self.netns(name), self.host_link(name), self.inner_link(name)
                _ip("netns", "add", ns)
                _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
                _ip("link", "set", inner, "netns", ns)
                _ip("link", "set", outer, "master", self.bridge, "up")
                _ip("addr", "add", f"{self.address(name)}/24", "dev", inner, netns=ns)
                _ip("link", "set", inner, "up", netns=ns)
                _ip("link", "set", "lo", "up", netns=ns)
        except subprocess.CalledProcessError as error:
            self.close()
            raise RuntimeError(f"cannot build the test hosts: {error.stderr.strip()}") from error
        return self

    def command(self, name: str, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.netns(name), *argv]

    def popen(
        self, name: str, argv: list[str], log: Path, env: dict[str, str] | None = None
    ) -> subprocess.Popen:
        """Start ``argv`` on host ``name``; stdout and stderr go to ``log``."""
        log.parent.mkdir(parents=True, exist_ok=True)
        process = subprocess.Popen(
            self.command(name, argv),
            stdout=open(log, "ab"),
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
        self.processes.append(process)
        return process

    def run(
        self, name: str, argv: list[str], timeout: float = 120, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess:
        return subprocess.run(
            self.command(name, argv),
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, **(env or {})},
        )

    def reach_from_test_process(self) -> str:
        """Give the bridge an address, so that this (root-namespace) process can reach
        every host directly; returns that address."""
        address = f"{self.subnet}.254"
        _ip("addr", "add", f"{address}/24", "dev", self.bridge)
        return address

    def add_private_address(self, name: str) -> str:
        """Give host ``name`` a second address that no other host has a route to
        (as a head's address on a network its workers are not on)."""
        private = f"{PRIVATE_PREFIX}.{self.subnet.rsplit('.', 1)[1]}.1"
        _ip("addr", "add", f"{private}/24", "dev", self.inner_link(name), netns=self.netns(name))
        return private

    def limit_rate(self, name: str, rate: str | None) -> None:
        """Shape both directions of ``name``'s link with a token bucket (``tc tbf``),
        e.g. ``"100mbit"``; None removes the limit."""
        ends = ((self.host_link(name), None), (self.inner_link(name), self.netns(name)))
        for link, netns in ends:
            prefix = ["ip", "netns", "exec", netns] if netns else []
            subprocess.run(
                [*prefix, "tc", "qdisc", "del", "dev", link, "root"], capture_output=True
            )
            if rate is None:
                continue
            # The bucket holds ~4 ms of traffic at the rate (at least 64 KiB).
            bits = rate_bits(rate)
            burst = max(64 * 1024, bits // 8 // 250)
            subprocess.run(
                [*prefix, "tc", "qdisc", "add", "dev", link, "root", "tbf", "rate", rate,
                 "burst", str(burst), "latency", "100ms"],
                capture_output=True, text=True, check=True, timeout=30,
            )  # fmt: skip

    def block_port(self, name: str, port: int, blocked: bool = True) -> None:
        """Drop (or stop dropping) TCP packets to ``port`` on host ``name``, as a
        firewall there would: the port's connections time out, other ports answer.
        Needs ``iptables`` (see ``firewall_reason``)."""
        rule = ["INPUT", "-p", "tcp", "--dport", str(port), "-j", "DROP"]
        prefix = ["ip", "netns", "exec", self.netns(name), "iptables"]
        if blocked:
            subprocess.run([*prefix, "-A", *rule], check=True, capture_output=True, timeout=30)
            return
        while (
            subprocess.run([*prefix, "-D", *rule], capture_output=True, timeout=30).returncode == 0
        ):
            pass

    def cut_between(self, first: str, second: str, cut: bool = True) -> None:
        """Make hosts ``first`` and ``second`` unable (or able again) to reach each
        other while both still reach every other host: a blackhole route to the
        other's address on each side."""
        for here, there in ((first, second), (second, first)):
            verb = "add" if cut else "del"
            _ip("route", verb, "blackhole", f"{self.address(there)}/32",
                netns=self.netns(here), check=cut)  # fmt: skip

    def set_link(self, name: str, up: bool) -> None:
        """Take ``name``'s link down or up (its processes keep running)."""
        _ip("link", "set", self.host_link(name), "up" if up else "down")

    def close(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for process in self.processes:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                pass
        self._remove()

    def _remove(self) -> None:
        for name in self.names:
            _ip("netns", "del", self.netns(name), check=False)
            _ip("link", "del", self.host_link(name), check=False)
        _ip("link", "del", self.bridge, check=False)


def rate_bits(rate: str) -> int:
    """``"100mbit"`` -> 100_000_000 (tc's units: kbit, mbit, gbit)."""
    units = {"kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "bit": 1}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return int(float(rate[: -len(unit)]) * scale)
    raise ValueError(f"rate {rate!r}: use kbit, mbit or gbit")
