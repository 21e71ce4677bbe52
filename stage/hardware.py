"""What a stage node tells the coordinator about its hardware: the memory it offers
(stated with ``--memory``, or measured on its device) and how long its recent frames
took (the mean compute time per frame, for the coordinator's rebalance)."""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from mesh.errors import InvalidRequest

logger = logging.getLogger(__name__)

MEMINFO = Path("/proc/meminfo")
STEP_WINDOW_FRAMES = 64
GIB = float(1 << 30)


@dataclass(frozen=True)
class OfferedMemory:
    """Bytes offered for weights and KV; ``source`` is "stated" or "measured"
    (``bytes_total`` 0 with source "" when nothing could be measured)."""

    bytes_total: int
    source: str
    detail: str = ""


def offered_memory(device: str, stated: int, margin: int, meminfo: Path = MEMINFO) -> OfferedMemory:
    """``stated`` when given (> 0); else free memory of a CUDA device, or the host's
    available RAM less ``margin`` on a CPU. Refuses a host whose available RAM the
    margin leaves empty."""
    if stated > 0:
        return OfferedMemory(stated, "stated", "--memory")
    if device.startswith("cuda"):
        import torch

        free, _total = torch.cuda.mem_get_info(torch.device(device))
        return OfferedMemory(int(free), "measured", f"free memory of {device}")
    available = _mem_available(meminfo)
    if available is None:
        logger.warning(
            "cannot read MemAvailable from %s: offering unknown memory (give --memory)", meminfo
        )
        return OfferedMemory(0, "")
    offered = available - margin
    if offered <= 0:
        raise InvalidRequest(
            f"this host has {available / GIB:.2f} GiB of RAM available and the memory margin "
            f"is {margin / GIB:.2f} GiB: nothing is left to offer; lower --memory-margin or "
            "state the memory with --memory"
        )
    detail = f"available RAM {available / GIB:.2f} GiB less a {margin / GIB:.2f} GiB margin"
    return OfferedMemory(offered, "measured", detail)


def _mem_available(meminfo: Path) -> int | None:
    try:
        lines = meminfo.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        name, _, value = line.partition(":")
        if name == "MemAvailable":
            parts = value.split()
            if parts and parts[0].isdigit():
                scale = 1024 if len(parts) > 1 and parts[1].lower() == "kb" else 1
                return int(parts[0]) * scale
    return None


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
