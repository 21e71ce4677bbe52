"""Checks of this host: ports free, the torch device present, memory, a writable
directory. Memory comes from /proc/meminfo, the cgroup limit and the process's
address-space limit (or os.sysconf), device memory from torch."""

from __future__ import annotations

import errno
import os
import resource
import shutil
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path

from mesh.doctor.results import CheckResult, failed, passed, warned
from mesh.netaddr import url_host
from mesh.units import format_bytes

CGROUP_MEMORY = Path("/sys/fs/cgroup")


# ---- ports ------------------------------------------------------------------------------


def check_port(host: str, port: int, flag: str) -> CheckResult:
    """Whether this process could listen on ``host:port`` now (``flag`` names the
    setting, for the message)."""
    name = "port"
    where = f"{url_host(host)}:{port}"
    if port == 0:
        return passed(name, f"{flag} {where}: any free port is taken at start")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as error:
            return _bind_failure(name, where, port, flag, error)
    return passed(name, f"{flag} {where} is free")


def check_udp_port(host: str, port: int, what: str) -> CheckResult:
    """Whether this process could receive UDP on ``host:port`` now; a WARN (not a
    FAIL) when it cannot: ``what`` goes without it."""
    name = "udp port"
    where = f"{url_host(host)}:{port}/udp"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind(("" if host in ("0.0.0.0", "::") else host, port))
        except OSError as error:
            return warned(
                name,
                f"{where} cannot be had ({error.strerror}): {what} will be off",
                "free that UDP port, or give the stages --coordinator HOST:PORT",
            )
    return passed(name, f"{where} is free ({what})")


def _bind_failure(name: str, where: str, port: int, flag: str, error: OSError) -> CheckResult:
    if error.errno == errno.EADDRINUSE:
        holder = listener_of(port)
        who = f" by {holder}" if holder else " by another process"
        return failed(
            name,
            f"{flag} {where} is in use{who}",
            f"stop that process or choose another {flag}",
        )
    if error.errno == errno.EADDRNOTAVAIL:
        return failed(
            name,
            f"{flag} {where}: the host is not an address of this machine",
            f"use one of this host's addresses in {flag}, or 0.0.0.0",
        )
    if error.errno == errno.EACCES:
        return failed(
            name,
            f"{flag} {where}: permission denied (ports below 1024 need privileges)",
            f"choose a port of 1024 or more in {flag}",
        )
    return failed(name, f"{flag} {where} cannot be bound: {error.strerror}", f"check {flag}")


