"""A GGUF model, one file or split into parts, read one tensor (or a few rows of
one) at a time.

``gguf.GGUFReader`` parses the headers; tensor bytes are then read with ``pread``
into fresh buffers rather than through its memory map, so a build of a 40 GB file
holds in memory only the rows it is converting (pages of a file mapping count in a
process's resident set while the mapping lives). Everything a build could trip on
later is checked when the file is opened: every part of a split file present, every
tensor inside its file (a truncated download), every block type one this ``gguf``
package can decode, no tensor twice.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mesh.errors import PackageError
from mesh.package.end_tokens import gguf_end_tokens

# llama.cpp's gguf-split names: <stem>-00001-of-00003.gguf
_SPLIT = re.compile(r"^(?P<stem>.+)-(?P<number>\d{5})-of-(?P<count>\d{5})\.gguf$")


def split_parts(path: Path) -> list[Path]:
    """Every part of the GGUF ``path`` names, in order: ``[path]`` for a single file;
    for one part of a split file, all of its parts (each must exist)."""
    match = _SPLIT.match(path.name)
    if match is None:
        return [path]
    count = int(match["count"])
    if count < 1 or int(match["number"]) > count:
        raise PackageError(f"{path.name}: not a valid split GGUF name (part number > count)")
    parts = [
        path.with_name(f"{match['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)
    ]
    missing = [part.name for part in parts if not part.is_file()]
    if missing:
        raise PackageError(
            f"split GGUF {parts[0].name} has {count} parts but {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} missing from {path.parent}; "
            "download every part"
        )
    return parts


def split_stem(path: Path) -> str | None:
    """The model name a split part belongs to (None for a file that is no part)."""
    match = _SPLIT.match(path.name)
    return None if match is None else match["stem"]


@dataclass(frozen=True)
class GgufTensor:
    """Where one tensor's bytes are, and how to decode them."""

    name: str
    file: Path
    type_name: str
    qtype: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # torch order: rows first
    offset: int
    nbytes: int

    @property
    def rows(self) -> int:
        return int(np.prod(self.shape[:-1])) if len(self.shape) > 1 else 1

    @property
    def row_bytes(self) -> int:
        return self.nbytes // self.rows


class GgufModel:
    """The tensors and metadata of a GGUF model (single file or split)."""

    def __init__(self, path: Path) -> None:
        from gguf import GGUFReader

        self.path = Path(path)
        self.parts = split_parts(self.path)
        self.tensors: dict[str, GgufTensor] = {}
        self.architecture = ""
        self.has_tokenizer = False
        # ``<architecture>.expert_*`` integer metadata (mixture-of-experts models).
        self.experts: dict[str, int] = {}
        # Other ``<architecture>.<key>`` values a family needs (``SETTING_KEYS``).
        self.settings: dict[str, float | str | list[float]] = {}
        # The ids that end an answer (mesh/package/end_tokens.py), EOS first.
        self.end_token_ids: tuple[int, ...] = ()
        for index, part in enumerate(self.parts):
            try:
                reader = GGUFReader(str(part))
            except (OSError, ValueError, KeyError, IndexError) as error:
                raise PackageError(
                    f"cannot read GGUF {part} ({part.stat().st_size:,} bytes): {error}. It is "
                    "truncated or corrupt (download it again), or holds a tensor type this "
                    "version of the gguf package does not know"
                ) from error
            if index == 0:
                self.architecture = _string_field(reader, "general.architecture")
                self.has_tokenizer = "tokenizer.ggml.model" in reader.fields
                self.experts = _int_fields(reader, self.architecture, _EXPERT_KEYS)
                self.settings = _scalar_fields(reader, self.architecture, SETTING_KEYS)
                self.end_token_ids = gguf_end_tokens(reader)
            self._index(reader, part)
            del reader  # drops its memory map of the file
        if not self.tensors:
            raise PackageError(f"GGUF {self.path} holds no tensors")
        self._check_types()

    def _index(self, reader: Any, part: Path) -> None:
        size = part.stat().st_size
        for tensor in reader.tensors:
            if tensor.name in self.tensors:
                earlier = self.tensors[tensor.name].file.name
                raise PackageError(
                    f"GGUF tensor {tensor.name} appears twice (in {earlier} and {part.name})"
                )
            end = int(tensor.data_offset) + int(tensor.n_bytes)
            if end > size:
                raise PackageError(
                    f"GGUF {part} is truncated: tensor {tensor.name} ends at byte {end:,} but "
                    f"the file has {size:,} bytes; download it again"
                )
            self.tensors[tensor.name] = GgufTensor(
                name=tensor.name,
                file=part,
                type_name=tensor.tensor_type.name,
                qtype=tensor.tensor_type,
                shape=tuple(int(n) for n in reversed(tensor.shape.tolist())),
                offset=int(tensor.data_offset),
                nbytes=int(tensor.n_bytes),
            )

    def _check_types(self) -> None:
        """Decode one block of every type present, naming a tensor of a type the gguf
        package cannot decode."""
        from gguf import GGML_QUANT_SIZES
        from gguf.quants import dequantize

        seen: set[str] = set()
        for tensor in self.tensors.values():
            if tensor.type_name in seen:
                continue
            seen.add(tensor.type_name)
            _, type_size = GGML_QUANT_SIZES[tensor.qtype]
            try:
                dequantize(np.zeros((1, type_size), dtype=np.uint8), tensor.qtype)
            except NotImplementedError as error:
                raise PackageError(
                    f"GGUF tensor {tensor.name} is stored as {tensor.type_name}, which cannot be "
                    f"decoded here ({error}); convert the file to another quantisation type"
                ) from error

    def raw_rows(self, name: str, first: int, count: int) -> np.ndarray:
        """Bytes of rows ``first .. first + count`` of ``name`` ``[count, row_bytes]``."""
        tensor = self.tensors[name]
        width = tensor.row_bytes
        buffer = np.empty((count, width), dtype=np.uint8)
        view = memoryview(buffer).cast("B")
        with open(tensor.file, "rb", buffering=0) as handle:
            done, want, at = 0, count * width, tensor.offset + first * width
            while done < want:
                got = os.preadv(handle.fileno(), [view[done:]], at + done)
                if got == 0:
                    raise PackageError(f"GGUF {tensor.file} ended inside tensor {name}")
                done += got
        return buffer

    def float_rows(self, name: str, first: int, count: int) -> torch.Tensor:
        """Rows ``first .. first + count`` of ``name``, decoded to float32 ``[count, cols]``
        (a 1-D tensor is one row)."""
        from gguf.quants import dequantize

        tensor = self.tensors[name]
        values = dequantize(self.raw_rows(name, first, count), tensor.qtype)
        cols = tensor.shape[-1]
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(count, cols))


