"""Garbage collection pauses measured by generation; objects alive after a load
frozen out of the collector's way, and given back to it on release."""

from __future__ import annotations

import gc

from prometheus_client import CollectorRegistry

from mesh.gcpause import GcPauses, settle, thaw


def samples(registry: CollectorRegistry, name: str) -> dict[str, float]:
    return {
        sample.labels.get("generation", ""): sample.value
        for metric in registry.collect()
        for sample in metric.samples
        if sample.name == name
    }


def test_every_collection_is_timed_by_its_generation() -> None:
    registry = CollectorRegistry()
    pauses = GcPauses(registry).install()
    try:
        before = samples(registry, "mesh_gc_pause_seconds_count")
        gc.collect(0)
        gc.collect(2)
        gc.collect(2)
        after = samples(registry, "mesh_gc_pause_seconds_count")
        assert after["0"] - before.get("0", 0) >= 1
        assert after["2"] - before.get("2", 0) >= 2
        assert samples(registry, "mesh_gc_pause_seconds_sum")["2"] > 0
    finally:
        pauses.remove()
    assert pauses not in gc.callbacks
    gc.collect(2)
    assert samples(registry, "mesh_gc_pause_seconds_count")["2"] == after["2"]


def test_settle_freezes_what_is_alive_and_thaw_gives_it_back() -> None:
    class Cycle:
        def __init__(self) -> None:
            self.me = self

    kept = [Cycle() for _ in range(100)]
    try:
        settle("a test")
        assert gc.get_freeze_count() >= len(kept)
        # A cycle made after the freeze is collected as usual.
        Cycle()
        assert gc.collect() >= 1
    finally:
        thaw()
    assert gc.get_freeze_count() == 0
    # Frozen cycles that became garbage are freed once given back.
    del kept
    assert gc.collect() >= 100
