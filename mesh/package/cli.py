"""``mesh-package``: build, inspect, verify and fetch slices of model packages.

Exit codes: 0 success, 1 ``verify`` found problems, 2 bad input or a failed
operation (the message goes to stderr, never a traceback).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from safetensors import SafetensorError

from mesh.errors import MeshError
from mesh.package.manifest import DTYPES, PackageManifest
from mesh.quant import INT4_GROUP_SIZES, QUANT_SCHEMES
from mesh.types import LayerRange

logger = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_PROBLEMS = 1
EXIT_ERROR = 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mesh-package", description="Build and check mesh model packages."
    )
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    commands = parser.add_subparsers(dest="command", required=True)

    build = commands.add_parser("build", help="write a package from a model")
    build.add_argument(
        "src",
        help="HF model directory, HF repo id (org/name[@revision]), .gguf file, or 'default'",
    )
    build.add_argument("--out", type=Path, help="package directory (optional for 'default')")
    build.add_argument("--dtype", choices=DTYPES, default=None, help="weights dtype (float32)")
    build.add_argument(
        "--quant",
        choices=QUANT_SCHEMES,
        default=None,
        help="keep linear weights quantised: int4 (group-wise, from a GGUF's own 4-bit "
        "codes where they convert exactly) or int8 (per channel); default: plain, except "
        "for a quantised GGUF without --dtype, which stays quantised (int4 for 2- to 6-bit "
        "block types, int8 for Q8_0)",
    )
    build.add_argument(
        "--head-quant",
        choices=QUANT_SCHEMES,
        default=None,
        help="with --quant: how the LM head is stored, int8 (default; keeps next-token "
        "probabilities close to the float model) or int4 (smaller and faster, less exact)",
    )
    build.add_argument(
        "--group-size",
        type=int,
        default=None,
        help=f"int4 group size, one of {', '.join(map(str, INT4_GROUP_SIZES))} (default 32)",
    )
    build.add_argument("--model-id", help="model id served to clients (default: from SRC)")
    build.add_argument("--speculative", help="generation.speculative_decoding: JSON or @file")
    build.add_argument(
        "--force", action="store_true", help="rebuild 'default' even when it is current"
    )

    inspect = commands.add_parser("inspect", help="print a package's manifest")
    inspect.add_argument("dir", type=Path)

    verify = commands.add_parser(
        "verify", help="re-hash every file against the manifest; check safetensors headers"
    )
    verify.add_argument("dir", type=Path)
    verify.add_argument("--quick", action="store_true", help="check presence and sizes only")

    fetch = commands.add_parser("fetch", help="materialise the slice a layer range needs")
    fetch.add_argument("ref", help="package directory or HF repo id (org/name[@revision])")
    fetch.add_argument("--layers", required=True, help="half-open range START:END")
    fetch.add_argument("--cache-dir", type=Path, required=True, help="slice cache directory")
    fetch.add_argument("--revision", help="HF revision (branch, tag or commit)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=str(args.log_level).upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    handlers = {"build": _build, "inspect": _inspect, "verify": _verify, "fetch": _fetch}
    # A SIGTERM (kill, a container stopping) ends the command as Ctrl-C does: a build
    # removes its unfinished output on the way out.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        return handlers[args.command](args)
    except MeshError as error:
        sys.stderr.write(f"mesh-package {args.command}: error: {error.message}\n")
        return EXIT_ERROR
    except OSError as error:
        sys.stderr.write(f"mesh-package {args.command}: error: {error}\n")
        return EXIT_ERROR
    except SafetensorError as error:
        sys.stderr.write(
            f"mesh-package {args.command}: error: a safetensors file cannot be read or "
            f"written ({error}); check the source's files (truncated? corrupt?) and the "
            "free space at --out\n"
        )
        return EXIT_ERROR
    except KeyboardInterrupt:
        sys.stderr.write(f"mesh-package {args.command}: interrupted\n")
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _build(args: argparse.Namespace) -> int:
    from mesh.package.default import build_default_package
    from mesh.package.generation import parse_speculative_arg

    speculative = None if args.speculative is None else parse_speculative_arg(args.speculative)
    plain_default = args.src == "default" and not (
        args.dtype
        or args.model_id
        or speculative
        or args.quant
        or args.group_size
        or args.head_quant
    )
    if plain_default:
        out = build_default_package(args.out, force=args.force)
        manifest = PackageManifest.load(out)
    else:
        if args.out is None:
            sys.stderr.write("mesh-package build: error: --out DIR is required for this SRC\n")
            return EXIT_ERROR
        from mesh.package.builder import build_package

        out = args.out
        quant = args.quant
        if quant is None and args.dtype is None:
            quant = _kept_quantisation(args.src)
        manifest = build_package(
            args.src,
            out,
            dtype=args.dtype or "float32",
            model_id=args.model_id,
            speculative=speculative,
            quant=quant,
            group_size=args.group_size,
            head_quant=args.head_quant,
        )
    sys.stdout.write(
        f"{manifest.model_id}: {manifest.layer_count} layers, {manifest.dtype}"
        f"{_quant_label(manifest)}, "
        f"{len(manifest.files)} files, manifest sha256 {manifest.sha256()[:12]} at {out}\n"
    )
    return EXIT_OK


def _kept_quantisation(src: str) -> str | None:
    """For a GGUF source built without --quant or --dtype: the quantisation that keeps
    its own (a quantised GGUF stays quantised; a float package only when asked)."""
    from mesh.package.gguf_file import GgufModel, kept_quantisation
    from mesh.package.sources import gguf_source

    path = gguf_source(src)
    if path is None:
        return None
    quant, counts = kept_quantisation(GgufModel(path))
    held = ", ".join(f"{n} {t}" for t, n in sorted(counts.items()))
    if quant is not None:
        sys.stderr.write(
            f"mesh-package build: the GGUF's layer weights are {held}: keeping them quantised "
            f"(--quant {quant}); pass --dtype float32 for a float package\n"
        )
    return quant


def _quant_label(manifest: PackageManifest) -> str:
    scheme = manifest.scheme()
    if scheme is None:
        return ""
    group = f" group {scheme.group_size}" if scheme.kind == "int4" else " per channel"
    return f" with {scheme.kind}{group} weights, {scheme.head} head"


def _inspect(args: argparse.Namespace) -> int:
    manifest = PackageManifest.load(args.dir)
    sys.stdout.write(format_manifest(manifest))
    return EXIT_OK


def _verify(args: argparse.Namespace) -> int:
    from mesh.package.verify import verify_package

    problems = verify_package(args.dir, quick=args.quick)
    if problems:
        for problem in problems:
            sys.stdout.write(f"FAIL {problem}\n")
        sys.stdout.write(f"{len(problems)} problem(s) in {args.dir}\n")
        return EXIT_PROBLEMS
    manifest = PackageManifest.load(args.dir)
    total = sum(entry.bytes for entry in manifest.files)
    check = "sizes checked" if args.quick else "sha256 and headers verified"
    sys.stdout.write(f"OK {len(manifest.files)} files, {total} bytes, {check} in {args.dir}\n")
    return EXIT_OK


def _fetch(args: argparse.Namespace) -> int:
    from mesh.package.resolver import SliceResolver

    layer_range = LayerRange.parse(args.layers)
    resolver = SliceResolver(args.cache_dir)
    local_dir = resolver.materialise(args.ref, layer_range, revision=args.revision)
    inventory = resolver.inventory()
    sys.stdout.write(
        f"slice {layer_range} ready: {len(inventory.files)} files, "
        f"{inventory.bytes_total} bytes at {local_dir}\n"
    )
    return EXIT_OK


def format_manifest(manifest: PackageManifest) -> str:
    """The manifest as a readable summary and a files table with totals."""
    source = " ".join(f"{key}={value}" for key, value in manifest.source.items())
    rows = [
        ("model", manifest.model_id),
        ("architecture", f"{manifest.architecture} ({manifest.model_type})"),
        ("layers", str(manifest.layer_count)),
        ("hidden", str(manifest.hidden_size)),
        ("vocab", str(manifest.vocab_size)),
        ("dtype", manifest.dtype),
        ("quantization", _quant_label(manifest).removeprefix(" with ") or "none"),
        ("tied", "yes" if manifest.tied_embeddings else "no"),
        ("source", source),
        ("manifest", f"sha256 {manifest.sha256()}"),
    ]
    speculative = (manifest.generation or {}).get("speculative_decoding")
    if isinstance(speculative, dict):
        names = ", ".join(sorted(speculative.get("strategies") or {}))
        rows.append(("speculative", f"default {speculative.get('default')}; strategies: {names}"))
    for entry in (manifest.quantization or {}).get("deviation") or []:
        if not isinstance(entry, dict):
            continue
        how = (
            "source codes" if entry.get("from_source_codes") == entry.get("tensors") else "rounded"
        )
        rows.append(
            (
                "deviation",
                f"{entry.get('source')} -> {entry.get('stored')} ({entry.get('tensors')} "
                f"tensors, {how}): max {entry.get('max_abs_error')}, relative RMS "
                f"{entry.get('relative_rms_error')}",
            )
        )
    lines = [f"{label:<14}{value}" for label, value in rows]
    width = max(len("path"), *(len(entry.path) for entry in manifest.files))
    lines.append("")
    lines.append(f"{'path':<{width}}  {'kind':<5}  {'layer':>5}  {'bytes':>12}  sha256")
    for entry in manifest.files:
        layer = "-" if entry.layer_index is None else str(entry.layer_index)
        lines.append(
            f"{entry.path:<{width}}  {entry.kind:<5}  {layer:>5}  {entry.bytes:>12}  "
            f"{entry.sha256[:12]}"
        )
    lines.append("")
    for kind in ("meta", "embed", "head", "layer"):
        chosen = [entry for entry in manifest.files if entry.kind == kind]
        if chosen:
            total = sum(entry.bytes for entry in chosen)
            lines.append(f"{kind:<6}{len(chosen):>5} file(s) {total:>14} bytes")
    total = sum(entry.bytes for entry in manifest.files)
    lines.append(
        f"{'total':<6}{len(manifest.files):>5} file(s) {total:>14} bytes ({_human(total)})"
    )
    return "\n".join(lines) + "\n"


def _human(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


if __name__ == "__main__":
    sys.exit(main())
