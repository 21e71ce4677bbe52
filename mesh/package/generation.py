"""The manifest's optional ``generation`` block and the ``--speculative`` argument.

Only the top level of a speculative-decoding config is checked here (an object
with ``default`` and ``strategies``); the speculation module validates the rest.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mesh.errors import InvalidRequest


def speculative_block(speculative: Any) -> dict[str, Any]:
    """The manifest ``generation`` block for a speculative-decoding config.

    Only the top level is checked here: an object with ``default`` and ``strategies``.
    """
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
    return {"speculative_decoding": speculative}


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
