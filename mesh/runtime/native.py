"""The stage's own CPU kernels (``kernels/qmatmul.c``, ``kernels/attend.c``): built
with the system's C compiler on first use, kept in a cache directory, loaded with ctypes.

They need x86-64 with AVX-512 VNNI (Intel Ice Lake / Sapphire Rapids and later,
AMD Zen 4 and later), and a C compiler (``$CC``, ``cc``, ``gcc`` or ``clang``) the
first time. Where either is missing, ``library()`` says why once and returns
``None``, and the linears use torch's kernels (mesh/runtime/linear.py). The built
file is named by a digest of the source and the flags, so an edited kernel builds
anew and a built one needs no compiler (the container image builds it at image
build time, ``MESH_KERNEL_CACHE``); concurrent stage processes build into temporary
names and rename.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

KERNELS = Path(__file__).with_name("kernels")
SOURCES = (
    KERNELS / "qmatmul.c",
    KERNELS / "attend.c",
    KERNELS / "norm.c",
    KERNELS / "layer.c",
)
# Included by the sources: part of what names a build.
HEADERS = (KERNELS / "simd.h",)
CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni")
COMPILE_FLAGS = (
    "-O3",
    "-std=c11",
    "-mavx512f",
    "-mavx512bw",
    "-mavx512vl",
    "-mavx512dq",
    "-mavx512vnni",
    "-shared",
    "-fPIC",
    "-pthread",
)
# AMX tiles (Sapphire Rapids and later) for calls of many rows, where the compiler
# knows them; without, the same kernels run on AVX-512 VNNI alone.
AMX_FLAGS = ("-mamx-tile", "-mamx-int8", "-DMESH_AMX")
BUILD_TIMEOUT_S = 120
# Calls of at least this many rows run on AMX tiles where the CPU grants them
# (bit-identical to the VNNI loops), for int4 weights and for int8 weights; a call of
# fewer than 16 rows gets tiles of just its rows. Measured on a 2-core Sapphire
# Rapids VM, 1 thread, SmolLM2 shapes, AMX time over VNNI time in the same run
# (docs/benchmarks.md, "The stage's own kernels"): int8 0.73-0.85 at 6-8 rows,
# 1.14-1.23 at 4; int4 0.96-1.02 at 12 rows and 1.05-1.14 at 8 in one run, 0.77-0.93
# at 12 and 0.83-0.96 at 8 in another: int4 decodes its weight tile for AMX on every
# block of 32 inputs, so it pays later. At 1-2 rows AMX costs 1.5-3.3x.
AMX_ROWS_INT4 = 12
AMX_ROWS_INT8 = 6
# How many bytes ahead of the block being multiplied the quantised kernels ask for a
# weight's cache lines. Measured on the same VM, 1 thread, a stage step of the int4
# package (benchmarks/step_bench.py --compare prefetch): 1024-8192 all helped, 2048
# the most; without the hints a one-row step read the weights at about 2/3 of the
# core's read bandwidth.
FETCH_AHEAD_BYTES = 2048

_P = ctypes.c_void_p
_I = ctypes.c_int64
_C = ctypes.c_int
_SIGNATURES = {
    "mesh_pack_int4": [_P, _I, _I, _P],
    "mesh_int4_matmul": [_P, _C, _I, _I, _I, _I, _P, _P, _P, _P, _P, _P, _P, _P, _C],
    "mesh_pack_int8": [_P, _I, _I, _P],
    "mesh_int8_matmul": [_P, _C, _I, _I, _I, _P, _P, _P, _P, _P, _P, _P, _C],
    "mesh_set_amx_rows": [_I, _I],
    "mesh_set_fetch_ahead": [_I],
    "mesh_amx_available": [],
    "mesh_attend": [_P, _I, _C, _I, _I, _I, ctypes.c_float, _P, _I, _P, _C],
    "mesh_rms_norm": [_P, _C, _I, _I, _P, ctypes.c_float, _P],
    "mesh_layers": [_P, _I, _P, _P, _I, _P, _P, _P, _I, _P, _P, _P, _P, _P, _C],
    "mesh_layers_scratch": [_P, _I],
}
_RESULTS = {
    "mesh_amx_available": ctypes.c_int,
    "mesh_attend": ctypes.c_int,
    "mesh_layers": ctypes.c_int,
    "mesh_layers_scratch": _I,
}


class KernelUnavailable(RuntimeError):
    """The stage's own kernels cannot run here (the message says why)."""


