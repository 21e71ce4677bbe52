"""What a stage node tells the coordinator about its hardware: the memory it offers
(stated with ``--memory``, or measured on its device) and how long its recent frames
took (the mean compute time per frame, for the coordinator's rebalance)."""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass

from mesh.errors import InvalidRequest

logger = logging.getLogger(__name__)

STEP_WINDOW_FRAMES = 128
GIB = float(1 << 30)


@dataclass(frozen=True)
class OfferedMemory:
    """Bytes offered for weights and KV; ``source`` is "stated" or "measured"
    (``bytes_total`` 0 with source "" when nothing could be measured)."""

    bytes_total: int
    source: str
    detail: str = ""


def offered_memory(device: str, stated: int, margin: int) -> OfferedMemory:
    """``stated`` when given (> 0); else the free memory of a CUDA device, or on a CPU
    the available RAM (of the host, or of its cgroup when that is lower) less
    ``margin``. Refuses a host whose available RAM the margin leaves empty."""
    if stated > 0:
        return OfferedMemory(stated, "stated", "--memory")
    from mesh.doctor.host import device_memory

    memory = device_memory(device)
    if memory is None:
        logger.warning("cannot measure the memory of %s: offering unknown memory", device)
        return OfferedMemory(0, "")
    if not device.startswith("cpu"):
        return OfferedMemory(memory.available_bytes, "measured", f"free memory ({memory.source})")
    available = memory.available_bytes
    offered = available - margin
    if offered <= 0:
        raise InvalidRequest(
            f"this host has {available / GIB:.2f} GiB of RAM available and the memory margin "
            f"is {margin / GIB:.2f} GiB: nothing is left to offer; lower --memory-margin or "
            "state the memory with --memory"
        )
    detail = (
        f"available RAM {available / GIB:.2f} GiB ({memory.source}) less a "
        f"{margin / GIB:.2f} GiB margin"
    )
    return OfferedMemory(offered, "measured", detail)


class RecentSteps:
    """Compute time of the stage's last frames (ms each); thread-safe."""

    def __init__(self, frames: int = STEP_WINDOW_FRAMES) -> None:
        self._times: deque[float] = deque(maxlen=frames)
        self._lock = threading.Lock()

    def observe(self, ms: float) -> None:
        with self._lock:
            self._times.append(ms)

    def clear(self) -> None:
        with self._lock:
            self._times.clear()

    def mean(self) -> tuple[float, int]:
        """(mean ms per frame, frames it covers); (0.0, 0) before any frame."""
        with self._lock:
            count = len(self._times)
            return (sum(self._times) / count if count else 0.0), count
