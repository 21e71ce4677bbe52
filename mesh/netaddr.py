"""Which address a node tells others to dial.

A node that listens on a wildcard (``0.0.0.0``) must advertise an address other
hosts can reach: never loopback when its peers are elsewhere. In order:

1. what the operator gave (``--advertise``);
2. the listen host, when it is a specific address;
3. the source address of the route to the coordinator, when the coordinator is on
   another host (asking the kernel for the route sends no packet);
4. the first global IPv4 address of this host's interfaces;
5. loopback.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import subprocess
from collections.abc import Callable

logger = logging.getLogger(__name__)

WILDCARDS = ("", "0.0.0.0", "::", "[::]")


MAX_PORT = 65535


def split_host_port(address: str) -> tuple[str, int]:
    """``host:port`` (IPv6 hosts in brackets) -> (host, port); ValueError for anything
    else, a port past 65535 included (a socket would take it modulo 65536)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not port.isascii():
        raise ValueError(f"{address!r} is not HOST:PORT")
    if int(port) > MAX_PORT:
        raise ValueError(f"{address!r}: port {int(port)} is out of range (0-{MAX_PORT})")
    return host.strip("[]") if host.startswith("[") else host, int(port)


def host_port_setting(any_port: bool) -> Callable[[str], str]:
    """A settings ``parse`` for a HOST:PORT value (port 1-65535, or 0 as well where
    ``any_port``: a listen address taking any free port): the text, checked."""

    def parse(text: str) -> str:
        from mesh.errors import InvalidRequest

        try:
            _, port = split_host_port(text)
        except ValueError as error:
            raise InvalidRequest(
                f"{error}; write HOST:PORT, IPv6 hosts in brackets ([::1]:7070)"
            ) from None
        if port == 0 and not any_port:
            raise InvalidRequest(f"{text!r}: port 0 is not an address to dial; give its port")
        return text

    return parse


def coordinator_setting(text: str) -> str:
    """A settings ``parse`` for a stage's coordinator: HOST:PORT, or auto / auto:PORT
    (LAN discovery)."""
    if text == "auto" or (text.startswith("auto:") and text[5:].isdigit()):
        return text
    return host_port_setting(any_port=False)(text)


def is_wildcard(host: str) -> bool:
    return host in WILDCARDS


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def route_source(peer_host: str, peer_port: int = 9) -> str | None:
    """The local address the kernel would use to reach ``peer_host`` (a UDP socket
    is connected, which picks the route and sends nothing); None if there is none."""
    try:
        infos = socket.getaddrinfo(peer_host, peer_port, type=socket.SOCK_DGRAM)
    except OSError:
        return None
    for family, kind, proto, _, sockaddr in infos:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.connect(sockaddr)
                return str(probe.getsockname()[0])
        except OSError:
            continue
    return None


def _global_ipv4_listing() -> str:
    """``ip -o -4 addr show scope global``: one line per global IPv4 address ("" when
    ``ip`` is missing or fails)."""
    try:
        return subprocess.run(
            ["ip", "-o", "-4", "addr", "show", "scope", "global"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def host_addresses() -> list[str]:
    """Global (non-loopback) IPv4 addresses of this host's interfaces, in the order
    ``ip`` lists them; empty when none can be found."""
    out = _global_ipv4_listing()
    found = [line.split()[3].split("/")[0] for line in out.splitlines() if len(line.split()) > 3]
    if not found:
        try:
            found = [
                a for a in socket.gethostbyname_ex(socket.gethostname())[2] if not is_loopback(a)
            ]
        except OSError:
            found = []
    return found


def broadcast_addresses() -> list[str]:
    """The broadcast address of each IPv4 network this host is on (from each
    address's prefix; /31 and /32 networks have none), then the limited broadcast
    255.255.255.255."""
    out = _global_ipv4_listing()
    found: list[str] = []
    for line in out.splitlines():
        words = line.split()
        if "inet" not in words[:-1]:
            continue
        try:
            network = ipaddress.IPv4Interface(words[words.index("inet") + 1]).network
        except ValueError:
            continue
        if network.prefixlen <= 30 and str(network.broadcast_address) not in found:
            found.append(str(network.broadcast_address))
    return [*found, "255.255.255.255"]


def advertise_host(listen_host: str, advertise: str | None, coordinator: str | None = None) -> str:
    """The host part a node advertises (see the module docstring for the order)."""
    if advertise:
        return advertise
    if not is_wildcard(listen_host):
        return listen_host
    if coordinator:
        try:
            host, port = split_host_port(coordinator)
        except ValueError:
            host, port = "", 0
        if host and not is_loopback(host):
            source = route_source(host, port)
            if source and not is_loopback(source):
                return source
    addresses = host_addresses()
    if addresses:
        if len(addresses) > 1:
            logger.info(
                "advertising %s (this host also has %s); pass --advertise to choose",
                addresses[0],
                ", ".join(addresses[1:]),
            )
        return addresses[0]
    return "127.0.0.1"


def url_host(host: str) -> str:
    """A host as it goes into a URL or HOST:PORT (IPv6 in brackets)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def bind_problem(host: str, port: int) -> str | None:
    """Why a server could not bind ``host:port`` now (the OS's words), or None.
    Probed as servers bind (SO_REUSEADDR: a port in TIME_WAIT is free to them)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as error:
            return error.strerror or str(error)
    return None
