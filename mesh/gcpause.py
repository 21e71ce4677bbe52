"""Garbage collection in a serving process: its pauses measured, its loaded objects
frozen out of the collector's way.

CPython's cyclic collector examines every tracked object of the generations it
collects, and a stage process holds a few hundred thousand long-lived ones once it
has loaded (torch's and transformers' modules, the model's wrappers, the tokenizer,
the grammar compiler, stage 0's HTTP app). A full collection of such a process
takes 170 ms on the 2-core development VM (a stage 0 with SmolLM2 loaded), and
while it runs the process's frame worker, links and event loop all stand still:
every stream served through that stage pauses. Full collections come when the
objects that survived into the oldest generation since the last one exceed a
quarter of it, so they keep coming while requests leave objects behind.

``settle()`` (after a stage has loaded) collects once and freezes what is alive
(``gc.freeze``: moved to a permanent generation that collections skip), so later
collections examine only what serving creates. ``thaw()`` (before a stage releases
or replaces what it loaded) puts the frozen objects back under the collector, so
that reference cycles among a released runtime's objects are freed.

``GcPauses`` observes every collection's duration, by generation, into the
``mesh_gc_pause_seconds`` histogram of a registry (a process's stage metrics).
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from typing import Any

from prometheus_client import CollectorRegistry, Histogram

logger = logging.getLogger(__name__)

GC_PAUSE_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class GcPauses:
    """A ``gc.callbacks`` entry that times each collection into a histogram.

    Collections run under the GIL, one at a time, whichever thread triggered them,
    so one start time is enough."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.histogram = Histogram(
            "mesh_gc_pause_seconds",
            "Time this process spent in each garbage collection, by generation (2: a "
            "full collection); every thread of the process waits for it.",
            ("generation",),
            registry=registry,
            buckets=GC_PAUSE_BUCKETS_S,
        )
        self._by_generation = [self.histogram.labels(generation=str(g)) for g in range(3)]
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        generation = int(info.get("generation", 2))
        if 0 <= generation < 3 and self._started:
            self._by_generation[generation].observe(time.perf_counter() - self._started)
        self._started = 0.0

    def install(self) -> GcPauses:
        if self not in gc.callbacks:
            gc.callbacks.append(self)
        return self

    def remove(self) -> None:
        if self in gc.callbacks:
            gc.callbacks.remove(self)


_freeze_lock = threading.Lock()


def settle(reason: str) -> float:
    """Collect once, then freeze every object alive: later collections skip them.
    Returns the seconds it took (the collection)."""
    with _freeze_lock:
        started = time.perf_counter()
        gc.collect()
        gc.freeze()
        took = time.perf_counter() - started
    logger.info(
        "froze %d objects out of the garbage collector's way after %s (%.0f ms)",
        gc.get_freeze_count(),
        reason,
        took * 1000.0,
    )
    return took


def thaw() -> None:
    """Put frozen objects back under the collector (before releasing what a load
    made, so that its cycles can be freed)."""
    with _freeze_lock:
        gc.unfreeze()
