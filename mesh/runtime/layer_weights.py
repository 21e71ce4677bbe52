"""Check the tensors a package gives for one module and sort them into linear specs.

The expected names and shapes come from the HF module built on the meta device. A
linear weight ``name`` may be stored plain (``name``) or quantised (``name.qweight``,
``name.scales`` and, for int4, ``name.mins``; see mesh/quant.py). Anything missing,
unexpected or misshapen is a PackageError that says to rebuild the package.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from mesh import quant
from mesh.errors import PackageError
from mesh.runtime.linear import LinearSpec

_QUANT_DTYPES = {
    "int4": {"qweight": torch.uint8, "scales": torch.float16, "mins": torch.float16},
    "int8": {"qweight": torch.int8, "scales": torch.float32},
    "int8g": {"qweight": torch.int8, "scales": torch.float16},
}


def check_finite(what: str, tensor: torch.Tensor, remedy: str) -> None:
    """PackageError unless every value of the floating-point ``tensor`` is finite."""
    bad = int(tensor.numel() - torch.isfinite(tensor).sum())
    if bad:
        raise PackageError(f"{what} holds {bad} NaN or infinite value(s); {remedy}")


class ModuleTensors:
    """The tensors of one module, checked against its meta-device twin."""

    def __init__(
        self,
        module: nn.Module,
        tensors: Mapping[str, torch.Tensor],
        what: str,
        quant_kind: str | None,
        group_size: int = 0,
        expected: Mapping[str, tuple[int, ...]] | None = None,
        remedy: str = "rebuild the package",
    ) -> None:
        """``expected`` replaces names and shapes of the module's state dict (a sparse
        layer's stacked experts are stored one expert at a time: mesh/runtime/moe.py);
        ``remedy`` ends every error (what the reader should do)."""
        self.what = what
        self.remedy = remedy
        self.quant_kind = quant_kind
        self.group_size = group_size
        self._tensors = dict(tensors)
        self._expected = {name: tuple(t.shape) for name, t in module.state_dict().items()}
        if expected is not None:
            self._expected = dict(expected)
        self._check_names()

    def _check_names(self) -> None:
        present = set(self._tensors)
        missing: list[str] = []
        used: set[str] = set()
        for name in self._expected:
            if name in present:
                used.add(name)
                continue
            parts = self._part_names(name)
            if parts and all(part in present for part in parts):
                used.update(parts)
            else:
                missing.append(name)
        unexpected = sorted(present - used)
        if missing or unexpected:
            raise PackageError(
                f"{self.what}: tensor names do not match the model config "
                f"(missing: {missing[:6] or 'none'}; unexpected: {unexpected[:6] or 'none'}); "
                f"{self.remedy}"
            )

    def check_all(self) -> None:
        """Check every expected tensor's shape and dtype now (a stage checks each as it
        builds; a package build checks them all before a stage ever sees them)."""
        for name, shape in self._expected.items():
            if name not in self._tensors:
                # Stored quantised: _check_names found its parts.
                assert self.quant_kind is not None
                parts = self.quant_parts(name, self.quant_kind, *shape)
                for part, tensor in parts.items():
                    if tensor.dtype.is_floating_point:
                        self._check_finite(f"{name}.{part}", tensor)
                continue
            tensor = self.plain(name)
            if not tensor.dtype.is_floating_point:
                raise PackageError(
                    f"{self.what}: tensor {name} is {tensor.dtype}, a floating-point "
                    f"tensor is expected; {self.remedy}"
                )
            self._check_finite(name, tensor)

    def _check_finite(self, name: str, tensor: torch.Tensor) -> None:
        check_finite(f"{self.what}: tensor {name}", tensor, self.remedy)

    def _part_names(self, name: str) -> tuple[str, ...]:
        if self.quant_kind is None or name.split(".")[-1] != "weight":
            return ()
        return quant.part_names(name, self.quant_kind)

    def plain(self, name: str) -> torch.Tensor:
        """A tensor stored as is (norms, biases, dense weights), shape-checked."""
        tensor = self._tensors.get(name)
        if tensor is None:
            raise PackageError(f"{self.what}: {name} is stored quantised; expected a plain tensor")
        expected = self._expected[name]
        if tuple(tensor.shape) != expected:
            raise PackageError(
                f"{self.what}: tensor {name} has shape {tuple(tensor.shape)}, "
                f"the config expects {expected}; {self.remedy}"
            )
        return tensor

    def has_plain(self, name: str) -> bool:
        return name in self._tensors

    def optional(self, name: str) -> torch.Tensor | None:
        return self.plain(name) if name in self._expected else None

    def linear(self, prefix: str) -> LinearSpec:
        """The ``prefix.weight`` (+ ``prefix.bias``) of a linear layer; ``""`` for the
        module's own ``weight``."""
        dot = f"{prefix}." if prefix else ""
        name = f"{dot}weight"
        rows, cols = self._expected[name]
        bias = self.optional(f"{dot}bias")
        if name in self._tensors:
            return LinearSpec(rows, cols, "dense", weight=self.plain(name), bias=bias)
        kind = self.quant_kind or "dense"
        parts = self.quant_parts(name, kind, rows, cols)
        return LinearSpec(rows, cols, kind, parts=parts, bias=bias)

    def quant_parts(self, name: str, kind: str, rows: int, cols: int) -> dict[str, torch.Tensor]:
        """The checked parts of quantised weight ``name`` (logical shape ``[rows, cols]``)."""
        parts = quant.split_parts(self._tensors, name) or {}
        dtypes = _QUANT_DTYPES[kind]
        if set(parts) != set(dtypes):
            raise PackageError(
                f"{self.what}: {name} has parts {sorted(parts)}, a {kind} weight has "
                f"{sorted(dtypes)}; {self.remedy}"
            )
        if kind != "int8" and (self.group_size < 1 or cols % self.group_size):
            raise PackageError(
                f"{self.what}: {name} has {cols} inputs, not a multiple of the package's "
                f"group size {self.group_size}; {self.remedy}"
            )
        groups = cols // self.group_size if kind != "int8" else 1
        expected = {
            "qweight": (rows, cols // 2) if kind == "int4" else (rows, cols),
            "scales": (rows,) if kind == "int8" else (rows, groups),
            "mins": (rows, groups),
        }
        for part, tensor in parts.items():
            if tensor.dtype != dtypes[part] or tuple(tensor.shape) != expected[part]:
                source = ""
                if part == "qweight" and tensor.dim() == 2:
                    width = tensor.shape[1] * (2 if kind == "int4" else 1)
                    source = f", quantised from a ({tensor.shape[0]}, {width}) weight"
                raise PackageError(
                    f"{self.what}: {name}.{part} is {tensor.dtype} {tuple(tensor.shape)}"
                    f"{source}; expected {dtypes[part]} {expected[part]}, the {kind} part of "
                    f"a ({rows}, {cols}) weight; {self.remedy}"
                )
        return parts
