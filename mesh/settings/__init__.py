"""One configuration tree (docs/operations.md, "Configuration"): sections of frozen
dataclasses resolved once per process from CLI > environment > TOML > built-in, every
value with its source."""

from mesh.settings.sections import (
    LOCAL_STAGE_FIELDS,
    SECTIONS,
    SERVING_FIELDS,
    CoordinatorConfig,
    FrontendConfig,
    StageConfig,
    kv_sessions,
)
from mesh.settings.tree import BUILT_IN, Resolved, add_arguments, describe, resolve

__all__ = [
    "BUILT_IN",
    "LOCAL_STAGE_FIELDS",
    "SECTIONS",
    "SERVING_FIELDS",
    "CoordinatorConfig",
    "FrontendConfig",
    "Resolved",
    "StageConfig",
    "add_arguments",
    "describe",
    "kv_sessions",
    "resolve",
]
