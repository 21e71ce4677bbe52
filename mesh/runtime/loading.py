"""Build a ``StageRuntime`` from a model package (or from tensors in memory)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import PretrainedConfig

from mesh.errors import PackageError
from mesh.package.manifest import PackageManifest
from mesh.quant import QuantScheme
from mesh.runtime.skeleton import build_stage_modules, load_config, resolve_device, resolve_dtype
from mesh.runtime.stage import StageRuntime, sliding_window
from mesh.runtime.weights import PackageWeights, WeightSource
from mesh.types import LayerRange

logger = logging.getLogger(__name__)


def _is_sliding(config: PretrainedConfig, layer_index: int, window: int | None) -> bool:
    if window is None:
        return False
    layer_types = getattr(config, "layer_types", None)
    return not layer_types or layer_types[layer_index] == "sliding_attention"


def prepare_cuda_attention() -> None:
    """Keep PyTorch's attention off its cuDNN backend in this process.

    That backend prepares a cuDNN graph for every new query/key shape (kept by
    shape). A serving stage's key lengths grow by one position at every decode step
    and its frames mix sessions of every length, so new shapes never stop coming (see
    docs/benchmarks.md, "A mesh on a GPU", for the slow phase this matches). The
    flash, memory-efficient and math backends prepare nothing per shape, and PyTorch
    picks among them as before."""
    torch.backends.cuda.enable_cudnn_sdp(False)


def build_stage_runtime(
    config: PretrainedConfig,
    weights: WeightSource,
    layer_range: LayerRange,
    device: str = "cpu",
    dtype: str = "float32",
    max_sessions: int = 64,
    max_tokens_per_session: int | None = None,
    clock: Callable[[], float] = time.monotonic,
    scheme: QuantScheme | None = None,
) -> StageRuntime:
    """A runtime for ``layer_range`` of the model described by ``config``, with tensors
    from ``weights`` (a package, or an in-memory state dict in tests) stored as
    ``scheme`` says (None: plain tensors)."""
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype)
    if torch_device.type == "cuda":
        prepare_cuda_attention()
    window = sliding_window(config)
    sliding = frozenset(i for i in layer_range if _is_sliding(config, i, window))
    modules = build_stage_modules(
        config, weights, layer_range, torch_device, torch_dtype, sliding, scheme
    )
    return StageRuntime(
        config,
        modules,
        layer_range,
        torch_device,
        dtype,
        max_sessions=max_sessions,
        max_tokens_per_session=max_tokens_per_session,
        clock=clock,
    )


def load_stage_runtime(
    package_dir: Path,
    layer_range: LayerRange,
    device: str = "cpu",
    dtype: str = "auto",
    max_sessions: int = 64,
    max_tokens_per_session: int | None = None,
    compile: bool = False,
    cuda_graphs: bool = False,
) -> StageRuntime:
    """Load the slice ``layer_range`` of a model package into a runtime. ``dtype``
    ``auto`` picks the compute dtype from the package (``PackageManifest.compute_dtype``);
    ``compile`` runs decode steps through torch.compile where it works, compiling
    them here rather than on the first request; ``cuda_graphs`` replays them as CUDA
    graphs on a CUDA device, after checking a replay against an eager step."""
    started = time.perf_counter()
    package_dir = Path(package_dir)
    config = load_config(package_dir)
    manifest = PackageManifest.load(package_dir)
    if manifest.layer_count != config.num_hidden_layers:
        raise PackageError(
            f"{package_dir}: manifest says {manifest.layer_count} layers, config.json says "
            f"{config.num_hidden_layers}; rebuild the package"
        )
    dtype = manifest.compute_dtype(dtype)
    runtime = build_stage_runtime(
        config,
        PackageWeights(package_dir, manifest),
        layer_range,
        device=device,
        dtype=dtype,
        max_sessions=max_sessions,
        max_tokens_per_session=max_tokens_per_session,
        scheme=manifest.scheme(),
    )
    if runtime.row_invariant and (compile or cuda_graphs):
        logger.warning(
            "compiled and CUDA-graph decode steps use other kernels than batched rows: "
            "answers may change with load and speculation (see --row-invariant)"
        )
    if compile:
        runtime.enable_compile()
        runtime.warm_up()
    if cuda_graphs and runtime.enable_cuda_graphs():
        runtime.check_graphs()
    logger.info(
        "loaded %s layers %s on %s/%s (%s, row-invariant %s): %s parameter bytes in %.2fs",
        manifest.model_id,
        layer_range,
        device,
        dtype,
        "plain" if manifest.quantization is None else manifest.quantization["linear"],
        "on" if runtime.row_invariant else "off",
        runtime.param_bytes,
        time.perf_counter() - started,
    )
    return runtime
