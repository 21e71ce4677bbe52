"""The configuration tree's machinery: one frozen dataclass per section, one source of
truth per setting.

A section is a frozen dataclass whose fields are made with :func:`setting`. Each
field is at once a CLI flag (``--http-port`` for ``http_port``), a key of the TOML
table named after the section (``[frontend] http_port = 8000``) and an environment
variable (``MESH_FRONTEND_HTTP_PORT``); its default is written once, in the field.
:func:`resolve` merges the sources, highest first: CLI > environment > TOML >
built-in default, checks every value, and records where each came from, so that an
error (and ``--print-config``) names the key and its source.

Plain Python (no torch): the CLIs import it before anything heavy.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import logging
import os
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from mesh.errors import InvalidRequest

logger = logging.getLogger(__name__)
# Environment variables already said to be unknown (a section is resolved more than
# once in some processes).
_UNKNOWN_SAID: set[str] = set()

BUILT_IN = "built-in default"
T = TypeVar("T")


def setting(
    default: Any,
    help: str,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    choices: tuple[str, ...] | None = None,
    parse: Any = None,
) -> Any:
    """A field of a section. ``minimum`` and ``maximum`` bound numbers; ``choices``
    lists the allowed strings; ``parse`` converts a text value (CLI, environment)
    when the field's type alone cannot (e.g. ``20GiB``) and must return the field's
    type."""
    meta = {
        "help": help,
        "minimum": minimum,
        "maximum": maximum,
        "choices": choices,
        "parse": parse,
    }
    return dataclasses.field(default=default, metadata=meta)


@dataclass(frozen=True)
class Resolved(Generic[T]):
    """A resolved section and the source of every one of its values."""

    section: str
    value: T
    origins: Mapping[str, str]

    def origin(self, name: str) -> str:
        return self.origins.get(name, BUILT_IN)

    def given(self, name: str) -> bool:
        """Whether a source other than the built-in default set ``name``."""
        return self.origin(name) != BUILT_IN

    def rows(self) -> list[tuple[str, Any, str]]:
        """``(section.key, value, origin)`` for every field, in declaration order."""
        return [
            (f"{self.section}.{f.name}", getattr(self.value, f.name), self.origin(f.name))
            for f in dataclasses.fields(self.value)  # type: ignore[arg-type]
        ]


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def env_name(section: str, name: str) -> str:
    return f"MESH_{section}_{name}".upper()


def _field_type(cls: type, field: dataclasses.Field) -> tuple[type, bool]:
    """The field's base type and whether it may be None."""
    hints = typing.get_type_hints(cls)
    kind = hints[field.name]
    optional = False
    if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        optional = len(args) < len(typing.get_args(kind))
        kind = args[0]
    return kind, optional


def add_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    only: Iterable[str] | None = None,
    skip: Iterable[str] = (),
) -> None:
    """Add a flag for every field of ``cls`` (or those named in ``only``). Flags have
    no argparse default: a flag the user did not give is absent from the namespace,
    so :func:`resolve` knows it was not given."""
    wanted = None if only is None else set(only)
    skipped = set(skip)
    for field in dataclasses.fields(cls):
        if (wanted is not None and field.name not in wanted) or field.name in skipped:
            continue
        kind, _ = _field_type(cls, field)
        meta = field.metadata
        shown = "" if field.default in (None, "") else f" (default: {field.default})"
        options: dict[str, Any] = {"default": argparse.SUPPRESS, "help": meta["help"] + shown}
        if kind is bool and field.name.startswith("no_"):
            # argparse reads any --no-... flag of a BooleanOptionalAction as false.
            options["action"] = "store_const"
            options["const"] = True
        elif kind is bool:
            options["action"] = argparse.BooleanOptionalAction
        else:
            # A parsed field is read by resolve(), which names the key in its error.
            options["type"] = str if meta["parse"] else (Path if kind is Path else kind)
            if meta["choices"]:
                options["choices"] = meta["choices"]
        parser.add_argument(flag(field.name), dest=field.name, **options)


def _from_text(cls: type, field: dataclasses.Field, text: str, where: str) -> Any:
    kind, optional = _field_type(cls, field)
    if optional and text == "":
        return None
    if kind is bool:
        lowered = text.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise InvalidRequest(f"{where}: {text!r} is not a boolean (true/false)")
    parse = field.metadata["parse"]
    try:
        if parse is not None:
            return parse(text)
        return Path(text) if kind is Path else kind(text)
    except InvalidRequest as error:
        raise InvalidRequest(f"{where}: {error.message}") from None
    except (TypeError, ValueError) as error:
        raise InvalidRequest(
            f"{where}: {text!r} is not a valid {kind.__name__} ({error})"
        ) from None


