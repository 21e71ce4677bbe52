"""Speculation config: schema, validation and resolution from every source.

Sources, highest precedence first (each key is merged on its own):

1. CLI flags (``--spec-type``, ``--draft-model``, ``--max-window`` ...)
2. ``[models."<model id>".speculative]`` in the TOML file given with ``--config``
3. ``[defaults.speculative]`` in that file
4. the package manifest's ``generation.speculative_decoding`` (its ``default``
   strategy, or the one named by a ``strategy`` key above)
5. the built-in default: the suffix drafter, auto gating on, cost-aware window policy

On stage 0 the coordinator's sources (its flags and TOML tables, sent with the
Load) sit between 3 and 4: stage 0's own flags and TOML come first.

This module is plain Python (no torch): the CLI imports it before anything heavy.
"""

from __future__ import annotations

import argparse
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mesh.errors import InvalidRequest, PackageError

STRATEGY_TYPES = ("draft-model", "ngram", "composite", "suffix", "none")
DRAFT_TYPES = ("draft-model", "composite")
POLICY_NAMES = ("fixed", "adaptive", "cost")
MAX_WINDOW_LIMIT = 64
NGRAM_LIMIT = 32
CORPUS_TOKENS_LIMIT = 1 << 30
CORPUS_SCOPES = ("user", "global")

STRATEGY_KEYS = ("type", "draft_model", "ngram_min", "ngram_max", "ngram_memory", "p_min")
STRATEGY_KEYS += ("auto", "window_policy", "corpus_tokens", "corpus_scope")
WINDOW_KEYS = ("default", "initial_window", "min_window", "max_window")
# CLI flag name (argparse dest) -> flat config key.
CLI_KEYS = {
    "spec_type": "type",
    "spec_strategy": "strategy",
    "spec_auto": "auto",
    "draft_model": "draft_model",
    "ngram_min": "ngram_min",
    "ngram_max": "ngram_max",
    "ngram_memory": "ngram_memory",
    "p_min": "p_min",
    "corpus_tokens": "corpus_tokens",
    "corpus_scope": "corpus_scope",
    "window_policy": "window_policy.default",
    "initial_window": "window_policy.initial_window",
    "min_window": "window_policy.min_window",
    "max_window": "window_policy.max_window",
}

BUILTIN_ORIGIN = "built-in default"
BUILTIN = {
    "type": "suffix",
    "ngram_min": 2,
    "ngram_max": 6,
    "ngram_memory": True,
    "p_min": 0.0,
    "auto": True,
    "corpus_tokens": 1_000_000,
    "corpus_scope": "user",
    "window_policy.default": "cost",
    "window_policy.initial_window": 4,
    "window_policy.min_window": 1,
    "window_policy.max_window": 16,
}

_REPO_RE = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
_QUANT_RE = re.compile(r"^[A-Za-z0-9][\w.-]*$")


@dataclass(frozen=True)
class DraftRef:
    """Where a draft model comes from: an HF repo (optionally one GGUF quant of it) or
    a local directory / ``.gguf`` file."""

    repo_or_path: str
    quant: str | None = None
    is_local: bool = False

    def __str__(self) -> str:
        return f"{self.repo_or_path}:{self.quant}" if self.quant else self.repo_or_path


def parse_draft_ref(text: str, key: str = "draft_model") -> DraftRef:
    """Parse ``org/repo``, ``org/repo:QUANT`` or a local path.

    A local path starts with ``/``, ``./``, ``../`` or ``~``; anything else is a hub id.
    """
    if not isinstance(text, str) or not text.strip():
        raise InvalidRequest(f"{key} must be a non-empty string (org/repo, org/repo:QUANT or path)")
    text = text.strip()
    if text.startswith(("/", "./", "../", "~")) or text in (".", ".."):
        return DraftRef(repo_or_path=text, quant=None, is_local=True)
    repo, _, quant = text.partition(":")
    if not _REPO_RE.match(repo) or (quant and not _QUANT_RE.match(quant)) or text.endswith(":"):
        raise InvalidRequest(
            f"{key} {text!r} is neither a hub id (org/repo or org/repo:QUANT) nor a local "
            "path; write local paths as /abs/path or ./relative/path"
        )
    return DraftRef(repo_or_path=repo, quant=quant or None, is_local=False)


@dataclass(frozen=True)
class WindowPolicySpec:
    """Window policy settings; ``fixed`` uses ``initial_window`` as its constant W."""

    default: str = "cost"
    initial_window: int = 4
    min_window: int = 1
    max_window: int = 16


