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
from typing import Any

import torch

from mesh import quant
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

    def layer_tensor(self, name: str, source: str) -> dict[str, torch.Tensor]:
        if len(self.checkpoint.shape(source)) == 2 and (
            name.endswith(_LINEAR_SUFFIX) or self.scheme is None
        ):
            return self.linear(name, source)
        self._count(source, self.checkpoint.nbytes(source))
        return {name: convert_plain(self.checkpoint.tensor(source), self.torch_dtype)}

    def linear(
        self, name: str, source: str, tied: bool = False, head: bool = False
    ) -> dict[str, torch.Tensor]:
        """A linear weight (or, with ``head``, the LM head): plain, or quantised parts
        under ``name.*``."""
        scheme = self.scheme
        if scheme is None:
            return {name: self.plain(source)}
        kind = scheme.head if head else scheme.kind
        origin = self.checkpoint.source_type(source)
        parts = None
        if kind == "int4" and not tied:
            parts = self._exact(source, "int4", scheme.group_size)
        if parts is not None:
            self.exact[origin] += 1
        elif kind == "int4":
            parts = self._by_rows(source, lambda rows: quant.quantize_int4(rows, scheme.group_size))
            self.requantized[origin] += 1
        else:
            parts = self._by_rows(source, quant.quantize_int8)
            self.requantized[origin] += 1
        return {f"{name}.{key}": value for key, value in parts.items()}

    def embedding(self, name: str, source: str) -> dict[str, torch.Tensor]:
        """The embedding table: plain, or group-wise int8 in a quantised package."""
        if self.scheme is None:
            return {name: self.plain(source)}
        origin = self.checkpoint.source_type(source)
        parts = self._exact(source, "int8g", quant.EMBED_GROUP)
        if parts is not None:
            self.exact[origin] += 1
        else:
            parts = self._by_rows(source, quant.quantize_int8_groups)
            self.requantized[origin] += 1
        return {f"{name}.{key}": value for key, value in parts.items()}

    def plain(self, source: str) -> torch.Tensor:
        """A 2-D tensor in the package dtype."""
        return self._by_rows(source, lambda rows: {"": convert_plain(rows, self.torch_dtype)})[""]

    def _exact(self, source: str, kind: str, group: int) -> dict[str, torch.Tensor] | None:
        """The checkpoint's own codes in ``kind``, read in row chunks; None where it
        has none in that form."""
        checkpoint = self.checkpoint
        if not checkpoint.has_codes(source, kind, group):
            return None
        return self._by_rows(
            source,
            None,
            lambda first, count: checkpoint.quantized_parts(source, kind, group, first, count),
        )

    def _by_rows(
        self,
        source: str,
        convert: Callable[[torch.Tensor], dict[str, torch.Tensor]] | None,
        read: Callable[[int, int], dict[str, torch.Tensor]] | None = None,
    ) -> dict[str, torch.Tensor]:
        """``convert`` applied to ``source``'s rows a chunk at a time (or ``read`` giving
        a chunk's parts directly), into tensors allocated once: every conversion is
        row by row, so the result is the whole tensor's."""
        checkpoint = self.checkpoint
        shape = checkpoint.shape(source)
        total, cols = shape[0], shape[-1]
        unit = checkpoint.row_unit(source)
        step = max(unit, CHUNK_BYTES // max(1, 4 * cols) // unit * unit)
        out: dict[str, torch.Tensor] = {}
        for first in range(0, total, step):
            count = min(step, total - first)
            if read is not None:
                parts = read(first, count)
            else:
                assert convert is not None
                parts = convert(checkpoint.rows(source, first, count))
            self._count(source, checkpoint.nbytes(source) * count // total)
            for key, value in parts.items():
                if key not in out:
                    out[key] = torch.empty((total, *value.shape[1:]), dtype=value.dtype)
                out[key][first : first + count] = value
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
        return body
