"""Every command-line flag of the three commands is described somewhere in the docs
(docs/*.md or the README): an operator reading a flag in ``--help`` finds what it does
and what it costs there."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from coordinator.cli import build_parser as coordinator_parser
from mesh.package.cli import _parser as package_parser
from stage.cli import build_parser as stage_parser

ROOT = Path(__file__).resolve().parents[2]


def _flags(parser: argparse.ArgumentParser, prefix: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out += _flags(sub, f"{prefix} {name}")
        for option in action.option_strings:
            if option.startswith("--") and option not in ("--help",):
                out.append((prefix, option))
    return out


FLAGS = sorted(
    set(
        _flags(coordinator_parser(), "mesh-coordinator")
        + _flags(stage_parser(), "mesh-stage")
        + _flags(package_parser(), "mesh-package")
    )
)


@pytest.fixture(scope="module")
def docs() -> str:
    return "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted(ROOT.glob("docs/*.md"))])


def test_the_commands_have_flags_to_check() -> None:
    commands = {command.split()[0] for command, _ in FLAGS}
    assert commands == {"mesh-coordinator", "mesh-stage", "mesh-package"}
    assert len(FLAGS) > 100


@pytest.mark.parametrize(("command", "flag"), FLAGS)
def test_every_flag_is_documented(docs: str, command: str, flag: str) -> None:
    # "--no-x" of a BooleanOptionalAction is documented with "--x".
    names = {flag, "--" + flag.removeprefix("--no-")}
    assert any(re.search(re.escape(name) + r"(?![\w-])", docs) for name in names), (
        f"{command} {flag} is in --help but in no docs/*.md nor README.md"
    )
