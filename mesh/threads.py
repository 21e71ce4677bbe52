"""Threads whose operating-system name is their Python name.

Python before 3.14 leaves every thread of a process named after the executable in
the kernel (``/proc/PID/task/TID/comm``), so ``top -H``, ``ps -L`` and ``perf`` cannot
tell a stage's frame worker from its link readers. ``NamedThread`` sets the kernel's
name (the first 15 bytes, Linux only) when the thread starts; elsewhere it is a
plain ``threading.Thread``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import threading

# prctl(2) option that names the calling thread.
PR_SET_NAME = 15
# The kernel keeps 15 bytes of a thread's name and a terminating zero.
NAME_BYTES = 15


def _prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        return libc.prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _prctl()


def name_this_thread(name: str) -> None:
    """Give the calling thread ``name`` in the kernel (cut to 15 bytes); a no-op
    where that cannot be done."""
    if _PRCTL is None:
        return
    raw = name.encode("utf-8", "replace")[:NAME_BYTES]
    _PRCTL(PR_SET_NAME, ctypes.c_char_p(raw), 0, 0, 0)


class NamedThread(threading.Thread):
    """A ``threading.Thread`` that names its kernel thread after ``self.name``."""

    def run(self) -> None:
        name_this_thread(self.name)
        super().run()
