"""Checkpoints a package can be built from: an HF safetensors directory (local or a
hub snapshot) or a GGUF model (one file or split into parts).

A Checkpoint exposes the model description, the config to write, tensors by
checkpoint name (read lazily: one tensor, or a few rows of one, at a time, so a
build never holds the model) and the tokenizer and generation files to copy into the
package.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
from abc import ABC, abstractmethod
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from huggingface_hub.errors import StrictDataclassError

from mesh.errors import PackageError, UnsupportedArchitecture
from mesh.package import hub
from mesh.package.embedded import DEFAULT_MODEL_ID, default_gguf_path, default_source_info
from mesh.package.gguf_experts import moe_config
from mesh.package.gguf_file import GgufModel, split_stem
from mesh.package.gguf_gemma import gemma_config
from mesh.package.gguf_quant import GgufQuantReader
from mesh.package.gguf_rope import ROPE_TENSORS, rope_config
from mesh.package.manifest import (
    MANIFEST_NAME,
    TRANSLATED_ARCHITECTURES,
    check_source_architecture,
)

logger = logging.getLogger(__name__)
# What transformers raises for a config it cannot read (a wrongly typed field is a
# huggingface_hub validation error).
CONFIG_ERRORS = (OSError, ValueError, KeyError, TypeError, StrictDataclassError)

META_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)
CHAT_TEMPLATE_DIR = "additional_chat_templates"
INDEX_FILE = "model.safetensors.index.json"
HUB_PATTERNS = [
    "*.json",
    "*.safetensors",
    "*.jinja",
    "*.txt",
    "tokenizer.model",
    f"{CHAT_TEMPLATE_DIR}/*",
]
_SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I8": 1, "U8": 1, "BOOL": 1}
# Keys a GGUF-loaded config carries that make no sense for plain safetensors weights.
_GGUF_CONFIG_LEFTOVERS = ("quantization_config", "_model_name_or_path", "_name_or_path")
# GGUF architectures not read: transformers has no config reader for the first
# Gemma's files (Gemma 2 and 3 are read, mesh/package/gguf_gemma.py).
_GGUF_UNREAD = {"gemma": "Gemma"}


def _head_size(settings: dict[str, Any], config: Any) -> Any:
    """``config`` with the file's head size (``attention.key_length``), which
    transformers' GGUF reader keeps for some architectures only: a Qwen3 file read
    without it gets Qwen3's default 128 where Qwen3-0.6B, 4B and 32B have other
    sizes than hidden / heads. Keys and values of different sizes are refused."""
    keys = settings.get("attention.key_length")
    values = settings.get("attention.value_length", keys)
    if keys is None:
        return config
    if int(values) != int(keys):
        raise UnsupportedArchitecture(
            f"GGUF attention heads with keys of {int(keys)} and values of {int(values)} "
            "dimensions are not supported"
        )
    config.head_dim = int(keys)
    return config


@dataclass(frozen=True)
class ModelDescription:
    architecture: str
    model_type: str
    layer_count: int
    hidden_size: int
    vocab_size: int
    tied_embeddings: bool


def architecture_of(raw_config: dict[str, Any]) -> str:
    """The ``*ForCausalLM`` class of a config, checked against the supported list."""
    architectures = raw_config.get("architectures") or []
    if architectures:
        architecture = str(architectures[0])
    else:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        model_type = raw_config.get("model_type")
        mapped = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(str(model_type))
        if mapped is None:
            raise UnsupportedArchitecture(
                f"config.json names no architecture and model_type {model_type!r} has no "
                "causal-LM class; supported model types: llama, mistral, qwen2, qwen3, "
                "qwen2_moe, qwen3_moe, mixtral, phi3, gemma, gemma2, gemma3_text, glm, "
                "glm4, glm4_moe"
            )
        architecture = mapped
    check_source_architecture(architecture)
    return architecture


def describe(config: Any, architecture: str) -> ModelDescription:
    # A multimodal config nests its language model's (transformers' get_text_config).
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return ModelDescription(
        architecture=architecture,
        model_type=str(config.model_type),
        layer_count=int(config.num_hidden_layers),
        hidden_size=int(config.hidden_size),
        vocab_size=int(config.vocab_size),
        tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
    )


class Checkpoint(ABC):
    description: ModelDescription
    config_json: dict[str, Any]
    source: dict[str, Any]
    default_model_id: str

    @abstractmethod
    def tensor_names(self) -> list[str]: ...

    @abstractmethod
    def tensor(self, name: str) -> torch.Tensor:
        """The whole tensor (read for small ones: norms, biases)."""

    @abstractmethod
    def shape(self, name: str) -> tuple[int, ...]: ...

    @abstractmethod
    def rows(self, name: str, first: int, count: int) -> torch.Tensor:
        """Rows ``first .. first + count`` of a 2-D tensor, read without the rest."""

    def row_unit(self, name: str) -> int:
        """Reads of ``name`` start and end on multiples of this many rows."""
        return 1

    @abstractmethod
    def nbytes(self, name: str) -> int:
        """How many bytes the checkpoint stores ``name`` in."""

    @abstractmethod
    def write_meta(self, out_dir: Path) -> None:
        """Write tokenizer and generation files (everything but config.json) into out_dir."""

    def has_codes(self, name: str, kind: str, group: int) -> bool:
        """Whether the checkpoint stores ``name`` as codes that are exactly quantised
        form ``kind`` (int4 or int8g, mesh/quant.py) with ``group``."""
        return False

    def quantized_parts(
        self, name: str, kind: str, group: int, first: int, count: int
    ) -> dict[str, torch.Tensor]:
        """Rows ``first .. first + count`` of those codes (see ``has_codes``)."""
        raise PackageError(f"{name} is not stored as {kind} codes")

    def source_type(self, name: str) -> str:
        """How the checkpoint stores ``name`` (a dtype or a GGUF block type)."""
        return "float"

    def close(self) -> None:
        return None

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def refuse_prequantised(config: dict[str, Any], where: Path) -> None:
    """A checkpoint quantised by another tool (FP8 with its scales, GPTQ, AWQ,
    bitsandbytes: ``quantization_config`` in its config) holds tensors no stage reads:
    refused here, not at the first load."""
    quantized = config.get("quantization_config")
    if quantized is None:
        return
    method = quantized.get("quant_method", "unknown") if isinstance(quantized, dict) else "unknown"
    raise PackageError(
        f"{where} is a pre-quantised checkpoint ({method}): its tensors are not plain "
        "weights, and packages are built from float weights (float32, float16, bfloat16) "
        "or a GGUF file. Build from the unquantised checkpoint (add --quant int4 or int8 "
        "for small weights) or from a GGUF of the model"
    )


class SafetensorsCheckpoint(Checkpoint):
    """An HF model directory with ``*.safetensors`` weights, sharded or not."""

    def __init__(self, directory: Path, source: dict[str, Any], default_model_id: str) -> None:
        from transformers import AutoConfig

        self.directory = Path(directory)
        self.source = source
        self.default_model_id = default_model_id
        config_path = self.directory / "config.json"
        try:
            self.config_json = json.loads(config_path.read_text())
        except FileNotFoundError as error:
            raise PackageError(
                f"{config_path} not found: not a Hugging Face model directory"
            ) from error
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
            raise PackageError(f"{config_path} is not valid JSON: {error}") from error
        if not isinstance(self.config_json, dict):
            raise PackageError(f"{config_path}: expected a JSON object")
        refuse_prequantised(self.config_json, config_path)
        architecture = architecture_of(self.config_json)
        try:
            config = AutoConfig.from_pretrained(self.directory)
        except CONFIG_ERRORS as error:
            raise PackageError(
                f"{config_path} cannot be loaded by transformers: {error}"
            ) from error
        self.description = describe(config, architecture)
        self._weight_map = self._find_weights()
        self._stack = ExitStack()
        self._handles: dict[str, Any] = {}

    def _find_weights(self) -> dict[str, str]:
        from safetensors import safe_open

        index = self.directory / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as error:
                raise PackageError(f"{index} is not a valid safetensors index: {error}") from error
            for shard in sorted(set(weight_map.values())):
                if not (self.directory / shard).is_file():
                    raise PackageError(f"{index} lists shard {shard!r}, which is missing")
            return {str(name): str(shard) for name, shard in weight_map.items()}
        shards = sorted(p.name for p in self.directory.glob("*.safetensors"))
        if not shards:
            if any(self.directory.glob("*.bin")) or any(self.directory.glob("*.pt")):
                raise PackageError(
                    f"{self.directory} holds only PyTorch pickle weights; mesh-package reads "
                    "safetensors only: re-save the model with safe_serialization=True"
                )
            raise PackageError(f"{self.directory} has no *.safetensors weights")
        weight_map = {}
        for shard in shards:
            with safe_open(str(self.directory / shard), framework="pt") as handle:
                weight_map.update({name: shard for name in handle.keys()})
        return weight_map

    def tensor_names(self) -> list[str]:
        return list(self._weight_map)

    def _handle(self, name: str) -> Any:
        from safetensors import safe_open

        shard = self._weight_map[name]
        handle = self._handles.get(shard)
        if handle is None:
            try:
                opened = safe_open(str(self.directory / shard), framework="pt")
            except (OSError, RuntimeError, ValueError) as error:
                raise PackageError(f"cannot read {self.directory / shard}: {error}") from error
            handle = self._stack.enter_context(opened)
            self._handles[shard] = handle
        return handle

    def tensor(self, name: str) -> torch.Tensor:
        return self._handle(name).get_tensor(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(n) for n in self._handle(name).get_slice(name).get_shape())

    def rows(self, name: str, first: int, count: int) -> torch.Tensor:
        return self._handle(name).get_slice(name)[first : first + count]

    def nbytes(self, name: str) -> int:
        part = self._handle(name).get_slice(name)
        width = _SAFETENSORS_BYTES.get(str(part.get_dtype()), 4)
        return math.prod(int(n) for n in part.get_shape()) * width

    def write_meta(self, out_dir: Path) -> None:
        for name in META_FILES:
            if (self.directory / name).is_file():
                shutil.copyfile(self.directory / name, out_dir / name)
        templates = self.directory / CHAT_TEMPLATE_DIR
        if templates.is_dir():
            (out_dir / CHAT_TEMPLATE_DIR).mkdir(exist_ok=True)
            for template in sorted(templates.glob("*.jinja")):
                shutil.copyfile(template, out_dir / CHAT_TEMPLATE_DIR / template.name)

    def close(self) -> None:
        self._handles.clear()
        self._stack.close()


class GgufCheckpoint(Checkpoint):
    """A GGUF model (one file, or every part of a split one), read one tensor or a
    few rows at a time: the config and tokenizer come from its metadata through
    transformers, the weights through ``mesh.package.gguf_file``."""

    def __init__(self, path: Path, source: dict[str, Any], default_model_id: str) -> None:
        from transformers import AutoConfig, GenerationConfig
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        self.source = source
        self.default_model_id = default_model_id
        model = GgufModel(Path(path))
        # The metadata (config, tokenizer) is in the first part of a split file.
        self.path = model.parts[0]
        family = _GGUF_UNREAD.get(model.architecture)
        if family is not None:
            raise UnsupportedArchitecture(
                f"GGUF {self.path.name} holds a {family} model, whose GGUF files are not "
                "read. Build the package from the Hugging Face checkpoint (its "
                "safetensors directory or repo id) instead; --quant int4 or int8 "
                "quantises it"
            )
        try:
            config = AutoConfig.from_pretrained(self.path.parent, gguf_file=self.path.name)
        except CONFIG_ERRORS + (RuntimeError,) as error:
            raise PackageError(
                f"cannot read the model config of GGUF {self.path}: {error}"
            ) from error
        config = _head_size(model.settings, config)
        config = moe_config(model.architecture, model.experts, model.tensors, config)
        config = gemma_config(model.architecture, model.settings, config)
        config = rope_config(model.architecture, model, config)
        architecture = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(str(config.model_type))
        if architecture is None:
            raise UnsupportedArchitecture(
                f"GGUF {self.path.name} holds a {model.architecture!r} model (model_type "
                f"{config.model_type!r}), which has no causal-LM class"
            )
        check_source_architecture(architecture)
        # A split file's first part may lack output.weight: decide from every part.
        config.tie_word_embeddings = "output.weight" not in model.tensors
        self.description = describe(config, architecture)
        config_json = json.loads(config.to_json_string(use_diff=True))
        for key in _GGUF_CONFIG_LEFTOVERS:
            config_json.pop(key, None)
        config_json["architectures"] = [architecture]
        self.config_json = config_json
        self._generation_config = GenerationConfig.from_model_config(config)
        if len(model.end_token_ids) > 1:
            # Every id that ends an answer, as Hugging Face checkpoints list them.
            self._generation_config.eos_token_id = list(model.end_token_ids)
        self._has_tokenizer = model.has_tokenizer
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        self._reader = GgufQuantReader(model, heads, kv_heads)
        ignored = [name for name in self._reader.unmapped() if name not in ROPE_TENSORS]
        if ignored:
            logger.info("GGUF tensors not used: %s", ", ".join(ignored[:8]))
        if len(model.parts) > 1:
            logger.info("reading split GGUF: %s", ", ".join(p.name for p in model.parts))

    def has_codes(self, name: str, kind: str, group: int) -> bool:
        return self._reader.converts(name, kind, group)

    def quantized_parts(
        self, name: str, kind: str, group: int, first: int, count: int
    ) -> dict[str, torch.Tensor]:
        return self._reader.parts(name, kind, first, count)

    def source_type(self, name: str) -> str:
        return self._reader.type_name(name) or "float"

    def tensor_names(self) -> list[str]:
        return self._reader.names()

    def tensor(self, name: str) -> torch.Tensor:
        return self._reader.tensor(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._reader.shape(name)

    def rows(self, name: str, first: int, count: int) -> torch.Tensor:
        return self._reader.float_rows(name, first, count)

    def row_unit(self, name: str) -> int:
        return self._reader.row_unit(name)

    def nbytes(self, name: str) -> int:
        return self._reader.nbytes(name)

    def write_meta(self, out_dir: Path) -> None:
        from transformers import AutoTokenizer

        if self._generation_config is not None:
            self._generation_config.save_pretrained(out_dir)
        if not self._has_tokenizer:
            logger.warning("GGUF %s carries no tokenizer", self.path)
            return
        try:
            tokenizer = AutoTokenizer.from_pretrained(self.path.parent, gguf_file=self.path.name)
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise PackageError(f"cannot load the tokenizer of GGUF {self.path}: {error}") from error
        if not tokenizer.chat_template:
            logger.warning("GGUF %s carries no chat template", self.path)
        tokenizer.save_pretrained(out_dir)


def gguf_source(src: str) -> Path | None:
    """The GGUF file (or first part) ``src`` names, or None when it names another
    kind of source."""
    if src == "default":
        return None
    path = Path(src).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path.resolve()
    if path.is_dir() and not (path / "config.json").is_file():
        ggufs = sorted(path.resolve().glob("*.gguf"))
        stems = {split_stem(g) for g in ggufs}
        if len(ggufs) == 1 or (len(stems) == 1 and None not in stems):
            return ggufs[0]
    return None


def open_checkpoint(src: str) -> Checkpoint:
    """Open ``src``: ``default``, a ``.gguf`` file, an HF model directory, or an HF
    repo id ``org/name[@revision]`` (fetched with huggingface_hub). A checkpoint of
    an architecture served as another (Phi-3 as Llama, Gemma 3's multimodal models as
    their text model) comes in that one's layout."""
    checkpoint = _open_source(src)
    architecture = checkpoint.description.architecture
    if architecture in TRANSLATED_ARCHITECTURES:
        from mesh.package.fused import LlamaLayout
        from mesh.package.textonly import TEXT_MODELS, TextOnlyLayout

        try:
            if architecture in TEXT_MODELS:
                return TextOnlyLayout(checkpoint)
            return LlamaLayout(checkpoint)
        except BaseException:
            checkpoint.close()
            raise
    return checkpoint


