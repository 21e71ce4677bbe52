"""Processes that must not outlive the process that started them.

`mesh-coordinator up` starts its local stages with ``MESH_PARENT_PID`` set to its
own pid. Such a stage watches its parent: once the parent is gone (however it died,
SIGKILL included, the child is re-parented and ``os.getppid()`` changes) the stage
stops on its own instead of running on as an orphan.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)

PARENT_PID_ENV = "MESH_PARENT_PID"
POLL_S = 0.5


def watch_parent(on_gone: Callable[[], None], poll_s: float = POLL_S) -> bool:
    """Call ``on_gone`` once when the process named by MESH_PARENT_PID is no longer
    this process's parent. Returns False (and watches nothing) when it is not set."""
    value = os.environ.get(PARENT_PID_ENV, "")
    if not value.isdigit():
        return False
    parent = int(value)

    def watch() -> None:
        stop = threading.Event()
        while os.getppid() == parent:
            stop.wait(poll_s)
        logger.warning("parent process %s is gone: stopping", parent)
        on_gone()

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
    return True
