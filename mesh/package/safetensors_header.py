"""Reading and checking a safetensors file's header without loading its tensors.

A safetensors file is an 8-byte little-endian header length ``N``, ``N`` bytes of
JSON (``{"name": {"dtype", "shape", "data_offsets": [begin, end]}, ...}`` plus an
optional ``__metadata__``), then the data. Offsets count from the end of the
header; the tensors cover the data exactly, without holes or overlaps, so the
file's size is ``8 + N`` plus the last tensor's end.

A hash only says a file is the one the manifest names; the header says whether
that file can be loaded at all (a file truncated and re-hashed passes the first
check and fails this one). :func:`header_problem` also compares the tensors with
what the manifest implies: the embedding and head shapes, and the package dtype
of every plain floating-point tensor.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mesh.package.manifest import EMBED_PATH, HEAD_PATH, PackageFile, PackageManifest
from mesh.quant import PART_SUFFIXES

# safetensors' own reader refuses headers above 100 MB.
MAX_HEADER_BYTES = 100_000_000
ITEM_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "U16": 2,
    "I16": 2,
    "F16": 2,
    "BF16": 2,
    "U32": 4,
    "I32": 4,
    "F32": 4,
    "U64": 8,
    "I64": 8,
    "F64": 8,
}
FLOAT_DTYPES = ("F8_E4M3", "F8_E5M2", "F16", "BF16", "F32", "F64")
PACKAGE_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


@dataclass(frozen=True)
class TensorHeader:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class TensorExpectation:
    """What the manifest implies for one file: tensors that must be there with their
    shapes (a quantised one as its ``.qweight`` part, whose rows are checked: its
    columns depend on the packing), and the dtype of plain floating-point tensors."""

    required: Mapping[str, tuple[int, ...]]
    float_dtype: str | None


class HeaderError(ValueError):
    """The header cannot be read or does not describe the file."""


def read_header(path: Path) -> tuple[list[TensorHeader], int]:
    """The tensors a safetensors file declares and its expected size in bytes.

    Raises HeaderError for a header that is short, oversized, not JSON or malformed,
    and OSError when the file cannot be read. Offsets are not checked against the
    file's size here: :func:`header_problem` does that.
    """
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise HeaderError(f"only {len(prefix)} byte(s): no safetensors header length")
        (length,) = struct.unpack("<Q", prefix)
        if length < 2 or length > MAX_HEADER_BYTES:
            raise HeaderError(f"header length {length} is not plausible (2 to {MAX_HEADER_BYTES})")
        raw = handle.read(length)
    if len(raw) < length:
        raise HeaderError(f"header of {length} bytes, but the file ends after {len(raw)} of them")
    try:
        body = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise HeaderError(f"header is not JSON: {error}") from None
    if not isinstance(body, dict):
        raise HeaderError("header is not a JSON object")
    tensors = [_tensor(name, entry) for name, entry in body.items() if name != "__metadata__"]
    data_end = _check_layout(tensors)
    return tensors, 8 + length + data_end


def _tensor(name: str, entry: Any) -> TensorHeader:
    if not isinstance(entry, dict):
        raise HeaderError(f"tensor {name!r}: entry is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in ITEM_BYTES:
        raise HeaderError(f"tensor {name!r}: unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise HeaderError(f"tensor {name!r}: shape {shape!r} is not a list of sizes")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and o >= 0 for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise HeaderError(f"tensor {name!r}: data_offsets {offsets!r} are not [begin, end]")
    begin, end = offsets
    expected = math.prod(shape) * ITEM_BYTES[dtype]
    if end - begin != expected:
        raise HeaderError(
            f"tensor {name!r}: {dtype} {shape} needs {expected} bytes, data_offsets "
            f"[{begin}, {end}) hold {end - begin}"
        )
    return TensorHeader(name, dtype, tuple(shape), begin, end)


def _check_layout(tensors: list[TensorHeader]) -> int:
    """The end of the data; HeaderError when tensors overlap or leave a hole."""
    position = 0
    for tensor in sorted(tensors, key=lambda t: (t.begin, t.end)):
        if tensor.begin != position:
            kind = "overlaps the tensor before it" if tensor.begin < position else "leaves a hole"
            raise HeaderError(f"tensor {tensor.name!r} at [{tensor.begin}, {tensor.end}) {kind}")
        position = tensor.end
    return position


def expectation(manifest: PackageManifest, entry: PackageFile) -> TensorExpectation | None:
    """What ``manifest`` implies about the tensors of ``entry`` (None: not a tensor file)."""
    if not entry.path.endswith(".safetensors"):
        return None
    vocab, hidden = manifest.vocab_size, manifest.hidden_size
    required: dict[str, tuple[int, ...]] = {}
    if entry.path == EMBED_PATH:
        required["embed_tokens.weight"] = (vocab, hidden)
    elif entry.path == HEAD_PATH:
        required["norm.weight"] = (hidden,)
        required["lm_head.weight"] = (vocab, hidden)
    return TensorExpectation(required, PACKAGE_DTYPES.get(manifest.dtype))


def header_problem(path: Path, expected: TensorExpectation | None = None) -> str | None:
    """Why the safetensors file at ``path`` cannot be loaded as the manifest describes
    it, or None when its header is sound and covers the file exactly."""
    try:
        tensors, expected_size = read_header(path)
    except HeaderError as error:
        return f"safetensors header: {error}"
    except OSError as error:
        return f"unreadable: {error}"
    size = Path(path).stat().st_size
    if size != expected_size:
        state = "truncated" if size < expected_size else "has trailing bytes"
        return (
            f"safetensors header: the file is {size} bytes but its header ends the data at "
            f"byte {expected_size} ({state})"
        )
    if expected is not None:
        return _manifest_mismatch(tensors, expected)
    return None


def _manifest_mismatch(tensors: list[TensorHeader], expected: TensorExpectation) -> str | None:
    by_name = {t.name: t for t in tensors}
    for name, shape in expected.required.items():
        if name in by_name:
            tensor, wanted = by_name[name], shape
        elif name + ".qweight" in by_name:  # quantised: rows are outputs, columns packed
            tensor, wanted = by_name[name + ".qweight"], shape[:1]
        else:
            return f"safetensors header: no tensor {name!r}, which the manifest implies"
        if tensor.shape[: len(wanted)] != wanted or len(tensor.shape) != len(shape):
            return (
                f"safetensors header: {tensor.name} has shape {list(tensor.shape)}, the "
                f"manifest implies {list(shape)}"
            )
    for tensor in tensors:
        plain = not tensor.name.endswith(PART_SUFFIXES)
        if (
            plain
            and tensor.dtype in FLOAT_DTYPES
            and expected.float_dtype not in (None, tensor.dtype)
        ):
            return (
                f"safetensors header: {tensor.name} is {tensor.dtype}, the manifest's dtype "
                f"is {expected.float_dtype}"
            )
    return None
