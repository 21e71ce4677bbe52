"""Freed memory back to the operating system.

glibc's allocator keeps the memory a process frees in its heaps for later use: after
a long prompt's activations, or after a stage released one slice of layers and
loaded another, the memory is free inside the process but still counted in its
resident size, and a host (or a cgroup limit) sees it as taken. ``malloc_trim``
hands the free pages back. It holds the allocator's locks while it walks the heaps,
so ``HeapTrimmer`` runs it only once the process has been idle for a while after
work that may have left free memory behind. Elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
import time

logger = logging.getLogger(__name__)

# Seconds without work before the heap is trimmed.
IDLE_BEFORE_TRIM_S = 3.0


def _malloc_trim() -> ctypes._CFuncPtr | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


_TRIM = _malloc_trim()


def trim_heap() -> bool:
    """Give the allocator's free memory back to the system; whether any was (False
    where the C library has no ``malloc_trim``)."""
    return bool(_TRIM(0)) if _TRIM is not None else False


class HeapTrimmer:
    """Trims the heap once, after work, when ``IDLE_BEFORE_TRIM_S`` have passed with no
    more: ``worked`` after each piece of work (cheap), ``maybe_trim`` from a periodic
    thread."""

    def __init__(self, idle_s: float = IDLE_BEFORE_TRIM_S) -> None:
        self.idle_s = idle_s
        self._last_work = 0.0
        self._dirty = False
        self._lock = threading.Lock()
        self.trims = 0

    def worked(self) -> None:
        self._last_work = time.monotonic()
        self._dirty = True

    def maybe_trim(self) -> bool:
        """Trim when there was work since the last trim and none for ``idle_s``;
        whether it trimmed."""
        if not self._dirty or time.monotonic() - self._last_work < self.idle_s:
            return False
        with self._lock:
            if not self._dirty:
                return False
            self._dirty = False
            started = time.perf_counter()
            released = trim_heap()
            self.trims += 1
        logger.debug(
            "heap trimmed in %.1f ms (%s)",
            (time.perf_counter() - started) * 1000.0,
            "memory returned" if released else "nothing to return",
        )
        return True
