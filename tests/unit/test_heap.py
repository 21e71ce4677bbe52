"""Freed memory handed back to the system once a stage is idle (mesh/heap.py)."""

from __future__ import annotations

import subprocess
import sys
import time

from mesh import heap
from mesh.heap import HeapTrimmer


def test_the_heap_is_trimmed_once_after_work_and_only_when_idle(monkeypatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(heap, "trim_heap", lambda: calls.append(1) or True)
    trimmer = HeapTrimmer(idle_s=0.2)
    assert not trimmer.maybe_trim()  # no work yet
    trimmer.worked()
    assert not trimmer.maybe_trim()  # work just now
    time.sleep(0.3)
    assert trimmer.maybe_trim() and calls == [1]
    assert not trimmer.maybe_trim()  # nothing since
    trimmer.worked()
    time.sleep(0.3)
    assert trimmer.maybe_trim() and calls == [1, 1]


def test_trimming_returns_freed_memory_to_the_system() -> None:
    """Many small blocks freed (as a model's tensors and a prompt's activations leave
    them) stay in the process until the heap is trimmed; this runs in a process of its
    own so the suite's heap does not blur the figures."""
    script = """
import gc
from mesh.heap import trim_heap
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
blocks = [bytearray(100_000) for _ in range(4000)]  # below the mmap threshold
del blocks[::2]  # holes between blocks still in use: free() cannot give them back
gc.collect()
before = rss()
trim_heap()
print(before - rss())
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    assert int(done.stdout) > 100 * 2**20  # of the 200 MB freed
