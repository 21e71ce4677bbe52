"""Stage threads carry their Python names in the kernel (``top -H``, ``ps -L``, the
chaos tools' thread freezes find them by it)."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

from mesh.threads import NamedThread

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc is Linux's")


def kernel_name(native_id: int) -> str:
    return Path(f"/proc/self/task/{native_id}/comm").read_text().strip()


def test_a_named_thread_has_its_name_in_the_kernel_cut_to_15_bytes() -> None:
    seen: dict[str, str] = {}
    done = threading.Event()

    def look() -> None:
        seen[threading.current_thread().name] = kernel_name(threading.get_native_id())
        done.set()

    for name in ("stage-worker", "a-much-longer-thread-name"):
        done.clear()
        thread = NamedThread(target=look, name=name, daemon=True)
        thread.start()
        thread.join(timeout=10)
    assert seen == {"stage-worker": "stage-worker", "a-much-longer-thread-name": "a-much-longer-t"}
    if sys.version_info < (3, 14):
        # A plain thread keeps the process's name here: what NamedThread is for.
        plain = threading.Thread(target=look, name="plain-thread")
        plain.start()
        plain.join(timeout=10)
        assert seen["plain-thread"] != "plain-thread"
