"""The manifest's optional ``generation`` block and the ``--speculative`` argument.

A speculative-decoding config is checked whole at build (``speculative_block``,
with the speculation module's rules), so a package never carries a block that
fails at serve time.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mesh.errors import InvalidRequest, PackageError


def speculative_block(speculative: Any) -> dict[str, Any]:
    """The manifest ``generation`` block for a speculative-decoding config, checked
    whole: the top level (``default``, ``strategies``), every strategy's keys and
    values, and that each strategy resolves (window sizes in order, a draft model
    where its type needs one). A block that would only fail at serve time is refused
    at build."""
    if not isinstance(speculative, dict):
        raise InvalidRequest(
            f"speculative config must be a JSON object, got {type(speculative).__name__}"
        )
    missing = [key for key in ("default", "strategies") if key not in speculative]
    if missing:
        raise InvalidRequest(
            f"speculative config lacks {' and '.join(missing)}; expected "
            '{"default": NAME, "strategies": {NAME: {...}}}'
        )
    if not isinstance(speculative["strategies"], dict):
        raise InvalidRequest("speculative config: strategies must be an object of named strategies")
    from mesh.config import parse_package_speculation, resolve_speculation

    block = {"speculative_decoding": speculative}
    try:
        parse_package_speculation(block)
    except PackageError as problem:
        raise InvalidRequest(f"speculative config: {problem.message}") from None
    for name in speculative["strategies"]:
        try:
            resolve_speculation({"spec_strategy": name}, {}, "", block)
        except InvalidRequest as problem:
            raise InvalidRequest(
                f"speculative config: strategy {name!r}: {problem.message}"
            ) from None
    return block


def parse_speculative_arg(text: str) -> dict[str, Any]:
    """Parse ``--speculative``: inline JSON, or ``@path`` to a JSON file."""
    origin = "--speculative"
    if text.startswith("@"):
        path = Path(text[1:]).expanduser()
        origin = str(path)
        try:
            text = path.read_text()
        except OSError as error:
            raise InvalidRequest(f"cannot read speculative config {path}: {error}") from error
    try:
        body = json.loads(text)
    except json.JSONDecodeError as error:
        raise InvalidRequest(f"{origin} is not valid JSON: {error}") from error
    speculative_block(body)
    return body
