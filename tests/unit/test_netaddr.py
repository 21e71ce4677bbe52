"""Which address a node advertises: never loopback towards other hosts."""

from __future__ import annotations

import pytest

from mesh import netaddr


def test_split_host_port_and_url_hosts() -> None:
    assert netaddr.split_host_port("10.0.0.1:7070") == ("10.0.0.1", 7070)
    assert netaddr.split_host_port("[::1]:7070") == ("::1", 7070)
    with pytest.raises(ValueError):
        netaddr.split_host_port("no-port")
    assert netaddr.url_host("::1") == "[::1]" and netaddr.url_host("head") == "head"
    assert netaddr.is_wildcard("0.0.0.0") and not netaddr.is_wildcard("127.0.0.1")
    assert netaddr.is_loopback("127.0.0.5") and netaddr.is_loopback("localhost")
    assert not netaddr.is_loopback("10.1.2.3")


def test_explicit_and_specific_addresses_win() -> None:
    assert netaddr.advertise_host("0.0.0.0", "worker-1.lan") == "worker-1.lan"
    assert netaddr.advertise_host("10.9.8.7", None, "10.0.0.1:7070") == "10.9.8.7"


def test_a_wildcard_listener_towards_a_loopback_coordinator_picks_a_host_address(
    monkeypatch,
) -> None:
    monkeypatch.setattr(netaddr, "host_addresses", lambda: ["10.5.0.2", "10.6.0.2"])
    assert netaddr.advertise_host("0.0.0.0", None, "127.0.0.1:7070") == "10.5.0.2"
    monkeypatch.setattr(netaddr, "host_addresses", lambda: [])
    assert netaddr.advertise_host("0.0.0.0", None, None) == "127.0.0.1"


def test_the_route_to_a_loopback_peer_starts_at_loopback() -> None:
    assert netaddr.route_source("127.0.0.1", 7070) == "127.0.0.1"