@dataclass(frozen=True)
class SpeculationConfig:
    """The resolved speculation settings of stage 0 for one model."""

    type: str = "suffix"
    draft_model: DraftRef | None = None
    ngram_min: int = 2
    ngram_max: int = 6
    ngram_memory: bool = True
    p_min: float = 0.0
    auto: bool = True
    corpus_tokens: int = 1_000_000
    corpus_scope: str = "user"
    window_policy: WindowPolicySpec = WindowPolicySpec()
    strategy: str | None = None
    origins: tuple[tuple[str, str], ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def enabled(self) -> bool:
        return self.type != "none"

    def origin(self, key: str) -> str:
        """Which source set ``key`` (``"window_policy.max_window"`` for nested keys)."""
        return dict(self.origins).get(key, BUILTIN_ORIGIN)

    def describe(self) -> str:
        """One line for the startup log."""
        if not self.enabled:
            return f"speculation off (type from {self.origin('type')})"
        wp = self.window_policy
        draft = f" draft={self.draft_model}" if self.draft_model else ""
        if self.type == "suffix":
            draft = f" corpus={self.corpus_tokens}/{self.corpus_scope}"
        return (
            f"speculation type={self.type}{draft} ngram=[{self.ngram_min},{self.ngram_max}] "
            f"auto={self.auto} policy={wp.default}({wp.initial_window},{wp.min_window},"
            f"{wp.max_window}) strategy={self.strategy or '-'}"
        )


# ---- per-layer validation ------------------------------------------------------------


def _check_int(value: Any, key: str, where: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidRequest(f"{where}: {key} must be an integer in [{low}, {high}], got {value!r}")
    return value


def _check_bool(value: Any, key: str, where: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidRequest(f"{where}: {key} must be true or false, got {value!r}")
    return value


def _check_choice(value: Any, key: str, where: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise InvalidRequest(f"{where}: {key} must be one of {', '.join(choices)}; got {value!r}")
    return value


def _check_value(key: str, value: Any, where: str) -> Any:
    if key == "type":
        return _check_choice(value, key, where, STRATEGY_TYPES)
    if key == "draft_model":
        return parse_draft_ref(value, key=f"{where}: draft_model")
    if key in ("ngram_min", "ngram_max"):
        return _check_int(value, key, where, 1, NGRAM_LIMIT)
    if key in ("ngram_memory", "auto"):
        return _check_bool(value, key, where)
    if key == "p_min":
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1:
            raise InvalidRequest(f"{where}: p_min must be a number in [0, 1), got {value!r}")
        return float(value)
    if key == "strategy":
        if not isinstance(value, str) or not value:
            raise InvalidRequest(f"{where}: strategy must be a non-empty strategy name")
        return value
    if key == "window_policy.default":
        return _check_choice(value, key, where, POLICY_NAMES)
    if key == "corpus_tokens":
        return _check_int(value, key, where, 0, CORPUS_TOKENS_LIMIT)
    if key == "corpus_scope":
        return _check_choice(value, key, where, CORPUS_SCOPES)
    # A window of at most 0 drafts would never draft: speculation off says that.
    low = 1 if key == "window_policy.max_window" else 0
    return _check_int(value, key, where, low, MAX_WINDOW_LIMIT)


def flatten_layer(table: Any, where: str, allow_strategy: bool) -> dict[str, Any]:
    """Validate one source's speculation table and flatten ``window_policy`` into
    ``window_policy.<key>`` entries. ``where`` names the source in errors."""
    if not isinstance(table, dict):
        raise InvalidRequest(f"{where} must be a table of speculation settings, got {table!r}")
    known = STRATEGY_KEYS + (("strategy",) if allow_strategy else ())
    flat: dict[str, Any] = {}
    for key, value in table.items():
        if key not in known:
            raise InvalidRequest(f"{where}: unknown key {key!r}; known keys: {', '.join(known)}")
        if key != "window_policy":
            flat[key] = _check_value(key, value, where)
            continue
        if isinstance(value, str):
            value = {"default": value}
        if not isinstance(value, dict):
            raise InvalidRequest(f"{where}: window_policy must be a table or a policy name")
        for sub, sub_value in value.items():
            if sub not in WINDOW_KEYS:
                raise InvalidRequest(
                    f"{where}: unknown key window_policy.{sub}; known: {', '.join(WINDOW_KEYS)}"
                )
            flat[f"window_policy.{sub}"] = _check_value(f"window_policy.{sub}", sub_value, where)
    return flat


def parse_package_speculation(generation: dict[str, Any] | None) -> tuple[str | None, dict]:
    """The package's ``(default strategy name, {name: flat settings})``; ``(None, {})``
    when the package declares none. Raises PackageError on a malformed block."""
    if not generation or "speculative_decoding" not in generation:
        return None, {}
    where = "package generation.speculative_decoding"
    block = generation["speculative_decoding"]
    if not isinstance(block, dict) or not isinstance(block.get("strategies"), dict):
        raise PackageError(f"{where} must be an object with a 'strategies' object")
    unknown = sorted(set(block) - {"default", "strategies"})
    if unknown:
        raise PackageError(f"{where}: unknown key(s) {', '.join(unknown)}")
    try:
        strategies = {
            name: flatten_layer(body, f"{where}.strategies.{name}", False)
            for name, body in block["strategies"].items()
        }
    except InvalidRequest as problem:
        raise PackageError(f"{problem.message}; rebuild the package with valid settings") from None
    default = block.get("default")
    if default is None and len(strategies) == 1:
        default = next(iter(strategies))
    if default is not None and default not in strategies:
        raise PackageError(
            f"{where}: default {default!r} is not a declared strategy "
            f"({', '.join(strategies) or 'none declared'})"
        )
    return default, strategies


# ---- TOML and CLI ---------------------------------------------------------------------


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read a ``mesh.toml`` file; InvalidRequest when it is missing or malformed."""
    path = Path(path)
    try:
        with open(path, "rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError as error:
        raise InvalidRequest(f"config file {path} not found; check the --config path") from error
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise InvalidRequest(f"config file {path} is not valid TOML: {error}") from error
    except OSError as error:
        raise InvalidRequest(
            f"config file {path} cannot be read ({error.strerror}); --config takes a TOML file"
        ) from error


def toml_layers(toml: dict[str, Any], model_id: str) -> list[tuple[str, dict[str, Any]]]:
    """The TOML's speculation layers, lowest precedence first. Every model's table is
    validated, not only ``model_id``'s, so a typo anywhere is reported at start."""
    layers: list[tuple[str, dict[str, Any]]] = []
    defaults = toml.get("defaults", {})
    if not isinstance(defaults, dict):
        raise InvalidRequest("config: [defaults] must be a table")
    _only_speculative(defaults, "[defaults]")
    if "speculative" in defaults:
        where = "[defaults.speculative]"
        layers.append((where, flatten_layer(defaults["speculative"], where, True)))
    models = toml.get("models", {})
    if not isinstance(models, dict):
        raise InvalidRequest('config: [models] must be a table of [models."<model id>"] tables')
    for name, entry in models.items():
        if not isinstance(entry, dict):
            raise InvalidRequest(f'config: [models."{name}"] must be a table')
        if name == "speculative" and "speculative" not in entry:
            raise InvalidRequest(
                "config: [models.speculative] names a model called 'speculative'; a model's "
                'settings go in [models."<model id>".speculative]'
            )
        _only_speculative(entry, f'[models."{name}"]')
        if "speculative" in entry:
            where = f'[models."{name}".speculative]'
            flat = flatten_layer(entry["speculative"], where, True)
            if name == model_id:
                layers.append((where, flat))
    return layers


TOML_TABLES = ("coordinator", "stage", "frontend", "defaults", "models", "security")


def check_toml(toml: dict[str, Any], source: str = "config") -> None:
    """Refuse a config with a table or key this version does not know (a typo would
    otherwise be ignored) and check every speculation table; run when ``up`` and
    ``join`` start. ``[security]``'s keys are checked by mesh.security."""
    from mesh.settings.sections import SECTIONS
    from mesh.settings.tree import check_table

    unknown = sorted(set(toml) - set(TOML_TABLES))
    if unknown:
        raise InvalidRequest(
            f"{source}: unknown table(s) or key(s) {', '.join(unknown)}; known tables: "
            f"{', '.join(TOML_TABLES)}"
        )
    for section, cls in SECTIONS.items():
        if section in toml:
            check_table(cls, section, toml[section], source)
    toml_layers(toml, "")


def speculation_layers(
    cli: dict[str, Any], toml: dict[str, Any], model_id: str
) -> list[tuple[str, dict[str, Any]]]:
    """The speculation sources above the package, lowest first, checked: the TOML's
    tables for ``model_id`` and the CLI flags. The coordinator sends them to stage 0
    with its Load (values as given: a draft model as its reference text)."""
    layers = [*toml_layers(toml, model_id), ("CLI", _cli_layer(cli))]
    return [
        (where, {k: str(v) if isinstance(v, DraftRef) else v for k, v in flat.items()})
        for where, flat in layers
        if flat
    ]


def _only_speculative(table: dict[str, Any], where: str) -> None:
    unknown = sorted(set(table) - {"speculative"})
    if unknown:
        raise InvalidRequest(
            f"config: unknown key(s) {', '.join(unknown)} in {where}; it holds only a "
            "speculative table"
        )


def add_speculation_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the speculation flags; their dests are the keys of ``CLI_KEYS``."""
    group = parser.add_argument_group("speculative decoding")
    group.add_argument("--spec-type", choices=STRATEGY_TYPES, help="strategy type")
    group.add_argument("--spec-strategy", help="pick a strategy the package declares, by name")
    group.add_argument("--spec-auto", action=argparse.BooleanOptionalAction, default=None)
    group.add_argument("--draft-model", help="org/repo, org/repo:QUANT or a local path")
    group.add_argument("--no-draft", action="store_true", help="ignore package-declared drafts")
    group.add_argument("--ngram-min", type=int)
    group.add_argument("--ngram-max", type=int)
    group.add_argument("--ngram-memory", action=argparse.BooleanOptionalAction, default=None)
    group.add_argument("--p-min", type=float, help="stop drafting below this probability")
    group.add_argument("--corpus-tokens", type=int, help="suffix drafter's corpus (0: off)")
    group.add_argument("--corpus-scope", choices=CORPUS_SCOPES, help="share it per user or all")
    group.add_argument("--window-policy", choices=POLICY_NAMES)
    group.add_argument("--initial-window", type=int)
    group.add_argument("--min-window", type=int)
    group.add_argument("--max-window", type=int)


def cli_speculation_args(namespace: argparse.Namespace) -> dict[str, Any]:
    """The speculation flags the user gave (None means not given)."""
    return {k: getattr(namespace, k) for k in CLI_KEYS if getattr(namespace, k, None) is not None}


# ---- resolution ------------------------------------------------------------------------


def _cli_layer(cli: dict[str, Any]) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for name, value in cli.items():
        if name not in CLI_KEYS:
            raise InvalidRequest(f"unknown speculation flag {name!r}; known: {', '.join(CLI_KEYS)}")
        if value is None:
            continue
        key = CLI_KEYS[name]
        flag = "--" + name.replace("_", "-")
        flat[key] = _check_value(key, value, f"CLI {flag}")
    return flat


def _package_layer(
    package_generation: dict[str, Any] | None, strategy: tuple[str, str] | None, no_draft: bool
) -> tuple[str | None, dict[str, Any], list[str]]:
    default, strategies = parse_package_speculation(package_generation)
    notes: list[str] = []
    if strategy is not None:
        name, where = strategy
        if name not in strategies:
            raise InvalidRequest(
                f"{where}: strategy {name!r} is not declared by the package "
                f"(it declares: {', '.join(strategies) or 'none'})"
            )
    else:
        name = default
    if name is None:
        return None, {}, notes
    layer = strategies[name]
    if no_draft and layer.get("type") in DRAFT_TYPES:
        ngrams = [n for n, body in strategies.items() if body.get("type") == "ngram"]
        notes.append(f"--no-draft: package strategy {name!r} uses a draft model; ignored")
        if not ngrams:
            return None, {}, notes
        name = ngrams[0]
        notes.append(f"--no-draft: using the package's n-gram strategy {name!r}")
        layer = strategies[name]
    return name, layer, notes


def resolve_speculation(
    cli: dict[str, Any],
    toml: dict[str, Any],
    model_id: str,
    package_generation: dict[str, Any] | None,
    no_draft: bool = False,
    lower: list[tuple[str, dict[str, Any]]] | tuple = (),
) -> SpeculationConfig:
    """Merge every source key by key (see the module docstring) and validate the result.

    ``cli`` maps ``CLI_KEYS`` names to values (None = not given). ``no_draft`` drops
    any draft model (the package's n-gram strategy, else the built-in n-gram, is used).
    ``lower``: layers another process resolved (the coordinator's, sent with the
    Load: ``speculation_layers``), below this process's TOML and CLI.
    """
    cli_flat = _cli_layer(cli)
    if no_draft and (cli_flat.get("type") in DRAFT_TYPES or "draft_model" in cli_flat):
        raise InvalidRequest("--no-draft conflicts with --draft-model / --spec-type with a draft")
    sent = [
        (where, {key: _check_value(key, value, where) for key, value in flat.items()})
        for where, flat in lower
    ]
    upper = [*sent, *toml_layers(toml, model_id), ("CLI", cli_flat)]
    strategy = None
    for where, layer in upper:
        if "strategy" in layer:
            strategy = (layer["strategy"], where)
    try:
        name, package, notes = _package_layer(package_generation, strategy, no_draft)
    except PackageError as problem:
        # A package block that cannot be used is the package's problem, not a reason
        # to stop serving: it is left out, with a warning.
        name, package = None, {}
        notes = [f"the package's speculation block is left out: {problem.message}"]

    values: dict[str, Any] = dict(BUILTIN)
    origins: dict[str, str] = {}
    layers = [(f"package strategy {name!r}", package), *upper]
    rank = {BUILTIN_ORIGIN: 0, **{where: i + 1 for i, (where, _) in enumerate(layers)}}
    for where, layer in layers:
        for key, value in layer.items():
            if key != "strategy":
                values[key] = value
                origins[key] = where

    if no_draft and values["type"] in DRAFT_TYPES:
        notes.append(f"--no-draft: type {values['type']!r} from {origins['type']} -> ngram")
        values["type"] = "ngram"
        origins["type"] = "--no-draft"
    _clamp_windows(values, origins, rank, notes)
    return _finish(values, origins, name, notes)


_WINDOW_ORDER = (
    ("window_policy.min_window", "window_policy.initial_window"),
    ("window_policy.initial_window", "window_policy.max_window"),
    ("window_policy.min_window", "window_policy.max_window"),
)


def _clamp_windows(
    values: dict[str, Any], origins: dict[str, str], rank: dict[str, int], notes: list[str]
) -> None:
    """Where window sizes from different sources conflict (``--max-window 8`` under a
    package's ``initial_window`` 16), the one from the lower-precedence source moves
    to the other's value, with a note. Conflicts within one source are left for
    ``_finish`` to refuse."""
    for _ in range(len(_WINDOW_ORDER)):
        for low, high in _WINDOW_ORDER:
            if values[low] <= values[high]:
                continue
            low_rank = rank.get(origins.get(low, BUILTIN_ORIGIN), 0)
            high_rank = rank.get(origins.get(high, BUILTIN_ORIGIN), 0)
            if low_rank == high_rank:
                continue
            moved, to = (low, high) if low_rank < high_rank else (high, low)
            notes.append(
                f"{moved}={values[moved]} from {origins.get(moved, BUILTIN_ORIGIN)} clamped to "
                f"{values[to]} ({to} from {origins.get(to, BUILTIN_ORIGIN)})"
            )
            values[moved] = values[to]
            origin = origins.get(moved, BUILTIN_ORIGIN)
            origins[moved] = origin if origin.endswith(", clamped") else f"{origin}, clamped"
            rank[origins[moved]] = low_rank if moved == low else high_rank


def _finish(
    values: dict[str, Any], origins: dict[str, str], name: str | None, notes: list[str]
) -> SpeculationConfig:
    def who(key: str) -> str:
        return f"{key}={values.get(key)!r} from {origins.get(key, BUILTIN_ORIGIN)}"

    if values["ngram_min"] > values["ngram_max"]:
        raise InvalidRequest(f"speculation: {who('ngram_min')} exceeds {who('ngram_max')}")
    lo, init, hi = (
        values[f"window_policy.{k}"] for k in ("min_window", "initial_window", "max_window")
    )
    if not lo <= init <= hi:
        raise InvalidRequest(
            "speculation: window sizes must satisfy min_window <= initial_window <= max_window; "
            f"got {who('window_policy.min_window')}, {who('window_policy.initial_window')}, "
            f"{who('window_policy.max_window')}"
        )
    if lo < 1:
        raise InvalidRequest(
            f'speculation: {who("window_policy.min_window")} must be >= 1 (use type = "none" '
            "to turn speculation off; the cost policy switches itself off when it does not pay)"
        )
    if values["type"] in DRAFT_TYPES and values.get("draft_model") is None:
        raise InvalidRequest(
            f"speculation: {who('type')} needs draft_model (org/repo, org/repo:QUANT or a path)"
        )
    draft = values.get("draft_model") if values["type"] in DRAFT_TYPES else None
    return SpeculationConfig(
        type=values["type"],
        draft_model=draft,
        ngram_min=values["ngram_min"],
        ngram_max=values["ngram_max"],
        ngram_memory=values["ngram_memory"],
        p_min=values["p_min"],
        auto=values["auto"],
        corpus_tokens=values["corpus_tokens"],
        corpus_scope=values["corpus_scope"],
        window_policy=WindowPolicySpec(
            default=values["window_policy.default"],
            initial_window=init,
            min_window=lo,
            max_window=hi,
        ),
        strategy=name,
        origins=tuple(sorted(origins.items())),
        notes=tuple(notes),
    )
