"""Activation tensors on the wire: the wire dtype enum, encoding and decoding.

Tensors travel row-major and little-endian in one of four wire dtypes: f32, f16,
bf16 (sent as its raw 16-bit pattern) and int8 with one float32 scale per row of
the last dimension (symmetric: ``scale = absmax / 127``, ``value = q * scale``).
This sits on the per-token path, so it works on whole buffers: numpy ``tobytes``
to encode and ``torch.frombuffer`` to decode. ``mesh.codec`` re-exports it.
"""

from __future__ import annotations

import enum
import math
import sys

import torch

from mesh.errors import Fatal, InvalidRequest
from mesh.proto.v1 import common_pb2

if sys.byteorder != "little":
    raise ImportError("mesh.codec writes little-endian tensors and needs a little-endian host")


class WireDType(enum.Enum):
    """How activations travel between stages. INT8 adds one float32 scale per row."""

    F32 = "f32"
    F16 = "f16"
    BF16 = "bf16"
    INT8 = "int8"

    @property
    def itemsize(self) -> int:
        """Bytes per value on the wire (scales of INT8 not included)."""
        return _ITEMSIZE[self]

    @classmethod
    def parse(cls, text: str | WireDType) -> WireDType:
        """``"f16"``, ``"F16"``, ``"float16"`` or ``"fp16"`` -> ``WireDType.F16``."""
        if isinstance(text, WireDType):
            return text
        key = text.strip().lower()
        found = _ALIASES.get(key)
        if found is None:
            names = ", ".join(d.value for d in cls)
            raise InvalidRequest(f"unknown wire dtype {text!r}; use one of: {names}")
        return found

    def to_proto(self) -> int:
        return _TO_PB[self]

    @classmethod
    def from_proto(cls, value: int) -> WireDType:
        found = _FROM_PB.get(value)
        if found is None:
            raise InvalidRequest(
                f"wire dtype {value} is unset or unknown; the sender must pick one of "
                + ", ".join(d.value for d in cls)
            )
        return found


_ITEMSIZE = {WireDType.F32: 4, WireDType.F16: 2, WireDType.BF16: 2, WireDType.INT8: 1}
_TO_PB = {
    WireDType.F32: common_pb2.WIRE_DTYPE_F32,
    WireDType.F16: common_pb2.WIRE_DTYPE_F16,
    WireDType.BF16: common_pb2.WIRE_DTYPE_BF16,
    WireDType.INT8: common_pb2.WIRE_DTYPE_INT8,
}
_FROM_PB = {v: k for k, v in _TO_PB.items()}
_ALIASES = {d.value: d for d in WireDType} | {
    "float32": WireDType.F32,
    "fp32": WireDType.F32,
    "float16": WireDType.F16,
    "fp16": WireDType.F16,
    "half": WireDType.F16,
    "bfloat16": WireDType.BF16,
}


_SCALE_BYTES = 4
_TINY = torch.finfo(torch.float32).tiny


def bytes_per_token(hidden_size: int, wire_dtype: WireDType | str) -> int:
    """Activation payload bytes per token crossing one stage boundary."""
    wire = WireDType.parse(wire_dtype)
    return hidden_size * wire.itemsize + (_SCALE_BYTES if wire is WireDType.INT8 else 0)


def encode_tensor(t: torch.Tensor, wire_dtype: WireDType | str) -> common_pb2.Tensor:
    """Encode ``t`` (any device, any float dtype, at least 1-D) for the wire."""
    pb = common_pb2.Tensor()
    fill_tensor(pb, t, WireDType.parse(wire_dtype))
    return pb


def fill_tensor(pb: common_pb2.Tensor, t: torch.Tensor, wire: WireDType) -> None:
    """Encode ``t`` into an empty Tensor message in place (e.g. ``frame_pb.hidden``)."""
    if t.dim() == 0:
        raise InvalidRequest("cannot encode a 0-d tensor; activations are [tokens, hidden]")
    t = t.detach()
    pb.dtype = wire.to_proto()
    pb.shape.extend(t.shape)
    if wire is WireDType.INT8:
        data, scales = _quantize_int8(t)
        pb.data = data
        pb.scales = scales
        return
    if wire is WireDType.F32:
        values = t.to(torch.float32)
    elif wire is WireDType.F16:
        values = t.to(torch.float16)
    else:
        values = t.to(torch.bfloat16).contiguous().view(torch.int16)
    pb.data = values.contiguous().cpu().numpy().tobytes()


def _quantize_int8(t: torch.Tensor) -> tuple[bytes, bytes]:
    rows = t.to(torch.float32).reshape(-1, t.shape[-1])
    if rows.numel() == 0:
        return b"", bytes(_SCALE_BYTES * rows.shape[0])
    absmax = rows.abs().amax(dim=1)
    if not math.isfinite(absmax.sum().item()):
        raise Fatal(
            "cannot encode activations as int8: they contain inf or NaN; "
            "the stage's compute produced non-finite values (check the model dtype)"
        )
    # A normal float32 scale keeps |x / scale| <= 127 after rounding, so no clamp is
    # needed; rows whose absmax is below 127 * tiny use the smallest normal scale.
    scale = absmax.div_(127.0).clamp_min_(_TINY)
    q = torch.div(rows, scale.unsqueeze(1)).round_().to(torch.int8)
    return q.cpu().numpy().tobytes(), scale.cpu().numpy().tobytes()


def payload_problem(pb: common_pb2.Tensor, wire: WireDType) -> str | None:
    """Why the byte lengths of ``pb`` do not fit its shape, or None when they do."""
    shape = list(pb.shape)
    if not shape:
        return "tensor has no shape; activations are [tokens, hidden]"
    expected = math.prod(shape) * wire.itemsize
    if len(pb.data) != expected:
        return (
            f"tensor data is {len(pb.data)} bytes but shape {shape} in {wire.value} "
            f"needs {expected} bytes"
        )
    expected_scales = math.prod(shape[:-1]) * _SCALE_BYTES if wire is WireDType.INT8 else 0
    if len(pb.scales) != expected_scales:
        return (
            f"tensor scales are {len(pb.scales)} bytes but {wire.value} with shape {shape} "
            f"needs {expected_scales} (one float32 per row for int8, none otherwise)"
        )
    return None


def decode_tensor(pb: common_pb2.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode a wire tensor into a new CPU tensor of ``out_dtype``."""
    wire = WireDType.from_proto(pb.dtype)
    problem = payload_problem(pb, wire)
    if problem is not None:
        raise InvalidRequest(problem + "; the sender's encoder and shape disagree")
    shape = tuple(pb.shape)
    if math.prod(shape) == 0:
        return torch.empty(shape, dtype=out_dtype)
    # bytearray: torch tensors over immutable bytes are unsafe to write to.
    if wire is WireDType.F32:
        values = torch.frombuffer(bytearray(pb.data), dtype=torch.float32)
    elif wire is WireDType.F16:
        values = torch.frombuffer(bytearray(pb.data), dtype=torch.float16)
    elif wire is WireDType.BF16:
        values = torch.frombuffer(bytearray(pb.data), dtype=torch.int16).view(torch.bfloat16)
    else:
        q = torch.frombuffer(bytearray(pb.data), dtype=torch.int8).view(-1, shape[-1])
        scale = torch.frombuffer(bytearray(pb.scales), dtype=torch.float32)
        values = q.to(torch.float32).mul_(scale.unsqueeze(1))
    return values.view(shape).to(out_dtype)
