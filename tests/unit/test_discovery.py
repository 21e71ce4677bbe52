"""LAN discovery (mesh/discovery.py): the answer and its check, real UDP sockets on
loopback addresses (the broadcast itself runs across hosts in
tests/integration/test_multihost.py)."""

from __future__ import annotations

import json
import socket

import pytest

from mesh.discovery import (
    DiscoveryResponder,
    answer_for,
    discover,
    find_coordinator,
    parse_auto,
    read_answer,
)
from mesh.errors import InvalidRequest

NONCE = "ab" * 16


def _query(nonce: str = NONCE) -> bytes:
    return json.dumps({"kind": "mesh-discover", "v": 1, "nonce": nonce}).encode()


def _free_udp_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def test_an_answer_is_read_back_with_the_address_to_join() -> None:
    answer = answer_for(_query(), 7070, "SmolLM2", "", tls=False, token=None)
    offer = read_answer(answer, "10.0.0.5", NONCE, token=None)
    assert offer is not None and offer.address == "10.0.0.5:7070"
    assert (offer.model_id, offer.tls, offer.token) == ("SmolLM2", False, False)
    # An advertised host (a TLS certificate's name) wins over the packet's source.
    answer = answer_for(_query(), 7070, "m", "head.lan", tls=True, token=None)
    assert read_answer(answer, "10.0.0.5", NONCE, None).address == "head.lan:7070"


def test_with_a_token_only_a_coordinator_that_knows_it_is_joined() -> None:
    answer = answer_for(_query(), 7070, "m", "", tls=False, token="s3cret")
    assert read_answer(answer, "10.0.0.5", NONCE, token="s3cret") is not None
    # Another token, or none where one is needed: not this mesh.
    assert read_answer(answer, "10.0.0.5", NONCE, token="other") is None
    assert read_answer(answer, "10.0.0.5", NONCE, token=None) is None
    # A tokenless answer (a host answering in the coordinator's place) never gets a
    # stage that holds a token.
    bare = answer_for(_query(), 7070, "m", "", tls=False, token=None)
    assert read_answer(bare, "10.0.0.5", NONCE, token="s3cret") is None
    # A forged answer: the fields changed after the MAC.
    forged = json.loads(answer)
    forged["host"] = "10.6.6.6"
    assert read_answer(json.dumps(forged).encode(), "10.0.0.5", NONCE, "s3cret") is None


@pytest.mark.parametrize(
    "datagram",
    [
        b"", b"\xff\xfe", b"[]", b"{}", b'{"kind": "mesh-discover", "v": 2, "nonce": "' + b"a" * 32
        + b'"}', b'{"kind": "mesh-discover", "v": 1, "nonce": "short"}',
        b'{"kind": "mesh-discover", "v": 1, "nonce": 5}', b"[" * 60000, b'{"a":' * 20000,
    ],
)  # fmt: skip
def test_anything_but_a_query_gets_no_answer(datagram) -> None:
    assert answer_for(datagram, 7070, "m", "", tls=False, token=None) is None


def test_an_answer_to_another_query_is_ignored() -> None:
    answer = answer_for(_query("cd" * 16), 7070, "m", "", tls=False, token=None)
    assert read_answer(answer, "10.0.0.5", NONCE, None) is None
    assert read_answer(b"not json", "10.0.0.5", NONCE, None) is None


def test_parse_auto() -> None:
    assert parse_auto("auto") == 7070 and parse_auto("auto:7171") == 7171
    assert parse_auto("10.0.0.1:7070") is None
    for bad in ("auto:", "auto:x", "auto:70000"):
        with pytest.raises(InvalidRequest):
            parse_auto(bad)


def test_a_responder_answers_over_udp_and_several_are_listed() -> None:
    port = _free_udp_port("127.0.0.2")
    first = DiscoveryResponder("127.0.0.2", port, lambda: "model-a", "", False, None)
    second = DiscoveryResponder("127.0.0.3", port, lambda: "model-b", "", False, None)
    assert first.start() and second.start()
    try:
        offers = discover(port, None, 1.0, targets=["127.0.0.2"])
        assert [(o.address, o.model_id) for o in offers] == [(f"127.0.0.2:{port}", "model-a")]
        assert find_coordinator(port, None, 2.0, targets=["127.0.0.2"]).model_id == "model-a"
        with pytest.raises(InvalidRequest, match="several coordinators answered") as raised:
            find_coordinator(port, None, 2.0, targets=["127.0.0.2", "127.0.0.3"])
        assert "model-a" in str(raised.value) and "model-b" in str(raised.value)
        # The port is taken: a second responder there reports it and does not start.
        assert not DiscoveryResponder("127.0.0.2", port, lambda: "x", "", False, None).start()
    finally:
        first.stop()
        second.stop()


def test_one_coordinator_answering_on_two_networks_is_one_offer() -> None:
    port = _free_udp_port("127.0.0.2")
    same = [
        DiscoveryResponder(host, port, lambda: "m", "", False, None, "coord-1")
        for host in ("127.0.0.2", "127.0.0.3")
    ]
    assert all(responder.start() for responder in same)
    try:
        offer = find_coordinator(port, None, 2.0, targets=["127.0.0.2", "127.0.0.3"])
        assert offer.coordinator_id == "coord-1"
    finally:
        for responder in same:
            responder.stop()


def test_nobody_answering_is_an_error_that_says_what_to_do() -> None:
    port = _free_udp_port()
    with pytest.raises(InvalidRequest, match="no coordinator answered") as raised:
        find_coordinator(port, None, 0.5, targets=["127.0.0.1"], round_s=0.2)
    assert "--coordinator HOST:PORT" in str(raised.value)


def test_a_hostile_datagram_does_not_silence_the_responder() -> None:
    """Garbage on the discovery port (JSON nested deeper than the parser's stack, not
    UTF-8) is dropped; the next query is answered (before, a deeply nested datagram
    ended the responder's thread: no stage could find the coordinator again)."""
    import socket

    port = _free_udp_port("127.0.0.2")
    responder = DiscoveryResponder("127.0.0.2", port, lambda: "model-a", "", False, None)
    assert responder.start()
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            for junk in (b"[" * 60000, b"\xff" * 100):
                sock.sendto(junk, ("127.0.0.2", port))
        offers = discover(port, None, 1.0, targets=["127.0.0.2"])
        assert [o.model_id for o in offers] == ["model-a"]
    finally:
        responder.stop()


def test_a_coordinator_with_another_token_is_named_not_called_absent(caplog) -> None:
    """A coordinator answers, but not with this node's token: the error says that (and
    the warning is logged once, not once a second)."""
    port = _free_udp_port("127.0.0.2")
    responder = DiscoveryResponder("127.0.0.2", port, lambda: "m", "", False, "right")
    assert responder.start()
    try:
        with caplog.at_level("WARNING"), pytest.raises(InvalidRequest) as raised:
            find_coordinator(port, "wrong", 1.0, targets=["127.0.0.2"], round_s=0.2)
    finally:
        responder.stop()
    message = str(raised.value)
    assert "127.0.0.2" in message and "join token" in message and "MESH_JOIN_TOKEN" in message
    assert caplog.text.count("ignoring a discovery answer") == 1
