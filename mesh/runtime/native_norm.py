"""RMSNorm on the stage's own CPU kernel (kernels/norm.c): one call per norm instead
of torch's four (to float32, rms_norm, back, times the weight), which at one decode
row cost about 20 us each, some 30 times per stage step (``benchmarks/step_bench.py``).

Same formula as transformers' RMSNorm (statistics in float32, the normalised value
rounded to the input dtype, then times the weight); each row is summed in one fixed
order, so a row's result does not depend on the rows beside it. Used where the
runtime computes row-invariantly with the stage's kernels (as the attention kernel,
``mesh/runtime/native_attention.py``); float32 and bfloat16 rows.
"""

from __future__ import annotations

import torch

from mesh.runtime import native, qkernels

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def usable(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel can normalise ``hidden`` (rows on its last dimension) with
    ``weight`` here."""
    return (
        qkernels.MODE != "torch"
        and hidden.device.type == "cpu"
        and hidden.dtype in _DTYPES
        and weight.dtype == hidden.dtype
        and weight.dim() == 1
        and weight.shape[0] == hidden.shape[-1]
        and weight.is_contiguous()
        and hidden.is_contiguous()
        and native.library() is not None
    )


def rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * dtype(hidden * rsqrt(mean(hidden^2) + eps))`` over the last
    dimension; call only where ``usable`` says so."""
    out = torch.empty_like(hidden)
    dim = hidden.shape[-1]
    rows = hidden.numel() // dim if dim else 0
    if rows:
        native.library().mesh_rms_norm(
            hidden.data_ptr(),
            _DTYPES[hidden.dtype],
            rows,
            dim,
            weight.data_ptr(),
            eps,
            out.data_ptr(),
        )
    return out