def _open_source(src: str) -> Checkpoint:
    if src == "default":
        gguf = default_gguf_path()
        return GgufCheckpoint(gguf, default_source_info(gguf), DEFAULT_MODEL_ID)
    path = Path(src).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise PackageError(
                f"{path} is a file but not a .gguf; pass a model directory or a GGUF"
            )
        resolved = path.resolve()
        source = {"kind": "gguf", "file": resolved.name, "path": str(resolved)}
        return GgufCheckpoint(resolved, source, resolved.stem)
    if path.is_dir():
        resolved = path.resolve()
        if (resolved / MANIFEST_NAME).is_file():
            raise PackageError(
                f"{resolved} is already a model package ({MANIFEST_NAME}), not a checkpoint: "
                "serve it as it is (`mesh-coordinator up --model` that directory), or build "
                "from the checkpoint it was made from"
            )
        if (resolved / "config.json").is_file():
            source = {"kind": "hf-dir", "path": str(resolved)}
            return SafetensorsCheckpoint(resolved, source, resolved.name)
        ggufs = sorted(resolved.glob("*.gguf"))
        stems = {split_stem(g) for g in ggufs}
        if len(ggufs) == 1 or (len(stems) == 1 and None not in stems):
            # One model, or the parts of one split model (their names sort in order).
            return _open_source(str(ggufs[0]))
        raise PackageError(
            f"{resolved} has no config.json"
            + (f" and {len(ggufs)} .gguf files: pass one of them" if ggufs else "")
        )
    ref = hub.parse_repo_ref(src)
    if ref is None:
        raise PackageError(
            f"model source {src!r} not found: expected a Hugging Face model directory, a .gguf "
            "file, a Hugging Face repo id (org/name or org/name@revision) or 'default'"
        )
    folder = hub.snapshot(ref, HUB_PATTERNS)
    source = {"kind": "hf-repo", "repo": ref.repo_id, "revision": folder.name}
    return SafetensorsCheckpoint(folder, source, ref.repo_id)
