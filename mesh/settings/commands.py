"""What every command shares around the tree: ``--config`` / ``--print-config``, the
TOML file read and checked once, and the resolved configuration of ``up`` and
``join``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mesh.errors import InvalidRequest
from mesh.settings.sections import (
    SERVING_FIELDS,
    CoordinatorConfig,
    FrontendConfig,
    StageConfig,
)
from mesh.settings.tree import Resolved, describe, resolve


class _SplitFlag(argparse.Action):
    """``--max-sessions`` had two meanings; it is refused with the names that replace it."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:  # noqa: ANN001
        parser.error(
            "--max-sessions is gone: --max-concurrent-requests limits the requests stage 0 "
            "runs at once; --kv-max-sessions (up) the sessions every stage keeps KV for"
        )


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        help="mesh.toml: [coordinator], [stage], [frontend], [security] and speculation tables",
    )
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print every setting, its value and where it came from, then exit",
    )
    parser.add_argument(
        "--max-sessions", action=_SplitFlag, default=argparse.SUPPRESS, help=argparse.SUPPRESS
    )


def read_config(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """The TOML given with ``--config`` (checked whole) and how errors name it."""
    from mesh.config import check_toml, load_toml

    path = getattr(args, "config", None)
    if path is None:
        return {}, "config"
    toml = load_toml(path)
    check_toml(toml, str(path))
    return toml, str(path)


@dataclass(frozen=True)
class UpConfig:
    coordinator: Resolved[CoordinatorConfig]
    stage: Resolved[StageConfig]
    frontend: Resolved[FrontendConfig]
    toml: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class JoinConfig:
    stage: Resolved[StageConfig]
    frontend: Resolved[FrontendConfig]
    toml: Mapping[str, Any] = field(default_factory=dict)


def print_config(sections: list[Resolved], extra: list[tuple[str, Any, str]] = ()) -> None:
    text = describe(sections)
    for key, value, origin in extra:
        text += f"\n{key}  {json.dumps(value)}  ({origin})"
    sys.stdout.write(text + "\n")


# ---- stage 0's serving settings, sent with the Load ------------------------------------

SERVING_PREFIX = "frontend."
SPECULATION_PREFIX = "speculation."
# The coordinator's --stall-timeout: stage 0 uses the same deadline to say 503 while
# a frame goes unanswered past it and no coordinator can be reached to act on it.
STALL_TIMEOUT_KEY = "coordinator.stall_timeout"


def serving_settings(
    frontend: Resolved[FrontendConfig], speculation: list[tuple[str, dict[str, Any]]]
) -> tuple[tuple[str, str, str], ...]:
    """``(key, JSON value, origin)`` triples the coordinator sends stage 0: the
    serving fields of [frontend] and the speculation layers it was given (lowest
    first; stage 0 merges them with the package's)."""
    out = [
        (SERVING_PREFIX + name, json.dumps(getattr(frontend.value, name)), frontend.origin(name))
        for name in SERVING_FIELDS
    ]
    for where, layer in speculation:
        for key, value in layer.items():
            out.append((SPECULATION_PREFIX + key, json.dumps(value), where))
    return tuple(out)


def merge_serving(
    own: Resolved[FrontendConfig], sent: tuple[tuple[str, str, str], ...]
) -> Resolved[FrontendConfig]:
    """Stage 0's [frontend]: what the process was given itself (CLI, environment, its
    TOML) wins; otherwise the coordinator's value, with its origin."""
    lower: dict[str, tuple[Any, str]] = {}
    for key, value, origin in sent:
        name = key.removeprefix(SERVING_PREFIX)
        if key.startswith(SERVING_PREFIX) and name in SERVING_FIELDS:
            lower[name] = (json.loads(value), f"coordinator: {origin}")
    given = {name: getattr(own.value, name) for name in own.origins}
    explicit = {name: (given[name], own.origins[name]) for name in given}
    merged = {**lower, **explicit}
    try:
        return resolve(FrontendConfig, own.section, lower=merged, env={})
    except InvalidRequest as error:
        raise InvalidRequest(f"stage 0's serving settings: {error.message}") from None


def sent_speculation(sent: tuple[tuple[str, str, str], ...]) -> list[tuple[str, dict[str, Any]]]:
    """The coordinator's speculation layers, lowest first, as ``(origin, flat keys)``."""
    layers: list[tuple[str, dict[str, Any]]] = []
    for key, value, origin in sent:
        if not key.startswith(SPECULATION_PREFIX):
            continue
        where = f"coordinator: {origin}"
        if not layers or layers[-1][0] != where:
            layers.append((where, {}))
        layers[-1][1][key.removeprefix(SPECULATION_PREFIX)] = json.loads(value)
    return layers


def sent_stall_timeout(sent: tuple[tuple[str, str, str], ...]) -> float:
    """The coordinator's stall timeout in seconds, as sent with the Load (0: the
    stall rule is off); the built-in default from a coordinator that sends none."""
    default = CoordinatorConfig.stall_timeout
    for key, value, _origin in sent:
        if key == STALL_TIMEOUT_KEY:
            try:
                seconds = float(json.loads(value))
            except (TypeError, ValueError):
                return default
            return seconds if seconds >= 0 else default
    return default