def cache_dir() -> Path:
    """Where built kernels are kept: ``$MESH_KERNEL_CACHE``, else
    ``$XDG_CACHE_HOME/mesh/kernels`` (``~/.cache/mesh/kernels``)."""
    explicit = os.environ.get("MESH_KERNEL_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mesh" / "kernels"


def missing_cpu_flags(cpuinfo: str) -> list[str]:
    """Of ``CPU_FLAGS``, those the first ``flags`` line of ``cpuinfo`` lacks."""
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            present = set(line.split(":", 1)[1].split())
            return [flag for flag in CPU_FLAGS if flag not in present]
    return list(CPU_FLAGS)


def check_cpu() -> None:
    """Raise ``KernelUnavailable`` where this CPU cannot run the kernels."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        here = f"{platform.system()} {platform.machine()}"
        raise KernelUnavailable(f"needs x86-64 Linux, this is {here}")
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError as error:
        raise KernelUnavailable(f"cannot read /proc/cpuinfo ({error})") from error
    missing = missing_cpu_flags(cpuinfo)
    if missing:
        raise KernelUnavailable(f"the CPU lacks {', '.join(missing)}")


def _compiler() -> str:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    raise KernelUnavailable("no C compiler ($CC, cc, gcc or clang) on PATH")


def build(directory: Path | None = None) -> Path:
    """The shared library for this source, built if not cached: with AMX where the
    compiler knows it, else without (building needs no AVX-512 on the building
    machine, only on the one that loads it)."""
    directory = directory or cache_dir()
    variants = ((*COMPILE_FLAGS, *AMX_FLAGS), COMPILE_FLAGS)
    for flags in variants:
        target = _target(directory, flags)
        if target.exists():
            return target
    failure: KernelUnavailable | None = None
    for flags in variants:
        try:
            return _compile(directory, flags)
        except KernelUnavailable as error:
            failure = failure or error
            logger.info("building with %s failed: %s", " ".join(flags), error)
    assert failure is not None
    raise failure


def _target(directory: Path, flags: tuple[str, ...]) -> Path:
    content = b"".join(path.read_bytes() for path in (*SOURCES, *HEADERS))
    digest = hashlib.sha256(content + " ".join(flags).encode()).hexdigest()
    return directory / f"qmatmul-{digest[:16]}.so"


def _compile(directory: Path, flags: tuple[str, ...]) -> Path:
    target = _target(directory, flags)
    compiler = _compiler()
    directory.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=".qmatmul-", suffix=".so", dir=directory)
    os.close(handle)
    command = [compiler, *flags, "-o", temporary, *(str(path) for path in SOURCES)]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False
        )
        if done.returncode != 0:
            raise KernelUnavailable(
                f"{' '.join(command)} failed: {(done.stderr or done.stdout).strip()[:500]}"
            )
        os.replace(temporary, target)
    except (OSError, subprocess.SubprocessError) as error:
        raise KernelUnavailable(f"building the kernels failed: {error}") from error
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
    logger.info("built the stage's CPU kernels (quantised linears, attention) into %s", target)
    return target


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernels, or ``None`` (logged once with the reason) where they
    cannot be built or loaded on this machine."""
    try:
        check_cpu()
        path = build()
        lib = ctypes.CDLL(str(path))
    except (KernelUnavailable, OSError) as error:
        logger.warning("the stage's CPU kernels unavailable, using torch's: %s", error)
        return None
    for name, argtypes in _SIGNATURES.items():
        function = getattr(lib, name)
        function.argtypes = argtypes
        function.restype = _RESULTS.get(name)
    lib.mesh_set_amx_rows(AMX_ROWS_INT4, AMX_ROWS_INT8)
    lib.mesh_set_fetch_ahead(FETCH_AHEAD_BYTES)
    amx = bool(lib.mesh_amx_available())
    logger.info("the stage's CPU kernels: %s (%s)", "VNNI + AMX" if amx else "VNNI", path)
    return lib


def set_amx_rows(int4_rows: int = AMX_ROWS_INT4, int8_rows: int = AMX_ROWS_INT8) -> None:
    """From how many rows the loaded kernels use AMX tiles, for int4 and for int8
    weights (0: never; 1: always). Results are the same bits either way: this only
    moves time. The defaults are the measured break-even points."""
    lib = library()
    if lib is not None:
        lib.mesh_set_amx_rows(int4_rows, int8_rows)


def amx() -> bool:
    """Whether the loaded kernels use AMX tiles for calls of many rows."""
    lib = library()
    return lib is not None and bool(lib.mesh_amx_available())
