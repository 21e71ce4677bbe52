"""``mesh-coordinator doctor`` and ``mesh-stage doctor``: check a host's setup before
(or instead of) starting a process, one line per check, PASS / WARN / FAIL.

The checks shared by both commands live here (``results``: results and their output;
``host``: ports, devices, memory, directories; ``tls``: the join token and
certificates; ``package``: the package and the draft model); coordinator/doctor.py
and stage/doctor.py run them with the configuration ``up`` and ``join`` resolve.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from mesh.doctor.results import (
    FAIL,
    PASS,
    WARN,
    CheckResult,
    exit_code,
    failed,
    passed,
    render,
    render_json,
    run,
    warned,
)

__all__ = [
    "FAIL",
    "PASS",
    "WARN",
    "CheckResult",
    "add_doctor_arguments",
    "exit_code",
    "failed",
    "passed",
    "render",
    "render_json",
    "report",
    "run",
    "warned",
]


def add_doctor_arguments(parser: argparse.ArgumentParser) -> None:
    """What ``doctor`` adds to the flags of the command it checks."""
    parser.add_argument("--json", action="store_true", help="print the results as JSON")


def configure_doctor_logging(args: argparse.Namespace) -> None:
    """Logs go to stderr at ERROR unless asked for: the report is the output."""
    from mesh.logsetup import configure_logging

    configure_logging(
        getattr(args, "log_level", None) or os.environ.get("MESH_LOG_LEVEL") or "ERROR"
    )


def report(results: Sequence[CheckResult], as_json: bool) -> int:
    """Print ``results`` (text or JSON) to stdout; the exit code (1 when a check FAILed)."""
    sys.stdout.write((render_json(results) if as_json else render(results)) + "\n")
    sys.stdout.flush()
    return exit_code(results)
