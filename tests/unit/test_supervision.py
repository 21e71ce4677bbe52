"""The coordinator's supervision thread outlives an exception in one pass: before,
one unexpected error ended it silently, and no stage was ever found dead (or
stalled) again, no load retried."""

from __future__ import annotations

import time

import pytest

from coordinator.driver import LoadSettings
from coordinator.model import read_model
from coordinator.server import CoordinatorService, CoordinatorSettings
from mesh.codec import HeartbeatRequest, JoinRequest


def test_supervision_goes_on_after_a_pass_raises(
    tiny_package_factory, caplog: pytest.LogCaptureFixture
) -> None:
    package = tiny_package_factory("llama", layers=2)
    model = read_model(str(package))
    settings = CoordinatorSettings(
        load=LoadSettings(str(package), model.manifest.sha256(), model.manifest.model_id),
        heartbeat_timeout_s=0.5,
        supervise_interval_s=0.05,
        min_stages=2,  # one node never loads: only the heartbeat checks run
    )
    service = CoordinatorService(model, settings)
    passes = {"n": 0}
    real = service._should_load

    def flaky(state):
        passes["n"] += 1
        if passes["n"] <= 3:
            raise RuntimeError("an unexpected error in one pass")
        return real(state)

    service._should_load = flaky
    service.start()
    try:
        service.join(JoinRequest(node_id="w", address="127.0.0.1:1", device="cpu", memory_bytes=1))
        service.heartbeat(HeartbeatRequest(node_id="w", term=0, state="idle"))
        deadline = time.monotonic() + 10
        while service.state.node("w").health != "dead":
            assert time.monotonic() < deadline, (passes, service.state.node("w"))
            time.sleep(0.05)
        assert passes["n"] > 3
        assert "supervision pass failed" in caplog.text
    finally:
        service.stop()
