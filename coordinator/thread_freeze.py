"""Freeze chosen threads of a live process, for fault injection: the process and its
other threads (heartbeats, gRPC) run on, as when a device call or a lock hangs one
thread, or a reader never returns.

Each thread is stopped with ``ptrace`` (``PTRACE_SEIZE`` + ``PTRACE_INTERRUPT``:
only that thread stops, not its process) at a moment it is blocked in a system call,
so that it cannot be holding Python's GIL (which would freeze every thread of the
process, a fault ``SIGSTOP`` already covers); a thread caught running is let go and
tried again a millisecond later. Needs the right to trace the process (root, or
``CAP_SYS_PTRACE``); Linux only. The calling thread must also be the one that
releases them (ptrace ties a tracee to its tracer thread).
"""

from __future__ import annotations

import ctypes
import os
import time
from pathlib import Path

PTRACE_SEIZE = 0x4206
PTRACE_INTERRUPT = 0x4207
PTRACE_DETACH = 17
WALL = 0x40000000  # waitpid's __WALL: wait for any thread, not only children
CATCH_ATTEMPTS = 5000


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    libc.ptrace.restype = ctypes.c_long
    return libc


def threads_named(pid: int, names: tuple[str, ...]) -> list[int]:
    """Thread ids of ``pid`` whose kernel name is one of ``names`` (the mesh's threads
    carry their Python names there: ``mesh.threads.NamedThread``)."""
    found = []
    for task in sorted(Path(f"/proc/{pid}/task").iterdir()):
        try:
            if (task / "comm").read_text().strip() in names:
                found.append(int(task.name))
        except OSError:  # the thread ended meanwhile
            continue
    return found


class FrozenThreads:
    """``with FrozenThreads(pid, tids):`` the threads stay stopped inside the block."""

    def __init__(self, pid: int, tids: list[int]) -> None:
        self.pid = pid
        self.tids = tids
        self._libc = _libc()
        self._held: list[int] = []

    def __enter__(self) -> FrozenThreads:
        try:
            for tid in self.tids:
                self._freeze(tid)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _freeze(self, tid: int) -> None:
        libc = self._libc
        for _ in range(CATCH_ATTEMPTS):
            if libc.ptrace(PTRACE_SEIZE, tid, None, None) != 0:
                error = ctypes.get_errno()
                raise OSError(
                    error, f"cannot trace thread {tid} of {self.pid}: {os.strerror(error)}"
                )
            libc.ptrace(PTRACE_INTERRUPT, tid, None, None)
            os.waitpid(tid, WALL)
            where = Path(f"/proc/{self.pid}/task/{tid}/syscall").read_text().split()[0]
            if where != "running":  # blocked in the kernel: the GIL is free
                self._held.append(tid)
                return
            libc.ptrace(PTRACE_DETACH, tid, None, None)
            time.sleep(0.001)
        raise RuntimeError(f"thread {tid} of {self.pid} was never caught in a system call")

    def __exit__(self, *exc: object) -> None:
        for tid in self._held:
            self._libc.ptrace(PTRACE_DETACH, tid, None, 0)
        self._held.clear()