def _check(cls: type, field: dataclasses.Field, value: Any, where: str, text: bool) -> Any:
    """``value`` converted and checked. ``text``: it comes from a command line or the
    environment, where every value is text; TOML values have types of their own
    (only sizes and paths are written as strings there)."""
    kind, optional = _field_type(cls, field)
    meta = field.metadata
    if value is None:
        if optional:
            return None
        raise InvalidRequest(f"{where}: a value is required")
    if isinstance(value, str) and (text or meta["parse"] is not None) and kind is not str:
        value = _from_text(cls, field, value, where)
    elif isinstance(value, str) and meta["parse"] is not None:
        value = _from_text(cls, field, value, where)
    elif kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    elif kind is Path and isinstance(value, str):
        value = Path(value)
    if kind is bool and not isinstance(value, bool):
        raise InvalidRequest(f"{where}: expected true or false, got {value!r}")
    if kind in (int, float) and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise InvalidRequest(f"{where}: expected a number, got {value!r}")
    if kind is int and isinstance(value, float):
        raise InvalidRequest(f"{where}: expected a whole number, got {value!r}")
    if kind is str and not isinstance(value, str):
        raise InvalidRequest(f"{where}: expected a string, got {value!r}")
    if meta["minimum"] is not None and value < meta["minimum"]:
        raise InvalidRequest(f"{where}: {value!r} is below the minimum, {meta['minimum']:g}")
    if meta["maximum"] is not None and value > meta["maximum"]:
        raise InvalidRequest(f"{where}: {value!r} is above the maximum, {meta['maximum']:g}")
    if meta["choices"] and value not in meta["choices"]:
        raise InvalidRequest(f"{where}: {value!r} is not one of {', '.join(meta['choices'])}")
    return value


def check_table(cls: type, section: str, table: Any, source: str) -> None:
    """Refuse a TOML ``[section]`` that is not a table or names unknown keys."""
    if not isinstance(table, dict):
        raise InvalidRequest(f"{source}: [{section}] must be a table")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(table) - known)
    if unknown:
        raise InvalidRequest(
            f"{source}: unknown key(s) {', '.join(unknown)} in [{section}]; known keys: "
            f"{', '.join(sorted(known))}"
        )


def resolve(
    cls: type[T],
    section: str,
    cli: argparse.Namespace | Mapping[str, Any] | None = None,
    toml: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    toml_source: str = "config",
    lower: Mapping[str, tuple[Any, str]] | None = None,
) -> Resolved[T]:
    """Resolve section ``cls``: CLI > environment > TOML ``[section]`` > ``lower``
    (values another process resolved, with their origins) > built-in default.

    ``cli`` holds the flags the user gave (a namespace from :func:`add_arguments`, or
    a mapping); ``env`` defaults to ``os.environ``.
    """
    env = os.environ if env is None else env
    given = vars(cli) if isinstance(cli, argparse.Namespace) else dict(cli or {})
    table = (toml or {}).get(section, {})
    check_table(cls, section, table, toml_source)
    values: dict[str, Any] = {}
    origins: dict[str, str] = {}
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        name = field.name
        variable = env_name(section, name)
        text = True
        if name in given:
            where = f"CLI {flag(name)}"
            value = given[name]
        elif variable in env:
            where = f"environment {variable}"
            value = env[variable]
        elif name in table:
            where = f"{toml_source} [{section}] {name}"
            value, text = table[name], False
        elif lower is not None and name in lower:
            (value, where), text = lower[name], False
        else:
            continue
        values[name] = _check(cls, field, value, f"{section}.{name} from {where}", text)
        origins[name] = where
    _say_unknown_variables(cls, section, env)
    return Resolved(section=section, value=cls(**values), origins=origins)


def _say_unknown_variables(cls: type, section: str, env: Mapping[str, str]) -> None:
    """Log the ``MESH_<SECTION>_*`` variables no setting of ``section`` reads (a typo
    in one is otherwise silent, where the same typo in TOML is an error)."""
    prefix = f"MESH_{section}_".upper()
    known = {env_name(section, f.name) for f in dataclasses.fields(cls)}
    for variable in sorted(env):
        if not variable.startswith(prefix) or variable in known or variable in _UNKNOWN_SAID:
            continue
        _UNKNOWN_SAID.add(variable)
        close = difflib.get_close_matches(variable, sorted(known), n=1)
        logger.warning(
            "environment variable %s is not a [%s] setting and is ignored%s",
            variable,
            section,
            f"; did you mean {close[0]}?" if close else "",
        )


def describe(resolved: Iterable[Resolved]) -> str:
    """A table of every setting, its value and its source (``--print-config``)."""
    rows = [row for section in resolved for row in section.rows()]
    width = max((len(key) for key, _, _ in rows), default=0)
    lines = []
    for key, value, origin in rows:
        shown = json.dumps(str(value) if isinstance(value, Path) else value)
        lines.append(f"{key.ljust(width)}  {shown}  ({origin})")
    return "\n".join(lines)
