"""What a node says of itself and the terms it takes are bounded: a forged or
corrupt Join, Heartbeat or Claim is refused (INVALID_ARGUMENT over gRPC) before it
can fence a stage off with a term no coordinator could go above, or put an address
nobody can dial into a plan; undecodable bytes on a framed TCP link are refused
with one log line."""

from __future__ import annotations

import logging
import math

import pytest

from mesh.codec import ClaimRequest, JoinRequest
from mesh.codec_coordinator import check_join
from mesh.errors import InvalidRequest
from mesh.types import MAX_TERM, check_term
from stage.node import NodeSettings, StageNode
from stage.servicers import DataServicer

GOOD = dict(node_id="gpu-box-1", address="10.0.0.2:7071", device="cuda:0", memory_bytes=24 << 30)


def test_a_sound_join_passes() -> None:
    assert check_join(JoinRequest(**GOOD, term=MAX_TERM)).node_id == "gpu-box-1"
    assert check_join(JoinRequest(**{**GOOD, "address": "[fd00::2]:7071"})).address


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"node_id": ""}, "node_id"),
        ({"node_id": "x" * 300}, "node_id"),
        ({"node_id": "two words"}, "node_id"),
        ({"address": "not an address"}, "address"),
        ({"address": "127.0.0.1:0"}, "address"),
        ({"address": "127.0.0.1:70000"}, "address"),
        ({"device": "d" * 2000}, "device"),
        ({"speed_hint": math.nan}, "speed_hint"),
        ({"speed_hint": -math.inf}, "speed_hint"),
        ({"memory_bytes": 2**64 - 1}, "memory_bytes"),
        ({"term": 2**64 - 1}, "term"),
    ],
)
def test_a_join_that_cannot_be_planned_with_is_refused_naming_the_field(
    change: dict, field: str
) -> None:
    with pytest.raises(InvalidRequest, match=field):
        check_join(JoinRequest(**{**GOOD, **change}))


def test_terms_beyond_the_bound_are_refused() -> None:
    assert check_term(MAX_TERM, "Claim") == MAX_TERM
    with pytest.raises(InvalidRequest, match="2\\^52"):
        check_term(MAX_TERM + 1, "Claim")


def test_a_stage_refuses_a_claim_beyond_the_bound_and_keeps_its_term(tmp_path) -> None:
    node = StageNode(NodeSettings(node_id="n", cache_dir=tmp_path), "127.0.0.1:1")
    try:
        node.claim(ClaimRequest(3, "coord", "m"))
        with pytest.raises(InvalidRequest, match="term"):
            node.claim(ClaimRequest(2**64 - 1, "forger", "m"))
        assert node.term == 3 and node.coordinator_id == "coord"
    finally:
        node.stop()


def test_undecodable_bytes_on_a_framed_link_are_refused_with_one_line(
    tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    node = StageNode(NodeSettings(node_id="n", cache_dir=tmp_path), "127.0.0.1:1")
    seen: list = []
    try:
        servicer = DataServicer(node, seen.append)
        with caplog.at_level(logging.WARNING):
            servicer.result_bytes(b"\xff" * 5)
            servicer.frame_bytes(b"\xff" * 5)
        assert seen == []
        assert "undecodable result over framed TCP refused" in caplog.text
        assert "undecodable frame over framed TCP refused" in caplog.text
    finally:
        node.stop()