_EXPERT_KEYS = ("expert_count", "expert_used_count", "expert_feed_forward_length")
# Settings transformers' GGUF config reader leaves out (Gemma 2's caps; Gemma 3's
# rotary settings and which layers use the sliding window; Phi-3's rotated width
# and LongRoPE context; the head size where it is not hidden / heads, which the
# reader keeps for some architectures only).
SETTING_KEYS = (
    "attention.key_length",
    "attention.value_length",
    "attn_logit_softcapping",
    "rope.dimension_count",
    "rope.scaling.original_context_length",
    "rope.scaling.attn_factor",
    "final_logit_softcapping",
    "rope.freq_base",
    "rope.freq_base_swa",
    "rope.scaling.type",
    "rope.scaling.factor",
    "attention.sliding_window_pattern",
)


def _int_fields(reader: Any, architecture: str, keys: tuple[str, ...]) -> dict[str, int]:
    """The integer fields ``<architecture>.<key>`` present, by key."""
    found = {}
    for key in keys:
        field = reader.fields.get(f"{architecture}.{key}")
        if field is not None and field.data:
            found[key] = int(field.parts[field.data[0]][0])
    return found


def _scalar_fields(
    reader: Any, architecture: str, keys: tuple[str, ...]
) -> dict[str, float | str | list[float]]:
    """The fields ``<architecture>.<key>`` present, by key: a number, a string, or an
    array of numbers."""
    from gguf import GGUFValueType

    found: dict[str, float | str | list[float]] = {}
    for key in keys:
        field = reader.fields.get(f"{architecture}.{key}")
        if field is None or not field.types:
            continue
        kind = field.types[0]
        if kind == GGUFValueType.ARRAY:
            if len(field.types) == 2 and field.types[1] != GGUFValueType.STRING:
                found[key] = [float(field.parts[i][0]) for i in field.data]
        elif not field.data:
            continue
        elif kind == GGUFValueType.STRING:
            found[key] = bytes(field.parts[field.data[0]]).decode(errors="replace")
        else:
            found[key] = float(field.parts[field.data[0]][0])
    return found


def _string_field(reader: Any, key: str) -> str:
    field = reader.fields.get(key)
    if field is None:
        return ""
    return bytes(field.parts[field.data[0]]).decode(errors="replace")


_FOUR_BIT_AND_SO = ("Q2_K", "Q3_K", "Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K")


def kept_quantisation(model: GgufModel) -> tuple[str | None, dict[str, int]]:
    """The package quantisation that keeps what a GGUF's decoder weights hold:
    ``int4`` for 2- to 6-bit block types, ``int8`` for Q8_0, None (a float package)
    for float types; with the count of layer weights per block type."""
    counts: dict[str, int] = {}
    for name, tensor in model.tensors.items():
        if name.startswith("blk.") and name.endswith(".weight") and len(tensor.shape) >= 2:
            counts[tensor.type_name] = counts.get(tensor.type_name, 0) + 1
    if not counts:
        return None, counts
    low = sum(n for t, n in counts.items() if t in _FOUR_BIT_AND_SO or t.startswith("IQ"))
    eight = counts.get("Q8_0", 0)
    if low >= eight and low * 2 >= sum(counts.values()):
        return "int4", counts
    if eight * 2 >= sum(counts.values()) or eight + low > sum(counts.values()) // 2:
        return "int8", counts
    return None, counts
