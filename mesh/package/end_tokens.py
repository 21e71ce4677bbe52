"""The tokens that end a model's answer.

A chat model ends its turn with a token that is often not its tokenizer's EOS:
Gemma 2 and 3 with ``<end_of_turn>`` (EOS is ``<eos>``), Phi-3 with ``<|end|>`` (EOS
is ``<|endoftext|>``), Llama 3.1-3.3 with ``<|eot_id|>`` or, after a tool call,
``<|eom_id|>``; GLM-4 with ``<|user|>`` or ``<|observation|>``. Hugging Face
checkpoints list them all in ``generation_config.json`` (``eos_token_id``, one id or
a list), which ``generate`` stops at; the package keeps that file. A GGUF file holds
one EOS id plus, where its converter wrote them, end-of-turn and end-of-message ids
(``tokenizer.ggml.eot_token_id`` / ``eom_token_id``); llama.cpp also ends at any
control token spelled as one of the usual end markers (``END_MARKERS``). The build
gathers those into the package's ``generation_config.json`` (``gguf_end_tokens``) and
the frontend stops at every id there and at the tokenizer's EOS (``end_tokens``).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

GENERATION_CONFIG = "generation_config.json"
# End markers of the common chat formats (as llama.cpp's vocabulary loader treats
# them: a control token with one of these texts ends generation).
END_MARKERS = frozenset(
    {
        "<|eot_id|>",
        "<|eom_id|>",
        "<|im_end|>",
        "<|end|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<|end_of_text|>",
        "<EOT>",
        "<|return|>",
        "<|call|>",
    }
)
_ID_FIELDS = (
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.eom_token_id",
)
# gguf's token type of control tokens.
_CONTROL = 3


def gguf_end_tokens(reader: Any) -> tuple[int, ...]:
    """The ids that end an answer in a GGUF (a ``gguf.GGUFReader``): its EOS,
    end-of-turn and end-of-message ids, and its control tokens spelled as an end
    marker; EOS first."""
    found: list[int] = []
    for key in _ID_FIELDS:
        field = reader.fields.get(key)
        if field is not None and field.data:
            found.append(int(field.parts[field.data[0]][0]))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    types = reader.fields.get("tokenizer.ggml.token_type")
    if tokens is not None and types is not None and len(types.data) == len(tokens.data):
        markers = {marker.encode() for marker in END_MARKERS}
        for index, (part, kind) in enumerate(zip(tokens.data, types.data, strict=True)):
            text = bytes(tokens.parts[part])
            if text in markers and int(types.parts[kind][0]) == _CONTROL:
                found.append(index)
    return tuple(dict.fromkeys(found))


def read_generation_config(package_dir: Path | str | None) -> dict[str, Any]:
    """A package's ``generation_config.json`` as an object; {} when it is missing,
    unreadable or not an object (logged)."""
    if package_dir is None:
        return {}
    path = Path(package_dir) / GENERATION_CONFIG
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        logger.warning("cannot read %s (%s): it is left out", path, error)
        return {}
    return raw if isinstance(raw, dict) else {}


def end_tokens(tokenizer: Any, package_dir: Path | str | None) -> frozenset[int]:
    """The ids the frontend ends an answer at: the tokenizer's EOS and every
    ``eos_token_id`` of the package's ``generation_config.json``."""
    ids: set[int] = set()
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is not None:
        ids.add(int(eos))
    listed = read_generation_config(package_dir).get("eos_token_id")
    if isinstance(listed, int):
        ids.add(listed)
    elif isinstance(listed, list):
        ids.update(int(token) for token in listed if isinstance(token, int))
    return frozenset(ids)
