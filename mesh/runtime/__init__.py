"""Run a layer range of an HF decoder model with per-session KV caches."""

from mesh.runtime.loading import build_stage_runtime, load_stage_runtime
from mesh.runtime.sessions import KVLayout, SessionCache, SessionTable
from mesh.runtime.skeleton import StageModules, build_stage_modules, load_config
from mesh.runtime.spans import BatchOutput, Span
from mesh.runtime.stage import StageRuntime
from mesh.runtime.weights import PackageWeights, StateDictWeights, WeightSource

__all__ = [
    "BatchOutput",
    "Span",
    "KVLayout",
    "PackageWeights",
    "SessionCache",
    "SessionTable",
    "StageModules",
    "StageRuntime",
    "StateDictWeights",
    "WeightSource",
    "build_stage_modules",
    "build_stage_runtime",
    "load_config",
    "load_stage_runtime",
]
