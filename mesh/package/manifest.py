"""The model-package manifest (``model-package.json``): schema, load, save, slicing.

A package is a directory with this manifest, the config and tokenizer files,
``shared/embed.safetensors``, ``shared/head.safetensors`` and one file per decoder
layer under ``layers/``. Tensor names inside the files:

- ``shared/embed.safetensors``: ``embed_tokens.weight``
- ``shared/head.safetensors``: ``norm.weight`` and ``lm_head.weight`` (with tied
  embeddings, ``lm_head.weight`` is a copy of the embedding, so the last stage never
  needs the embed file)
- ``layers/NNNNN.safetensors``: the HF decoder layer's own names with the
  ``model.layers.N.`` prefix removed (``self_attn.q_proj.weight``, ...); a
  mixture-of-experts layer holds its router ``mlp.gate.weight`` and each expert's
  ``mlp.experts.E.{gate,up,down}_proj.weight`` (Mixtral's ``block_sparse_moe`` and
  ``w1``/``w3``/``w2`` names are stored under these)

A quantised package (``quantization`` set in the manifest) stores every linear
weight and the LM head as the parts mesh/quant.py describes
(``self_attn.q_proj.weight.qweight``, ``.scales``, ``.mins``) and the embedding as
group-wise int8; norms and biases stay plain float32.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mesh.errors import PackageError, UnsupportedArchitecture
from mesh.quant import QuantScheme
from mesh.types import LayerRange

MANIFEST_NAME = "model-package.json"
SCHEMA_VERSION = 1
EMBED_PATH = "shared/embed.safetensors"
HEAD_PATH = "shared/head.safetensors"
FILE_KINDS = ("meta", "embed", "head", "layer")
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "Qwen2MoeForCausalLM",
    "MixtralForCausalLM",
    "GemmaForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "GlmForCausalLM",
    "Glm4ForCausalLM",
    "Glm4MoeForCausalLM",
)
# Architectures a package can be built from by re-expressing them as a supported
# one (mesh/package/fused.py): their packages record the architecture they serve as.
TRANSLATED_ARCHITECTURES = (
    "Phi3ForCausalLM",
    "Gemma3ForConditionalGeneration",
    "Mistral3ForConditionalGeneration",
    "LlavaForConditionalGeneration",
    "Qwen2VLForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration",
    "Qwen3VLForConditionalGeneration",
    "Qwen3VLMoeForConditionalGeneration",
)
DTYPES = ("float32", "bfloat16", "float16")


def layer_path(layer_index: int) -> str:
    return f"layers/{layer_index:05d}.safetensors"


def check_architecture(architecture: str) -> None:
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitecture(
            f"architecture {architecture!r} is not supported; supported: "
            + ", ".join(SUPPORTED_ARCHITECTURES)
        )


def check_source_architecture(architecture: str) -> None:
    """Whether a package can be built from a checkpoint of ``architecture``."""
    if architecture not in TRANSLATED_ARCHITECTURES:
        check_architecture(architecture)


def sha256_file(path: Path, chunk_bytes: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True)
class PackageFile:
    path: str
    kind: str
    bytes: int
    sha256: str
    layer_index: int | None = None


@dataclass(frozen=True)
class PackageManifest:
    model_id: str
    architecture: str
    model_type: str
    layer_count: int
    hidden_size: int
    vocab_size: int
    dtype: str
    tied_embeddings: bool
    source: dict[str, Any]
    files: tuple[PackageFile, ...]
    generation: dict[str, Any] | None = None
    quantization: dict[str, Any] | None = None
    schema_version: int = SCHEMA_VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    # ---- slicing -------------------------------------------------------------

    def files_for(self, layer_range: LayerRange) -> list[PackageFile]:
        """Files a stage owning ``layer_range`` needs: meta files, embed only for the
        first range, head only for the last, and the owned layers."""
        layer_range.check_within(self.layer_count)
        wanted: list[PackageFile] = []
        for entry in self.files:
            if entry.kind == "meta":
                wanted.append(entry)
            elif entry.kind == "embed" and layer_range.is_first():
                wanted.append(entry)
            elif entry.kind == "head" and layer_range.is_last(self.layer_count):
                wanted.append(entry)
            elif entry.kind == "layer" and entry.layer_index in layer_range:
                wanted.append(entry)
        return wanted

    def file(self, path: str) -> PackageFile:
        for entry in self.files:
            if entry.path == path:
                return entry
        raise PackageError(f"{MANIFEST_NAME} lists no file {path!r}")

    # ---- serialisation ----------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        body = asdict(self)
        body.pop("extra")
        body.update(self.extra)
        body["files"] = [asdict(f) for f in self.files]
        if self.generation is None:
            body.pop("generation")
        if self.quantization is None:
            body.pop("quantization")
        return body

    def compute_dtype(self, requested: str = "auto") -> str:
        """The dtype a stage computes this package in: ``auto`` is bfloat16 for a
        quantised package (torch's int4 kernels take bfloat16 activations, and
        bfloat16 halves the bytes every dense weight moves), else the package dtype."""
        if requested != "auto":
            return requested
        return "bfloat16" if self.quantization is not None else self.dtype

    def scheme(self) -> QuantScheme | None:
        """How the linear weights are stored; None for plain tensors."""
        if self.quantization is None:
            return None
        return QuantScheme.from_json(self.quantization, MANIFEST_NAME)

    def sha256(self) -> str:
        """Digest of the canonical manifest JSON: the package identity."""
        text = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def save(self, directory: Path) -> Path:
        directory = Path(directory)
        target = directory / MANIFEST_NAME
        atomic_write_text(target, json.dumps(self.to_json(), indent=2) + "\n")
        return target

    @classmethod
    def from_json(cls, body: Any, origin: str = MANIFEST_NAME) -> PackageManifest:
        if not isinstance(body, dict):
            raise PackageError(f"{origin}: expected a JSON object at the top level")
        known = {
            "schema_version",
            "model_id",
            "architecture",
            "model_type",
            "layer_count",
            "hidden_size",
            "vocab_size",
            "dtype",
            "tied_embeddings",
            "source",
            "files",
            "generation",
            "quantization",
        }
        required = known - {"generation", "quantization"}
        missing = sorted(required - body.keys())
        if missing:
            raise PackageError(f"{origin}: missing field(s) {', '.join(missing)}")
        if body["schema_version"] != SCHEMA_VERSION:
            raise PackageError(
                f"{origin}: schema_version {body['schema_version']!r} is not supported "
                f"(this build reads {SCHEMA_VERSION}); rebuild the package with mesh-package build"
            )
        check_architecture(body["architecture"])
        for name in ("layer_count", "hidden_size", "vocab_size"):
            if not isinstance(body[name], int) or body[name] <= 0:
                raise PackageError(f"{origin}: {name} must be a positive integer")
        if body["dtype"] not in DTYPES:
            raise PackageError(f"{origin}: dtype {body['dtype']!r} is not one of {DTYPES}")
        if not isinstance(body["files"], list):
            raise PackageError(f"{origin}: files must be a list")
        files = tuple(_parse_file(entry, origin) for entry in body["files"])
        paths = [f.path for f in files]
        twice = sorted({p for p in paths if paths.count(p) > 1})
        if twice:
            raise PackageError(f"{origin}: file {twice[0]!r} is listed twice in files[]")
        if body.get("quantization") is not None:
            QuantScheme.from_json(body["quantization"], origin)
        manifest = cls(
            model_id=str(body["model_id"]),
            architecture=body["architecture"],
            model_type=str(body["model_type"]),
            layer_count=body["layer_count"],
            hidden_size=body["hidden_size"],
            vocab_size=body["vocab_size"],
            dtype=body["dtype"],
            tied_embeddings=bool(body["tied_embeddings"]),
            source=dict(body["source"]),
            files=files,
            generation=body.get("generation"),
            quantization=body.get("quantization"),
            extra={k: v for k, v in body.items() if k not in known},
        )
        manifest._check_complete(origin)
        return manifest

    def _check_complete(self, origin: str) -> None:
        layers = {f.layer_index for f in self.files if f.kind == "layer"}
        expected = set(range(self.layer_count))
        if layers != expected:
            missing = sorted(expected - layers)
            raise PackageError(f"{origin}: layer files missing for layer(s) {missing[:8]}")
        kinds = {f.kind for f in self.files}
        for kind in ("embed", "head"):
            if kind not in kinds:
                raise PackageError(f"{origin}: no {kind} file listed")

    @classmethod
    def load(cls, directory: Path) -> PackageManifest:
        path = Path(directory) / MANIFEST_NAME
        if not path.is_file():
            raise PackageError(
                f"{path} not found: not a model package; build one with `mesh-package build`"
            )
        try:
            body = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
            raise PackageError(f"{path} is not valid JSON: {error}") from error
        return cls.from_json(body, origin=str(path))


def _parse_file(entry: Any, origin: str) -> PackageFile:
    if not isinstance(entry, dict):
        raise PackageError(f"{origin}: every files[] entry must be an object")
    try:
        path = str(entry["path"])
        kind = str(entry["kind"])
        size = int(entry["bytes"])
        digest = str(entry["sha256"])
    except (KeyError, TypeError, ValueError) as error:
        raise PackageError(f"{origin}: malformed files[] entry {entry!r}: {error}") from error
    if kind not in FILE_KINDS:
        raise PackageError(f"{origin}: file {path!r} has unknown kind {kind!r}")
    if path.startswith("/") or ".." in Path(path).parts:
        raise PackageError(f"{origin}: file path {path!r} must be relative and stay inside")
    if len(digest) != 64:
        raise PackageError(f"{origin}: file {path!r} has a malformed sha256")
    if size < 0:
        raise PackageError(f"{origin}: file {path!r} has a negative size ({size} bytes)")
    layer_index = entry.get("layer_index")
    if kind == "layer" and not isinstance(layer_index, int):
        raise PackageError(f"{origin}: layer file {path!r} has no integer layer_index")
    return PackageFile(path=path, kind=kind, bytes=size, sha256=digest, layer_index=layer_index)


def atomic_write_text(target: Path, text: str) -> None:
    atomic_write_bytes(target, text.encode())


def atomic_write_bytes(target: Path, data: bytes) -> None:
    """Write to a temporary file in the same directory, fsync, then rename."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, temp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(temp, 0o644)  # mkstemp creates 0600; packages are shared read-only files
        os.replace(temp, target)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
