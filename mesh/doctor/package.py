"""Checks of the model package and the draft model.

The package: manifest readable, every file's sha256 and every safetensors header
(``mesh.package.verify``). The draft model: resolved from a local path, or from the
Hugging Face cache for a hub reference (never the network: the doctor must not
hang on a host without it), and its tokenizer compared with the target's the way
stage 0 does when it loads it (``check_draft_compatible``). A draft that cannot be
used is a WARN: stage 0 then serves with the n-gram drafter.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mesh.config import DRAFT_TYPES, DraftRef, SpeculationConfig
from mesh.doctor.results import CheckResult, failed, passed, warned
from mesh.errors import PackageError
from mesh.package.manifest import PackageManifest
from mesh.units import format_bytes

REBUILD = "rebuild it with `mesh-package build` or restore the files (`mesh-package verify DIR`)"
FALLBACK = "stage 0 would serve with the n-gram drafter instead"
SHOWN_PROBLEMS = 3


def check_package(directory: Path) -> CheckResult:
    """The package at ``directory``: manifest, hashes and headers."""
    from mesh.package.verify import verify_package

    try:
        manifest = PackageManifest.load(directory)
        problems = verify_package(directory)
    except PackageError as error:
        return failed("package", error.message, REBUILD)
    if problems:
        shown = "; ".join(problems[:SHOWN_PROBLEMS])
        more = (
            f" (and {len(problems) - SHOWN_PROBLEMS} more)"
            if len(problems) > SHOWN_PROBLEMS
            else ""
        )
        return failed("package", f"{directory}: {len(problems)} problem(s): {shown}{more}", REBUILD)
    total = sum(entry.bytes for entry in manifest.files)
    return passed(
        "package",
        f"{manifest.model_id} at {directory}: {len(manifest.files)} files, "
        f"{format_bytes(total)}, sha256 and safetensors headers verified",
    )


def check_draft(speculation: SpeculationConfig, target_dir: Path | None) -> CheckResult:
    """Whether the configured draft model can be loaded here and fits the target's
    tokenizer (``target_dir``: the package, None when it is not on this host)."""
    ref = speculation.draft_model
    if speculation.type not in DRAFT_TYPES or ref is None:
        given = dict(speculation.origins).get("draft_model")
        if given is not None:
            return warned(
                "draft model",
                f"draft_model from {given} is not used: speculation type is "
                f"{speculation.type!r} (from {dict(speculation.origins).get('type', 'built-in')})",
                "set --spec-type draft-model (or composite) to draft with it",
            )
        return passed("draft model", f"none (speculation: {speculation.type})")
    try:
        location, kwargs = _locate(ref)
    except PackageError as error:
        return warned("draft model", error.message, f"fix draft_model, or {FALLBACK}")
    if location is None:
        from mesh.package.hub import hub_cache_dir

        return warned(
            "draft model",
            f"{ref} is not in the Hugging Face cache at {hub_cache_dir()}: stage 0 downloads it "
            "when it loads (network needed); not checked here",
            "fetch it once (`huggingface-cli download` the repo) to check it offline",
        )
    from transformers import AutoConfig, AutoTokenizer

    from mesh.speculative.draft_model import check_draft_compatible

    try:
        tokenizer = AutoTokenizer.from_pretrained(location, **kwargs)
        config = AutoConfig.from_pretrained(location, **kwargs)
    except (OSError, ValueError, KeyError, RuntimeError) as error:
        return warned("draft model", f"cannot load {ref}: {error}", f"fix draft_model; {FALLBACK}")
    if target_dir is None:
        return warned(
            "draft model",
            f"{ref} loads; the package is not on this host, so its tokenizer was not compared",
            "run the doctor where the package is",
        )
    target = AutoTokenizer.from_pretrained(target_dir)
    problems = check_draft_compatible(
        target, tokenizer, draft_vocab_size=getattr(config, "vocab_size", None)
    )
    if problems:
        return warned(
            "draft model",
            f"{ref} does not match the target's tokenizer: {'; '.join(problems[:SHOWN_PROBLEMS])}",
            f"choose a draft of the same model family; {FALLBACK}",
        )
    return passed("draft model", f"{ref}: tokenizer matches the target ({len(target)} tokens)")


def _locate(ref: DraftRef) -> tuple[str | None, dict[str, Any]]:
    """Where the draft is on this host: a local path, or a cached hub snapshot
    (None when the hub cache does not hold it). Never touches the network."""
    from mesh.speculative.draft_model import local_draft_location

    if ref.is_local:
        return local_draft_location(Path(ref.repo_or_path))
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    from mesh.package.hub import hub_cache_dir

    try:
        folder = snapshot_download(
            ref.repo_or_path, cache_dir=hub_cache_dir(), local_files_only=True
        )
    except LocalEntryNotFoundError:
        return None, {}
    if ref.quant is None and (Path(folder) / "config.json").is_file():
        return folder, {}
    return local_draft_location(Path(folder), ref.quant)
