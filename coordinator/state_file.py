"""The coordinator's state file (`up --state-file PATH`): what scripts read once the
mesh serves (address, HTTP URL, serving term, model), and the highest term this
coordinator has used, so that a restarted coordinator never reuses a term.

One small JSON object, replaced atomically on every write.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

logger = logging.getLogger(__name__)


def read_state(path: Path | None) -> dict:
    """The file's object; empty when there is no file or it cannot be read."""
    if path is None or not path.exists():
        return {}
    try:
        body = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        logger.warning("ignoring the unreadable state file %s: %s", path, error)
        return {}
    return body if isinstance(body, dict) else {}


def term_floor(path: Path | None) -> int:
    """The highest term a previous coordinator recorded in ``path`` (0 if none)."""
    body = read_state(path)
    terms = [body.get(key) for key in ("term", "max_term")]
    return max((t for t in terms if isinstance(t, int) and t >= 0), default=0)


def update_state(path: Path | None, **fields: object) -> None:
    """Merge ``fields`` into the file (atomically: write a sibling, then rename)."""
    if path is None:
        return
    body = read_state(path) | fields
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(body))
    tmp.replace(path)


def record_term(path: Path | None, term: int) -> None:
    """Persist ``term`` as the highest used, before any stage hears of it."""
    update_state(path, max_term=max(term, term_floor(path)))


def served_before(path: Path | None, model_id: str) -> bool:
    """Whether a coordinator recorded in ``path`` that a mesh of ``model_id`` served
    (the serving term, written once it serves)."""
    body = read_state(path)
    term = body.get("term")
    return isinstance(term, int) and term > 0 and body.get("model_id") == model_id


def served_http(path: Path | None, model_id: str) -> bool:
    """Whether the mesh of ``model_id`` recorded in ``path`` served the HTTP API (its
    stage 0 was a frontend node): a coordinator restarted on it then plans no
    pipeline before a frontend node has joined again."""
    url = read_state(path).get("http_url")
    return served_before(path, model_id) and isinstance(url, str) and bool(url)