def listener_of(port: int) -> str | None:
    """``pid 123 (python)`` of the process listening on TCP ``port``, when /proc
    tells (only processes this user may inspect); None otherwise."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            # local address "HEX_IP:HEX_PORT", state 0A is LISTEN
            if (
                len(fields) > 9
                and fields[3] == "0A"
                and int(fields[1].rsplit(":", 1)[1], 16) == port
            ):
                inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return None
    for pid_dir in Path("/proc").iterdir():
        if not pid_dir.name.isdigit():
            continue
        try:
            for fd in (pid_dir / "fd").iterdir():
                if os.readlink(fd) in inodes:
                    return f"pid {pid_dir.name} ({_command_of(pid_dir)})"
        except OSError:
            continue
    return None


def _command_of(pid_dir: Path) -> str:
    """A process's command as an operator knows it: a Python's script (or module) and
    its first argument, ``mesh-coordinator up`` (its ``comm`` is cut to 15
    characters: ``mesh-coordinato``); else the program's name."""
    comm = (pid_dir / "comm").read_text().strip()
    try:
        raw = (pid_dir / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return comm
    words = [a.decode(errors="replace") for a in raw if a]
    if not words:
        return comm
    if Path(words[0]).name.startswith("python") and len(words) > 1:
        args = words[1:]
        # Interpreter flags before the script or module (``python -P -m stage.cli``).
        while args and args[0].startswith("-") and args[0] != "-m":
            args = args[1:]
        if args and args[0] == "-m":
            rest = args[1:]
        else:
            rest = [Path(args[0]).name, *args[1:]] if args else []
        return " ".join(rest[:2]) or comm
    return Path(words[0]).name


# ---- memory -----------------------------------------------------------------------------


@dataclass(frozen=True)
class HostMemory:
    total_bytes: int
    available_bytes: int
    source: str


def host_memory() -> HostMemory:
    """RAM of this host (or of its cgroup, when that limit is lower): total and
    available now."""
    total = available = 0
    source = "/proc/meminfo"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("MemTotal", "MemAvailable"):
                amount = int(value.split()[0]) * 1024
                total, available = (amount, available) if key == "MemTotal" else (total, amount)
    except (OSError, ValueError, IndexError):
        page = os.sysconf("SC_PAGE_SIZE")
        total = os.sysconf("SC_PHYS_PAGES") * page
        available = os.sysconf("SC_AVPHYS_PAGES") * page
        source = "sysconf"
    limit, used = _cgroup_limit()
    if limit is not None and limit < total:
        total, available = limit, min(available, max(0, limit - (used or 0)))
        source = "cgroup memory.max"
    limit, used = _address_space_limit()
    if limit is not None and max(0, limit - used) < available:
        # ``ulimit -v`` (a service's LimitAS=): allocations past it fail whatever the
        # host has free, so it bounds what this process can offer.
        total, available = min(total, limit), max(0, limit - used)
        source = "the process's address-space limit (ulimit -v)"
    return HostMemory(total, available, source)


def _address_space_limit() -> tuple[int | None, int]:
    """This process's soft RLIMIT_AS and the address space it maps now (VmSize);
    (None, 0) without a limit."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None, 0
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmSize:"):
                return soft, int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return soft, 0


def _cgroup_limit() -> tuple[int | None, int | None]:
    try:
        text = (CGROUP_MEMORY / "memory.max").read_text().strip()
        used = int((CGROUP_MEMORY / "memory.current").read_text().strip())
    except (OSError, ValueError):
        return None, None
    return (None if text == "max" else int(text)), used


def device_memory(device: str) -> HostMemory | None:
    """Memory of a torch device: the host's RAM for ``cpu``, free and total device
    memory for ``cuda:N``; None for a device this host does not have (or of a kind
    not measured here)."""
    import torch

    try:
        parsed = torch.device(device)
    except RuntimeError:
        return None
    if parsed.type == "cpu":
        return host_memory()
    if parsed.type == "cuda" and (parsed.index or 0) < _cuda_count():
        free, total = torch.cuda.mem_get_info(parsed.index or 0)
        return HostMemory(total, free, f"torch.cuda.mem_get_info({device})")
    return None


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# ---- devices ----------------------------------------------------------------------------


def check_device(device: str, flag: str = "--device") -> CheckResult:
    """The torch device named by ``flag`` exists here."""
    import torch

    name = f"device {device}"
    try:
        parsed = torch.device(device)
    except RuntimeError as error:
        return failed(name, f"{flag} {device} is not a torch device ({error})", "use cpu or cuda:N")
    if parsed.type == "cpu":
        memory = host_memory()
        usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        cores = os.cpu_count() or 0
        shown = f"{cores} cores" + (f" ({usable} usable)" if usable and usable != cores else "")
        return passed(
            name,
            f"cpu: {shown}, {format_bytes(memory.total_bytes)} RAM "
            f"({format_bytes(memory.available_bytes)} available)",
        )
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            build = torch.version.cuda or "none"
            return failed(
                name,
                f"{flag} {device}: torch sees no CUDA device (torch {torch.__version__}, "
                f"CUDA build {build})",
                "run on a host with an NVIDIA GPU and a CUDA build of torch, or use --device cpu",
            )
        count = torch.cuda.device_count()
        index = parsed.index or 0
        if index >= count:
            return failed(
                name,
                f"{flag} {device}: this host has {count} CUDA device(s)",
                f"use one of cuda:0 .. cuda:{count - 1}",
            )
        props = torch.cuda.get_device_properties(index)
        free, total = torch.cuda.mem_get_info(index)
        return passed(
            name,
            f"{props.name}: {format_bytes(total)} ({format_bytes(free)} free)",
        )
    if parsed.type == "mps":
        if torch.backends.mps.is_available():
            return passed(name, "Apple MPS is available")
        return failed(name, f"{flag} mps: torch sees no MPS device", "use --device cpu")
    return warned(
        name,
        f"{flag} {device}: the doctor does not check {parsed.type} devices",
        "check it by hand",
    )


def check_quantised_kernels(device: str, mode: str) -> CheckResult:
    """Whether int4/int8 linears will run on the stage's own CPU kernels
    (``--quantised-kernel``), building them now if they are not cached."""
    from mesh.runtime import native

    name = "quantised kernels"
    if mode == "torch" or not device.startswith("cpu"):
        return passed(
            name, f"torch's kernels ({'--quantised-kernel torch' if mode == 'torch' else device})"
        )
    try:
        native.check_cpu()
        path = native.build()
    except native.KernelUnavailable as error:
        fix = (
            "install a C compiler (gcc or clang) on an AVX-512 VNNI CPU, or set "
            "--quantised-kernel torch"
        )
        if mode == "native":
            return failed(name, f"--quantised-kernel native: {error}", fix)
        return warned(
            name,
            f"int4/int8 packages will run on torch's kernels (slower with many rows): {error}",
            fix,
        )
    return passed(name, f"native VNNI kernels ({path})")


# ---- directories ------------------------------------------------------------------------


def check_writable(directory: Path, flag: str, need_bytes: int = 0) -> CheckResult:
    """``directory`` (or, when it does not exist yet, the parent it would be made in)
    takes a file; WARN when its file system has less than ``need_bytes`` free."""
    name = "cache dir"
    directory = Path(directory).expanduser()
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return failed(name, f"{flag} {directory}: {existing} is not a directory", f"fix {flag}")
    try:
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".mesh-doctor-"):
            pass
    except OSError as error:
        return failed(
            name,
            f"{flag} {directory}: cannot write in {existing} ({error.strerror})",
            f"give this user write access there or choose another {flag}",
        )
    free = shutil.disk_usage(existing).free
    made = "" if existing == directory else f" (to be created in {existing})"
    if need_bytes and free < need_bytes:
        return warned(
            name,
            f"{directory}{made} is writable but its file system has {format_bytes(free)} free, "
            f"less than the {format_bytes(need_bytes)} the package takes",
            "free disk space or choose another " + flag,
        )
    return passed(name, f"{directory}{made} is writable, {format_bytes(free)} free")
