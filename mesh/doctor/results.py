"""The doctor's results: one line per check, PASS / WARN / FAIL, and what to do.

A check is a function that returns one or more :class:`CheckResult`. :func:`run`
runs them in order and turns an error a check raises into a FAIL of that check,
so one broken part never hides the others. The exit code is 1 when any check
FAILed, else 0 (a WARN does not fail).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass

from mesh.errors import MeshError

logger = logging.getLogger(__name__)

PASS, WARN, FAIL = "PASS", "WARN", "FAIL"
Check = Callable[[], "CheckResult | Sequence[CheckResult]"]


@dataclass(frozen=True)
class CheckResult:
    """``check``: what was checked (``package``, ``port 7070``); ``detail``: what was
    found; ``fix``: what to do about a WARN or FAIL (empty for a PASS)."""

    check: str
    status: str
    detail: str
    fix: str = ""


def passed(check: str, detail: str) -> CheckResult:
    return CheckResult(check, PASS, detail)


def warned(check: str, detail: str, fix: str) -> CheckResult:
    return CheckResult(check, WARN, detail, fix)


def failed(check: str, detail: str, fix: str) -> CheckResult:
    return CheckResult(check, FAIL, detail, fix)


def run(checks: Iterable[tuple[str, Check]]) -> list[CheckResult]:
    """Run every ``(name, check)``; an error a check raises is that check's FAIL."""
    results: list[CheckResult] = []
    for name, check in checks:
        try:
            found = check()
        except MeshError as error:
            found = failed(name, error.message, "fix the setting it names and run doctor again")
        except Exception as error:  # a doctor reports every check, whatever one raises
            logger.debug("check %s raised", name, exc_info=True)
            found = failed(name, f"the check could not run: {type(error).__name__}: {error}", "")
        results.extend([found] if isinstance(found, CheckResult) else found)
    return results


def exit_code(results: Sequence[CheckResult]) -> int:
    return 1 if any(r.status == FAIL for r in results) else 0


def render(results: Sequence[CheckResult]) -> str:
    """One line per check: ``STATUS  check  detail; fix``, then a summary line."""
    width = max((len(r.check) for r in results), default=0)
    lines = []
    for result in results:
        fix = f"; {result.fix}" if result.fix else ""
        lines.append(f"{result.status}  {result.check.ljust(width)}  {result.detail}{fix}")
    counts = {status: sum(r.status == status for r in results) for status in (PASS, WARN, FAIL)}
    verdict = "some checks failed" if counts[FAIL] else "no check failed"
    lines.append(
        f"{verdict}: {counts[PASS]} passed, {counts[WARN]} warning(s), {counts[FAIL]} failed"
    )
    return "\n".join(lines)


def render_json(results: Sequence[CheckResult]) -> str:
    """``{"ok": bool, "checks": [{"check", "status", "detail", "fix"}, ...]}``."""
    body = {"ok": exit_code(results) == 0, "checks": [asdict(r) for r in results]}
    return json.dumps(body, indent=2)
