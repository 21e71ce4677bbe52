"""Hugging Face Hub access for packages: repo references, cache location, offline mode.

The hub library reads its environment once, at import. Mesh reads ``HF_HUB_CACHE``,
``HF_HOME`` and ``HF_HUB_OFFLINE`` at call time instead and passes them explicitly,
so a process (or a test) that sets them after start-up is honoured.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from mesh.errors import PackageError, Unavailable

logger = logging.getLogger(__name__)

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_REVISION = re.compile(r"^[\w./-]+$")
_TRUE = {"1", "true", "yes", "on"}


@dataclass(frozen=True)
class RepoRef:
    """A Hugging Face model repo and the revision to read (``None`` means main)."""

    repo_id: str
    revision: str | None = None

    def __str__(self) -> str:
        return self.repo_id if self.revision is None else f"{self.repo_id}@{self.revision}"


def parse_repo_ref(text: str, revision: str | None = None) -> RepoRef | None:
    """``org/name`` or ``org/name@revision`` as a RepoRef, or None if ``text`` is not one.

    An explicit ``revision`` argument wins over one written after ``@``.
    """
    repo_id, _, written = text.strip().partition("@")
    if not _REPO_ID.match(repo_id) or ".." in repo_id:
        return None
    chosen = revision or written or None
    if chosen is not None and not _REVISION.match(chosen):
        raise PackageError(f"revision {chosen!r} of {repo_id} is not a valid branch, tag or commit")
    return RepoRef(repo_id=repo_id, revision=chosen)


def hub_cache_dir() -> Path:
    """The hub cache directory, following the hub's own environment variables."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        value = os.environ.get(name)
        if value:
            return Path(os.path.expandvars(value)).expanduser()
    home = os.environ.get("HF_HOME")
    if home:
        return Path(os.path.expandvars(home)).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "huggingface" / "hub"


def hub_offline() -> bool:
    """True when ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) is set."""
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(name, "").strip().lower() in _TRUE:
            return True
    return False


def snapshot(ref: RepoRef, allow_patterns: list[str]) -> Path:
    """Download (or find in the cache) the files of ``ref`` matching ``allow_patterns``.

    Returns the snapshot directory, whose name is the resolved commit hash.
    """
    from huggingface_hub import snapshot_download

    try:
        folder = snapshot_download(
            ref.repo_id,
            revision=ref.revision,
            cache_dir=hub_cache_dir(),
            local_files_only=hub_offline(),
            allow_patterns=allow_patterns,
        )
    except Exception as error:  # mapped to a typed error below
        raise map_hub_error(error, ref, "snapshot") from error
    return Path(folder)


def download_file(ref: RepoRef, path: str) -> Path:
    """Fetch one file of ``ref`` into the hub cache and return its local path."""
    from huggingface_hub import hf_hub_download

    try:
        local = hf_hub_download(
            ref.repo_id,
            path,
            revision=ref.revision,
            cache_dir=hub_cache_dir(),
            local_files_only=hub_offline(),
        )
    except Exception as error:  # mapped to a typed error below
        raise map_hub_error(error, ref, path) from error
    return Path(local)


def snapshot_commit(local_file: Path, path_in_repo: str) -> str | None:
    """The commit hash of the snapshot that ``local_file`` (a hub cache path) lives in."""
    depth = len(Path(path_in_repo).parts)
    snapshot_dir = Path(local_file).parents[depth - 1]
    if snapshot_dir.parent.name == "snapshots" and re.fullmatch(r"[0-9a-f]{40}", snapshot_dir.name):
        return snapshot_dir.name
    return None


def map_hub_error(error: Exception, ref: RepoRef, what: str) -> PackageError | Unavailable:
    """Turn a huggingface_hub exception into PackageError (fix the input) or Unavailable
    (network trouble: retry)."""
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{what} of {ref}"
    if isinstance(error, LocalEntryNotFoundError):
        if hub_offline():
            return PackageError(
                f"{where} is not in the local Hugging Face cache at {hub_cache_dir()} and "
                "HF_HUB_OFFLINE=1 forbids downloading; fetch it once online or unset HF_HUB_OFFLINE"
            )
        return Unavailable(
            f"{where} could not be downloaded and is not cached at {hub_cache_dir()}: {error}"
        )
    if isinstance(error, GatedRepoError):
        return PackageError(f"{ref.repo_id} is gated: accept its terms and set HF_TOKEN ({error})")
    if isinstance(error, RepositoryNotFoundError):
        return PackageError(f"Hugging Face repo {ref.repo_id} not found (or private without token)")
    if isinstance(error, RevisionNotFoundError):
        return PackageError(f"revision {ref.revision!r} not found in {ref.repo_id}")
    if isinstance(error, EntryNotFoundError):
        return PackageError(f"{where}: no such file in the repo")
    if isinstance(error, HFValidationError | ValueError):
        return PackageError(f"{where}: {error}")
    return Unavailable(f"{where} could not be fetched: {error}; check the network and retry")
