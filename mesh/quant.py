"""Weight-only quantisation formats shared by the package builder and the runtime.

Plain torch, no I/O. A quantised matrix ``W [N, K]`` (``N`` outputs, ``K`` inputs)
is stored as named parts next to the weight's name (``<name>.qweight`` ...):

- ``int4`` (group-wise, asymmetric): ``qweight`` uint8 ``[N, K/2]`` holding two
  4-bit codes per byte (the even column in the high nibble), ``scales`` and ``mins``
  float16 ``[N, K/group]``; ``W[n, k] = q * scale + min`` for the group of ``k``.
  GGUF's Q4_0, Q4_1 and Q4_K blocks are exactly of this form with group 32.
- ``int8`` (per output channel, symmetric): ``qweight`` int8 ``[N, K]`` and
  ``scales`` float32 ``[N]``; ``W[n, k] = q * scale[n]``. This is the layout torch's
  own int8 weight-only kernel takes.
- ``int8g`` (group-wise, symmetric), used for embedding tables, which are only ever
  gathered row by row: ``qweight`` int8 ``[N, K]``, ``scales`` float16
  ``[N, K/group]``. GGUF's Q8_0 blocks are exactly of this form with group 32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mesh.errors import InvalidRequest

QUANT_SCHEMES = ("int8", "int4")
INT4_GROUP_SIZES = (32, 64, 128, 256)
DEFAULT_INT4_GROUP = 32
EMBED_GROUP = 32
PART_SUFFIXES = (".qweight", ".scales", ".mins")


@dataclass(frozen=True)
class QuantScheme:
    """How a package's weights are stored: decoder-layer linears as ``kind`` (int8 or
    int4, ``group_size`` the int4 group; int8 scales whole rows), the LM head as
    ``head`` (int8 by default: it moves next-token probabilities most), embeddings
    as int8 groups of ``EMBED_GROUP``."""

    kind: str
    group_size: int
    head: str = "int8"

    def to_json(self) -> dict[str, object]:
        return {
            "linear": self.kind,
            "group_size": self.group_size,
            "head": self.head,
            "embed": "int8g",
        }

    @classmethod
    def from_json(cls, body: object, origin: str) -> QuantScheme:
        from mesh.errors import PackageError

        if not isinstance(body, dict):
            raise PackageError(f"{origin}: quantization must be an object")
        try:
            kind = str(body["linear"])
            return make_scheme(kind, int(body["group_size"]), str(body.get("head", kind)))
        except (KeyError, TypeError, ValueError, InvalidRequest) as error:
            raise PackageError(f"{origin}: malformed quantization {body!r}: {error}") from error


def make_scheme(kind: str, group_size: int | None = None, head: str | None = None) -> QuantScheme:
    """Check a scheme name, group size and head form, with the defaults (int4 group
    32, int8 head)."""
    if kind not in QUANT_SCHEMES:
        raise InvalidRequest(f"quant {kind!r} is not one of {', '.join(QUANT_SCHEMES)}")
    head = head or "int8"
    if head not in QUANT_SCHEMES:
        raise InvalidRequest(f"head quant {head!r} is not one of {', '.join(QUANT_SCHEMES)}")
    if kind == "int8":
        if group_size not in (None, 0):
            raise InvalidRequest(
                "int8 scales whole rows (torch's int8 kernel has no groups); drop --group-size"
            )
        if head != "int8":
            raise InvalidRequest("an int8 package keeps an int8 head; drop --head-quant")
        return QuantScheme("int8", 0, "int8")
    group = DEFAULT_INT4_GROUP if group_size in (None, 0) else int(group_size)
    if group not in INT4_GROUP_SIZES:
        raise InvalidRequest(
            f"int4 group size {group} is not supported; use one of "
            + ", ".join(map(str, INT4_GROUP_SIZES))
        )
    return QuantScheme("int4", group, head)


def check_groups(shape: tuple[int, ...], group: int, what: str) -> None:
    if len(shape) != 2 or shape[1] % group != 0:
        raise InvalidRequest(
            f"{what} has shape {shape}: its input size is not a multiple of the group "
            f"size {group}; choose a group size that divides it"
        )


# ---- int4 -------------------------------------------------------------------------


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` integer codes in 0..15 -> uint8 ``[N, K/2]``, even column high."""
    codes = codes.to(torch.uint8)
    return (codes[:, 0::2] << 4) | codes[:, 1::2]


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, K/2]`` -> int32 codes ``[N, K]``."""
    high = (packed >> 4).to(torch.int32)
    low = (packed & 0x0F).to(torch.int32)
    return torch.stack((high, low), dim=-1).reshape(packed.shape[0], -1)


def _scale_up(scales: torch.Tensor) -> torch.Tensor:
    """float32 ``scales`` as float16, rounded up where rounding to nearest went down
    (a group's largest value then still fits the codes: in float16's subnormal range
    a scale rounded down clipped its group's ends)."""
    stored = scales.to(torch.float16)
    low = stored.float() < scales
    return torch.where(low, torch.nextafter(stored, torch.full_like(stored, torch.inf)), stored)


def _divisor(scales: torch.Tensor) -> torch.Tensor:
    """The stored float16 ``scales`` as float32 divisors: exactly what dequantisation
    multiplies by (subnormals included), and 1 where a scale is 0 (a group of equal
    values, whose codes are then 0)."""
    stored = scales.float()
    return torch.where(stored == 0, torch.ones_like(stored), stored)


def quantize_int4(weight: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    """Round-to-nearest asymmetric 4-bit codes per group of ``group`` inputs."""
    check_groups(tuple(weight.shape), group, "int4 weight")
    rows, cols = weight.shape
    grouped = weight.detach().to(torch.float32).reshape(rows, cols // group, group)
    low = grouped.amin(dim=-1)
    high = grouped.amax(dim=-1)
    scales = _scale_up((high - low) / 15)
    mins = low.to(torch.float16)
    # Codes are chosen against the float16 scale and min actually stored (a scale
    # below float16's smallest normal is stored as a subnormal: dividing by a clamped
    # one shrank such groups up to 2x and more).
    scale32 = _divisor(scales).unsqueeze(-1)
    codes = ((grouped - mins.float().unsqueeze(-1)) / scale32).round().clamp(0, 15)
    return {
        "qweight": pack_int4(codes.reshape(rows, cols)),
        "scales": scales,
        "mins": mins,
    }


def dequantize_int4(parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    codes = unpack_int4(parts["qweight"]).to(torch.float32)
    rows, cols = codes.shape
    groups = parts["scales"].shape[1]
    grouped = codes.reshape(rows, groups, cols // groups)
    weight = grouped * parts["scales"].float().unsqueeze(-1) + parts["mins"].float().unsqueeze(-1)
    return weight.reshape(rows, cols).to(dtype)


# ---- int8 -------------------------------------------------------------------------


def quantize_int8(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """Symmetric 8-bit codes with one scale per output row."""
    if weight.dim() != 2:
        raise InvalidRequest(f"int8 weight must be 2-D, got shape {tuple(weight.shape)}")
    values = weight.detach().to(torch.float32)
    scales = (values.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    codes = (values / scales.unsqueeze(1)).round().clamp(-127, 127).to(torch.int8)
    return {"qweight": codes, "scales": scales}


def dequantize_int8(parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    return (parts["qweight"].to(torch.float32) * parts["scales"].float().unsqueeze(1)).to(dtype)


def quantize_int8_groups(weight: torch.Tensor, group: int = EMBED_GROUP) -> dict[str, torch.Tensor]:
    """Symmetric 8-bit codes with one float16 scale per group of ``group`` inputs."""
    check_groups(tuple(weight.shape), group, "int8 embedding")
    rows, cols = weight.shape
    grouped = weight.detach().to(torch.float32).reshape(rows, cols // group, group)
    scales = _scale_up(grouped.abs().amax(dim=-1) / 127)
    scale32 = _divisor(scales).unsqueeze(-1)
    codes = (grouped / scale32).round().clamp(-127, 127).to(torch.int8)
    return {"qweight": codes.reshape(rows, cols), "scales": scales}


def dequantize_int8_groups(
    parts: dict[str, torch.Tensor], dtype: torch.dtype, rows: torch.Tensor | None = None
) -> torch.Tensor:
    """The float rows ``rows`` (all when None) of a group-wise int8 table."""
    codes, scales = parts["qweight"], parts["scales"]
    if rows is not None:
        codes, scales = codes[rows], scales[rows]
    count, cols = codes.shape
    groups = scales.shape[1]
    grouped = codes.to(torch.float32).reshape(count, groups, cols // groups)
    return (grouped * scales.float().unsqueeze(-1)).reshape(count, cols).to(dtype)


# ---- parts ------------------------------------------------------------------------


def part_names(name: str, kind: str) -> tuple[str, ...]:
    """Stored tensor names of a weight quantised with ``kind`` (int4, int8, int8g)."""
    suffixes = PART_SUFFIXES if kind == "int4" else PART_SUFFIXES[:2]
    return tuple(name + suffix for suffix in suffixes)


def split_parts(tensors: dict[str, torch.Tensor], name: str) -> dict[str, torch.Tensor] | None:
    """The parts of quantised weight ``name`` in ``tensors`` (keys without the name),
    or None when ``name`` is stored as a plain tensor."""
    found = {
        suffix[1:]: tensors[name + suffix] for suffix in PART_SUFFIXES if name + suffix in tensors
    }
    return found or None
