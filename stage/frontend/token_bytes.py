"""The exact bytes each token of the vocabulary stands for.

A token can hold part of a character (a byte-level BPE splits "世" over tokens, a
SentencePiece model falls back to ``<0xE4>``-style byte tokens), so decoding it
alone gives U+FFFD. OpenAI's ``logprobs`` ``bytes`` and llama.cpp's ``bytes`` and
``/tokenize`` ``with_pieces`` exist so that clients can join such tokens back into
text; they need the token's own bytes, which this module reads from the
tokenizer's vocabulary:

- byte-level tokenizers (GPT-2's scheme: SmolLM2, Llama 3, Qwen, Mistral's Tekken):
  each character of a vocabulary entry stands for one byte, through the fixed
  byte-to-printable-character table of that scheme;
- SentencePiece-style tokenizers: ``▁`` is a space and ``<0xNN>`` byte NN, the rest
  is UTF-8;
- special and added tokens, and any other tokenizer: the UTF-8 of the token decoded
  alone.

Joining the bytes of a text's tokens gives the text's UTF-8 (SentencePiece models
may add one leading space where the model writes one, as llama.cpp's pieces do).
"""

from __future__ import annotations

import json
import logging
import re
import threading
import weakref
from typing import Any

logger = logging.getLogger(__name__)

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_tables: weakref.WeakKeyDictionary[Any, list[bytes]] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def _printable_bytes() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character each byte 0..255 is
    written as in the vocabulary, mapped back to the byte. Printable Latin-1 bytes
    stand for themselves; the others take the characters from U+0100 on, in order."""
    kept = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars: dict[str, int] = {chr(b): b for b in kept}
    extra = 0
    for byte in range(256):
        if byte not in chars.values():
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


_BYTE_LEVEL = _printable_bytes()


def _decoder_kinds(tokenizer: Any) -> set[str]:
    """The types of the fast tokenizer's decoder (and of the decoders in a
    sequence); empty where there is none to read."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return set()
    try:
        decoder = json.loads(backend.to_str()).get("decoder") or {}
    except (ValueError, AttributeError):
        return set()
    parts = decoder.get("decoders") or [decoder]
    return {str(part.get("type")) for part in parts if isinstance(part, dict)}


def _vocabulary_bytes(tokenizer: Any) -> list[bytes]:
    size = len(tokenizer)
    pieces = tokenizer.convert_ids_to_tokens(list(range(size)))
    special = set(getattr(tokenizer, "all_special_ids", ()) or ())
    added = set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    kinds = _decoder_kinds(tokenizer)
    byte_level = "ByteLevel" in kinds
    sentencepiece = "ByteFallback" in kinds or "Metaspace" in kinds
    table: list[bytes] = []
    for token, piece in enumerate(pieces):
        if token in special or token in added or not isinstance(piece, str):
            table.append(tokenizer.decode([token]).encode("utf-8"))
        elif byte_level and all(c in _BYTE_LEVEL for c in piece):
            table.append(bytes(_BYTE_LEVEL[c] for c in piece))
        elif sentencepiece:
            match = _BYTE_TOKEN.fullmatch(piece)
            if match:
                table.append(bytes([int(match.group(1), 16)]))
            else:
                table.append(piece.replace("\u2581", " ").encode("utf-8"))
        else:
            table.append(tokenizer.decode([token]).encode("utf-8"))
    return table


def byte_table(tokenizer: Any) -> list[bytes]:
    """Each token id's bytes, built once per tokenizer (a fraction of a second for a
    150,000-token vocabulary; call it off the event loop the first time)."""
    with _lock:
        table = _tables.get(tokenizer)
    if table is None:
        table = _vocabulary_bytes(tokenizer)
        with _lock:
            _tables[tokenizer] = table
    return table


def token_bytes(tokenizer: Any, token: int) -> bytes:
    """The bytes token ``token`` stands for (ids past the table: its decoded text)."""
    table = byte_table(tokenizer)
    if 0 <= token < len(table):
        return table[token]
    return tokenizer.decode([token]).encode("utf-8")


def piece(tokenizer: Any, token: int) -> str | list[int]:
    """llama.cpp's ``piece`` of a token: its text where its bytes are whole UTF-8,
    else the list of its bytes."""
    raw = token_bytes(tokenizer, token)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)
