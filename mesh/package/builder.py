"""Write a model package from a checkpoint (HF directory, HF repo or GGUF).

The package is built in a temporary directory next to ``out`` and renamed into
place at the end, so a reader never sees a half-written package. Tensors are read,
converted and written one file at a time: the embedding, the head, then one
decoder layer after another.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

import torch

from mesh.errors import InvalidRequest, PackageError
from mesh.package.generation import speculative_block
from mesh.package.manifest import (
    DTYPES,
    EMBED_PATH,
    HEAD_PATH,
    MANIFEST_NAME,
    PackageFile,
    PackageManifest,
    layer_path,
    sha256_file,
)
from mesh.package.sources import Checkpoint, open_checkpoint
from mesh.package.tensors import EMBED_TENSOR, HEAD_TENSOR, NORM_TENSOR, classify
from mesh.package.weight_store import WeightStore
from mesh.package.weight_store import convert_plain as _convert
from mesh.quant import QuantScheme, make_scheme
from mesh.runtime.skeleton import CHECKPOINT_REMEDY, LayerChecker, load_config

logger = logging.getLogger(__name__)

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_TENSOR_DIRS = ("shared", "layers")


def build_package(
    src: str,
    out: Path,
    dtype: str = "float32",
    model_id: str | None = None,
    speculative: dict | None = None,
    *,
    overwrite: bool = False,
    quant: str | None = None,
    group_size: int | None = None,
    head_quant: str | None = None,
) -> PackageManifest:
    """Build a package from ``src`` into ``out`` and return its manifest.

    ``src`` is ``default``, a ``.gguf`` file, an HF model directory or an HF repo id
    (``org/name[@revision]``). An existing package at ``out`` is replaced; any other
    non-empty directory is refused unless ``overwrite`` is set. ``quant`` (int8 or
    int4, with ``group_size`` for int4) stores the linear weights quantised and the
    LM head as ``head_quant`` (default int8); ``dtype`` is then the dtype of the
    tensors left plain (norms, biases).
    """
    if dtype not in DTYPES:
        raise InvalidRequest(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    scheme = None if quant is None else make_scheme(quant, group_size, head_quant)
    if scheme is None and (group_size or head_quant):
        raise InvalidRequest("--group-size and --head-quant apply only with --quant")
    if model_id is not None and not model_id.strip():
        raise InvalidRequest(
            "--model-id is empty: give the name clients will ask for, or leave it out"
        )
    generation = None if speculative is None else speculative_block(speculative)
    out = Path(out).expanduser().absolute()
    _check_out(out, overwrite)
    with open_checkpoint(src) as checkpoint:
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            build_dir = Path(tempfile.mkdtemp(prefix=f".{out.name}.build-", dir=out.parent))
        except OSError as error:
            raise PackageError(
                f"cannot write the package at --out {out}: {error.strerror or error} "
                f"(a build writes into a new directory in {out.parent}, then renames it)"
            ) from error
        build_dir.chmod(0o755)
        try:
            manifest = write_package(
                checkpoint,
                build_dir,
                dtype,
                model_id or checkpoint.default_model_id,
                generation,
                scheme,
            )
            _install(build_dir, out, overwrite)
        except BaseException:
            shutil.rmtree(build_dir, ignore_errors=True)
            raise
    logger.info(
        "built package %s (%d layers, %s%s) at %s",
        manifest.model_id,
        manifest.layer_count,
        dtype,
        "" if scheme is None else f", {scheme.kind} weights",
        out,
    )
    return manifest


# Above this size a stored head of a tied config is not compared with the embedding
# (both would be read whole): the warning then says it was not compared.
TIED_COMPARE_MAX_BYTES = 2 * 2**30


def _warn_if_untied_head(checkpoint: Checkpoint, embed: str, lm_head: str) -> None:
    """A tied config whose checkpoint also stores an output projection: the package
    (as transformers does) uses the embedding; say so when the stored one differs."""
    if checkpoint.nbytes(lm_head) > TIED_COMPARE_MAX_BYTES:
        logger.warning(
            "the config ties the output projection to the embedding (tie_word_embeddings) "
            "but the checkpoint also stores %s (not compared: too large); the package uses "
            "the embedding: if %s is the trained head, set tie_word_embeddings to false",
            lm_head,
            lm_head,
        )
        return
    stored, embedding = checkpoint.tensor(lm_head), checkpoint.tensor(embed)
    if stored.shape == embedding.shape and torch.equal(stored, embedding):
        return
    logger.warning(
        "the config ties the output projection to the embedding (tie_word_embeddings) but "
        "the checkpoint stores a different %s; the package uses the embedding, as "
        "transformers does: if %s is the trained head, set tie_word_embeddings to false in "
        "config.json and build again",
        lm_head,
        lm_head,
    )


def write_package(
    checkpoint: Checkpoint,
    directory: Path,
    dtype: str,
    model_id: str,
    generation: dict[str, Any] | None,
    scheme: QuantScheme | None = None,
) -> PackageManifest:
    """Write every package file of ``checkpoint`` into the empty ``directory``;
    with ``scheme``, linear weights and the head quantised, the embedding in int8."""
    description = checkpoint.description
    extra = int(checkpoint.config_json.get("num_nextn_predict_layers") or 0)
    layout = classify(checkpoint.tensor_names(), description.layer_count, extra)
    if layout.lm_head is None and not description.tied_embeddings:
        raise PackageError(
            "checkpoint has no lm_head.weight and its config sets tie_word_embeddings=false: "
            "the output projection is missing"
        )
    torch_dtype = _TORCH_DTYPES[dtype]
    config = dict(checkpoint.config_json)
    config["dtype"] = dtype
    if "torch_dtype" in config:
        config["torch_dtype"] = dtype
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    checkpoint.write_meta(directory)
    _check_tokenizer(directory, description.vocab_size)

    vocab, hidden = description.vocab_size, description.hidden_size
    _check_shape(layout.embed, checkpoint.shape(layout.embed), (vocab, hidden))
    head_source = layout.embed if description.tied_embeddings else layout.lm_head
    assert head_source is not None
    if description.tied_embeddings and layout.lm_head is not None:
        _warn_if_untied_head(checkpoint, layout.embed, layout.lm_head)
    _check_shape(HEAD_TENSOR, checkpoint.shape(head_source), (vocab, hidden))
    _check_shape(layout.norm, checkpoint.shape(layout.norm), (hidden,))
    plan = [(EMBED_PATH, [layout.embed]), (HEAD_PATH, [head_source, layout.norm])]
    plan += [
        (layer_path(i), [source for _, source in entries])
        for i, entries in enumerate(layout.layers)
    ]
    # The stages' own check of each layer's tensors, run on what is written.
    remedy = CHECKPOINT_REMEDY
    if dtype == "float16":
        remedy += " (values beyond float16's range become infinite: build with --dtype bfloat16)"
    checker = LayerChecker(load_config(directory), scheme, remedy)
    with BuildProgress(checkpoint, plan) as progress:
        store = WeightStore(checkpoint, scheme, torch_dtype, progress.read)
        progress.start(EMBED_PATH)
        embedding = store.embedding(EMBED_TENSOR, layout.embed)
        checker.check_finite("embed", embedding)
        _save(directory, EMBED_PATH, embedding)
        del embedding
        progress.start(HEAD_PATH)
        # A tied head is written again into the head file: the last stage needs no
        # embed file.
        head = store.linear(HEAD_TENSOR, head_source, tied=description.tied_embeddings, head=True)
        head[NORM_TENSOR] = _convert(checkpoint.tensor(layout.norm), torch_dtype)
        progress.read(layout.norm, checkpoint.nbytes(layout.norm))
        checker.check_finite("head", head)
        _save(directory, HEAD_PATH, head)
        del head
        for index, entries in enumerate(layout.layers):
            progress.start(layer_path(index))
            tensors: dict[str, torch.Tensor] = {}
            for name, source in entries:
                tensors.update(store.layer_tensor(name, source))
            checker.check(index, tensors)
            _save(directory, layer_path(index), tensors)
            logger.debug("wrote layer %d/%d", index + 1, description.layer_count)
            del tensors

    files = _meta_files(directory) + [_describe_file(directory, EMBED_PATH, "embed")]
    files.append(_describe_file(directory, HEAD_PATH, "head"))
    files += [
        _describe_file(directory, layer_path(i), "layer", i) for i in range(description.layer_count)
    ]
    manifest = PackageManifest(
        model_id=model_id,
        architecture=description.architecture,
        model_type=description.model_type,
        layer_count=description.layer_count,
        hidden_size=hidden,
        vocab_size=vocab,
        dtype=dtype,
        tied_embeddings=description.tied_embeddings,
        source=dict(checkpoint.source),
        files=tuple(files),
        generation=generation,
        quantization=store.summary(),
    )
    manifest.save(directory)
    return manifest


def _check_shape(name: str, shape: tuple[int, ...], expected: tuple[int, ...]) -> None:
    if tuple(shape) != expected:
        raise PackageError(
            f"checkpoint tensor {name} has shape {tuple(shape)}, but the config implies "
            f"{expected}; the config and the weights do not belong together"
        )


class BuildProgress:
    """Progress bars (tqdm, shown on a terminal only): the whole build and the file
    being written, in bytes of the source read, with rate and ETA."""

    def __init__(self, checkpoint: Checkpoint, plan: list[tuple[str, list[str]]]) -> None:
        from tqdm import tqdm

        self._sizes = {path: sum(checkpoint.nbytes(s) for s in sources) for path, sources in plan}
        bar = {"unit": "B", "unit_scale": True, "unit_divisor": 1024, "disable": None}
        self._total = tqdm(total=sum(self._sizes.values()), desc="package", position=0, **bar)
        self._file = tqdm(total=0, desc="", position=1, leave=False, **bar)

    def start(self, path: str) -> None:
        self._file.reset(total=self._sizes.get(path, 0))
        self._file.set_description(path)

    def read(self, source: str, nbytes: int) -> None:
        self._total.update(nbytes)
        self._file.update(nbytes)

    def __enter__(self) -> BuildProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self._file.close()
        self._total.close()


def _save(directory: Path, relative: str, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    target = directory / relative
    target.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(target), metadata={"format": "pt"})


def _describe_file(
    directory: Path, relative: str, kind: str, layer_index: int | None = None
) -> PackageFile:
    path = directory / relative
    return PackageFile(
        path=relative,
        kind=kind,
        bytes=path.stat().st_size,
        sha256=sha256_file(path),
        layer_index=layer_index,
    )


def _meta_files(directory: Path) -> list[PackageFile]:
    """Every file outside shared/ and layers/: config, tokenizer, generation config."""
    found = sorted(
        path.relative_to(directory).as_posix()
        for path in directory.rglob("*")
        if path.is_file() and path.relative_to(directory).parts[0] not in _TENSOR_DIRS
    )
    if not any(name.startswith("tokenizer") for name in found):
        logger.warning(
            "the source has no tokenizer files: stage 0 cannot serve this package (it reads "
            "every request through the tokenizer); put the model's tokenizer files next to "
            "its config.json and build again to serve it"
        )
    found.sort(key=lambda name: (name != "config.json", name))
    return [_describe_file(directory, name, "meta") for name in found]


def _check_tokenizer(directory: Path, vocab: int) -> None:
    """Warn where stage 0 will not serve the package as the operator expects: a
    tokenizer that does not load, or one with ids beyond the model's embedding (text
    that tokenizes to them is refused with a 400 at serving time)."""
    if not any(path.name.startswith("tokenizer") for path in directory.iterdir()):
        return
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(directory)
    except Exception as error:  # noqa: BLE001 - any failure is the same warning
        logger.warning(
            "the package's tokenizer does not load (%s: %s): stage 0 cannot serve this "
            "package; fix the source's tokenizer files and build again",
            type(error).__name__,
            error,
        )
        return
    size = len(tokenizer)
    if size > vocab:
        logger.warning(
            "the tokenizer has %d tokens, the model's embedding %d rows: text that "
            "tokenizes to ids %d and above cannot be served (such requests get a 400); "
            "check that the tokenizer belongs to this model",
            size,
            vocab,
            vocab,
        )


def _check_out(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise PackageError(f"--out {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        if not (out / MANIFEST_NAME).is_file() and not overwrite:
            raise PackageError(
                f"--out {out} is a non-empty directory that is not a model package; "
                "choose an empty or new directory"
            )


def _install(build_dir: Path, out: Path, overwrite: bool) -> None:
    """Move the finished build to ``out``, replacing an older package there."""
    _check_out(out, overwrite)
    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()
    if out.exists():
        trash = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(out, trash)
        os.rename(build_dir, out)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.rename(build_dir, out)
