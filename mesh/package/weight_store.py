"""Turn checkpoint tensors into the tensors a package file stores: plain in the
package dtype, or quantised as the package's ``QuantScheme`` says (mesh/quant.py).

Quantised forms come from the checkpoint's own codes where it has them in exactly
that form (GGUF Q4_0/Q4_1/Q4_K -> int4 group 32, Q8_0 -> int8 embedding), and are
otherwise computed from the float tensor by round-to-nearest. The store counts both
kinds so the manifest can say how the package was made.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mesh import quant
from mesh.errors import PackageError
from mesh.package.sources import Checkpoint
from mesh.quant import QuantScheme

logger = logging.getLogger(__name__)

# Package tensor names (inside a layer file) that are linear weights.
_LINEAR_SUFFIX = "_proj.weight"


# A float32 read of at most this many bytes per step: peak memory of a build is a
# few of these plus the file being written, whatever the model's size.
CHUNK_BYTES = 64 << 20


def convert_plain(tensor: torch.Tensor, torch_dtype: torch.dtype) -> torch.Tensor:
    if tensor.is_floating_point():
        tensor = tensor.to(torch_dtype)
    return tensor.contiguous()


def _check_floats(source: str, tensor: torch.Tensor) -> None:
    """A model weight is read as floats (a GGUF block type dequantised); integers here
    mean a damaged or foreign checkpoint, which no conversion would make right."""
    if not tensor.is_floating_point():
        raise PackageError(
            f"checkpoint tensor {source} is {tensor.dtype}, not floating point: the "
            "checkpoint is damaged or in a form this builder does not read; fix or "
            "re-download it"
        )


@dataclass(frozen=True)
class Form:
    """A quantised form of a weight: how to make it from floats, and back."""

    label: str
    quantize: Callable[[torch.Tensor], dict[str, torch.Tensor]]
    restore: Callable[[dict[str, torch.Tensor]], torch.Tensor]


INT8_ROWS = Form(
    "int8 per row", quant.quantize_int8, lambda parts: quant.dequantize_int8(parts, torch.float32)
)
INT8_EMBED = Form(
    f"int8 g{quant.EMBED_GROUP}",
    quant.quantize_int8_groups,
    lambda parts: quant.dequantize_int8_groups(parts, torch.float32),
)


@dataclass
class Deviation:
    """How far stored weights are from the source's own floats (a GGUF's
    dequantisation, a safetensors file's values): the largest absolute difference
    and the root-mean-square difference over the RMS of the weights."""

    tensors: int = 0
    from_codes: int = 0
    max_abs: float = 0.0
    squared_error: float = 0.0
    squared_value: float = 0.0
    values: int = 0

    def add(self, stored: torch.Tensor, source: torch.Tensor) -> None:
        reference = source.to(torch.float32)
        error = stored.to(torch.float32) - reference
        self.max_abs = max(self.max_abs, float(error.abs().max()) if error.numel() else 0.0)
        self.squared_error += float(error.double().square().sum())
        self.squared_value += float(reference.double().square().sum())
        self.values += error.numel()

    def to_json(self) -> dict[str, Any]:
        relative = (self.squared_error / self.squared_value) ** 0.5 if self.squared_value else 0.0
        return {
            "tensors": self.tensors,
            "from_source_codes": self.from_codes,
            "max_abs_error": float(f"{self.max_abs:.4g}"),
            "relative_rms_error": float(f"{relative:.4g}"),
            "values_compared": self.values,
        }


class WeightStore:
    def __init__(
        self,
        checkpoint: Checkpoint,
        scheme: QuantScheme | None,
        torch_dtype: torch.dtype,
        on_read: Callable[[str, int], None] | None = None,
    ) -> None:
        self.checkpoint = checkpoint
        self.on_read = on_read
        self.scheme = scheme
        self.torch_dtype = torch_dtype
        self.exact: Counter[str] = Counter()
        self.requantized: Counter[str] = Counter()
        # (source type, package form) -> how far the stored values are from the source's.
        self.deviations: dict[tuple[str, str], Deviation] = {}

    def layer_tensor(self, name: str, source: str) -> dict[str, torch.Tensor]:
        if len(self.checkpoint.shape(source)) == 2 and (
            name.endswith(_LINEAR_SUFFIX) or self.scheme is None
        ):
            return self.linear(name, source)
        self._count(source, self.checkpoint.nbytes(source))
        tensor = self.checkpoint.tensor(source)
        _check_floats(source, tensor)
        return {name: convert_plain(tensor, self.torch_dtype)}

    def linear(
        self, name: str, source: str, tied: bool = False, head: bool = False
    ) -> dict[str, torch.Tensor]:
        """A linear weight (or, with ``head``, the LM head): plain, or quantised parts
        under ``name.*``."""
        scheme = self.scheme
        if scheme is None:
            return {name: self.plain(source)}
        kind = scheme.head if head else scheme.kind
        if kind == "int4":
            form = Form(
                f"int4 g{scheme.group_size}",
                lambda rows: quant.quantize_int4(rows, scheme.group_size),
                lambda parts: quant.dequantize_int4(parts, torch.float32),
            )
            codes = None if tied else ("int4", scheme.group_size)
        else:
            form = INT8_ROWS
            codes = None
        return self._quantised(name, source, form, codes)

    def embedding(self, name: str, source: str) -> dict[str, torch.Tensor]:
        """The embedding table: plain, or group-wise int8 in a quantised package."""
        if self.scheme is None:
            return {name: self.plain(source)}
        return self._quantised(name, source, INT8_EMBED, ("int8g", quant.EMBED_GROUP))

    def plain(self, source: str) -> torch.Tensor:
        """A 2-D tensor in the package dtype."""
        return self._by_rows(source, lambda rows: {"": convert_plain(rows, self.torch_dtype)})[""]

    def _quantised(
        self, name: str, source: str, form: Form, codes: tuple[str, int] | None
    ) -> dict[str, torch.Tensor]:
        """``source`` in ``form``: from the checkpoint's own codes where it has them
        as ``codes`` (kind, group), else rounded from its floats; either way the
        deviation from the checkpoint's floats is measured."""
        checkpoint = self.checkpoint
        origin = checkpoint.source_type(source)
        deviation = self.deviations.setdefault((origin, form.label), Deviation())
        if codes is not None and checkpoint.has_codes(source, *codes):
            kind, group = codes
            parts = self._by_rows(
                source,
                None,
                lambda first, count: checkpoint.quantized_parts(source, kind, group, first, count),
                form.restore,
                deviation,
            )
            self.exact[origin] += 1
            deviation.from_codes += 1
        else:
            parts = self._by_rows(source, form.quantize, None, form.restore, deviation)
            self.requantized[origin] += 1
        return {f"{name}.{key}": value for key, value in parts.items()}

    def _by_rows(
        self,
        source: str,
        convert: Callable[[torch.Tensor], dict[str, torch.Tensor]] | None,
        read: Callable[[int, int], dict[str, torch.Tensor]] | None = None,
        restore: Callable[[dict[str, torch.Tensor]], torch.Tensor] | None = None,
        deviation: Deviation | None = None,
    ) -> dict[str, torch.Tensor]:
        """``convert`` applied to ``source``'s rows a chunk at a time (or ``read`` giving
        a chunk's parts directly), into tensors allocated once: every conversion is
        row by row, so the result is the whole tensor's. With ``restore`` and
        ``deviation``, the parts' values are compared with the source's floats: every
        chunk that was converted, the first chunk of codes that were read (reading
        the floats too would double a build's work)."""
        checkpoint = self.checkpoint
        shape = checkpoint.shape(source)
        total, cols = shape[0], shape[-1]
        unit = checkpoint.row_unit(source)
        step = max(unit, CHUNK_BYTES // max(1, 4 * cols) // unit * unit)
        out: dict[str, torch.Tensor] = {}
        for first in range(0, total, step):
            count = min(step, total - first)
            rows = None
            if read is not None:
                parts = read(first, count)
                if first == 0 and deviation is not None:
                    rows = checkpoint.rows(source, first, count)
            else:
                assert convert is not None
                rows = checkpoint.rows(source, first, count)
                _check_floats(source, rows)
                parts = convert(rows)
            if rows is not None and restore is not None and deviation is not None:
                deviation.add(restore(parts), rows)
            self._count(source, checkpoint.nbytes(source) * count // total)
            for key, value in parts.items():
                if key not in out:
                    out[key] = torch.empty((total, *value.shape[1:]), dtype=value.dtype)
                out[key][first : first + count] = value
        if deviation is not None:
            deviation.tensors += 1
        return out

    def _count(self, source: str, nbytes: int) -> None:
        if self.on_read is not None:
            self.on_read(source, nbytes)

    def summary(self) -> dict[str, Any] | None:
        """The manifest's ``quantization`` block (None for a plain package)."""
        if self.scheme is None:
            return None
        logger.info(
            "quantised %s tensors from the source's own codes (%s), %s by rounding (%s)",
            sum(self.exact.values()),
            dict(self.exact) or "none",
            sum(self.requantized.values()),
            dict(self.requantized) or "none",
        )
        body = self.scheme.to_json()
        body["from_source_codes"] = dict(sorted(self.exact.items()))
        body["rounded"] = dict(sorted(self.requantized.items()))
        body["deviation"] = [
            {"source": origin, "stored": form, **deviation.to_json()}
            for (origin, form), deviation in sorted(self.deviations.items())
        ]
        return body
