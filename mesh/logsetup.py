"""Process-wide logging set-up for the command-line entry points."""

from __future__ import annotations

import logging
import os


def configure_logging(level: str | None = None, prefix: str = "") -> None:
    """Log to stderr with time, level, logger and message; MESH_LOG_LEVEL overrides."""
    chosen = (level or os.environ.get("MESH_LOG_LEVEL") or "INFO").upper()
    known = chosen in LEVELS
    tag = f"{prefix} " if prefix else ""
    logging.basicConfig(
        level=getattr(logging, chosen) if known else logging.INFO,
        format=f"%(asctime)s {tag}%(levelname)s %(name)s: %(message)s",
    )
    for noisy in ("httpx", "urllib3", "filelock", "huggingface_hub"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if not known:
        logging.getLogger(__name__).warning(
            "log level %r is not one of %s; logging at INFO", chosen, ", ".join(LEVELS)
        )


LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
