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
from typing import Any

import torch

from mesh import quant
from mesh.package.sources import Checkpoint
from mesh.quant import QuantScheme

logger = logging.getLogger(__name__)

# Package tensor names (inside a layer file) that are linear weights.
_LINEAR_SUFFIX = "_proj.weight"


def convert_plain(tensor: torch.Tensor, torch_dtype: torch.dtype) -> torch.Tensor:
    if tensor.is_floating_point():
        tensor = tensor.to(torch_dtype)
    return tensor.contiguous()


class WeightStore:
    def __init__(
        self, checkpoint: Checkpoint, scheme: QuantScheme | None, torch_dtype: torch.dtype
    ) -> None:
        self.checkpoint = checkpoint
        self.scheme = scheme
        self.torch_dtype = torch_dtype
        self.exact: Counter[str] = Counter()
        self.requantized: Counter[str] = Counter()

    def layer_tensor(self, name: str, source: str) -> dict[str, torch.Tensor]:
        tensor = self.checkpoint.tensor(source)
        if self.scheme is not None and name.endswith(_LINEAR_SUFFIX) and tensor.dim() == 2:
            return self.linear(name, source, tensor)
        return {name: convert_plain(tensor, self.torch_dtype)}

    def linear(
        self, name: str, source: str, tensor: torch.Tensor, tied: bool = False, head: bool = False
    ) -> dict[str, torch.Tensor]:
        """A linear weight (or, with ``head``, the LM head): plain, or quantised parts
        under ``name.*``."""
        scheme = self.scheme
        if scheme is None:
            return {name: convert_plain(tensor, self.torch_dtype)}
        kind = scheme.head if head else scheme.kind
        parts = None
        if kind == "int4" and not tied:
            parts = self.checkpoint.quantized_parts(source, "int4", scheme.group_size)
        origin = self.checkpoint.source_type(source)
        if parts is not None:
            self.exact[origin] += 1
        elif kind == "int4":
            parts = quant.quantize_int4(tensor, scheme.group_size)
            self.requantized[origin] += 1
        else:
            parts = quant.quantize_int8(tensor)
            self.requantized[origin] += 1
        return {f"{name}.{key}": value.contiguous() for key, value in parts.items()}

    def embedding(self, name: str, source: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """The embedding table: plain, or group-wise int8 in a quantised package."""
        if self.scheme is None:
            return {name: convert_plain(tensor, self.torch_dtype)}
        origin = self.checkpoint.source_type(source)
        parts = self.checkpoint.quantized_parts(source, "int8g", quant.EMBED_GROUP)
        if parts is not None:
            self.exact[origin] += 1
        else:
            parts = quant.quantize_int8_groups(tensor, quant.EMBED_GROUP)
            self.requantized[origin] += 1
        return {f"{name}.{key}": value.contiguous() for key, value in parts.items()}

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
