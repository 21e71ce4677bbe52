"""Fill in the middle: code completion between a prefix and a suffix.

Code models trained for it (StarCoder, Qwen2.5-Coder, CodeLlama, DeepSeek-Coder,
Codestral, CodeGemma) complete the text between a prefix and a suffix when the
prompt lays them out with their special tokens; editors send the text before and
after the cursor. ``fim_tokens`` finds the model's tokens by their names in the
vocabulary (the names each family's tokenizer gives them, which GGUF files keep);
``fim_prompt`` lays a request out:

    PSM (most families):  [bos] <prefix-token> prefix <suffix-token> suffix <middle-token> middle
    SPM (Codestral):      [bos] <suffix-token> suffix <prefix-token> prefix middle

``middle`` is the start of the middle the client already has (llama.cpp's
``/infill`` ``prompt``), usually nothing. Files sent as context (``/infill``'s
``input_extra``) go first, each after the model's file separator token where it
has one (``<|file_sep|>`` + name + newline + text), as plain text otherwise.

The middle ends at the model's end token or at a token of the family's that closes
a middle or a file (``<|fim_pad|>``, ``<|file_sep|>``, CodeLlama's ``<EOT>``):
``FimTokens.ends``, added to the request's stop tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True)
class FimTokens:
    """A model's fill-in-the-middle tokens (ids in its vocabulary)."""

    prefix: int
    suffix: int
    # None where the family has no middle token (Codestral's SPM layout).
    middle: int | None
    order: Literal["psm", "spm"]
    # Tokens that end a middle besides the model's end token.
    ends: frozenset[int]
    file_sep: int | None
    # The token the tokenizer puts first (a Llama-family BOS), or None.
    bos: int | None


@dataclass(frozen=True)
class _Family:
    prefix: tuple[str, ...]
    suffix: tuple[str, ...]
    middle: tuple[str, ...]
    order: Literal["psm", "spm"]
    ends: tuple[str, ...] = ()
    file_sep: tuple[str, ...] = ()


# Each family's token names, the first found wins (some tokenizers spell a token two
# ways: CodeLlama's with or without the SentencePiece space mark).
_FAMILIES = (
    # Qwen2.5-Coder, CodeGemma.
    _Family(
        ("<|fim_prefix|>",),
        ("<|fim_suffix|>",),
        ("<|fim_middle|>",),
        "psm",
        ("<|fim_pad|>", "<|file_sep|>", "<|file_separator|>", "<|endoftext|>"),
        ("<|file_sep|>", "<|file_separator|>"),
    ),
    # StarCoder, StarCoder2, SantaCoder and their fine-tunes.
    _Family(
        ("<fim_prefix>", "<fim-prefix>"),
        ("<fim_suffix>", "<fim-suffix>"),
        ("<fim_middle>", "<fim-middle>"),
        "psm",
        ("<fim_pad>", "<file_sep>", "<|endoftext|>"),
        ("<file_sep>",),
    ),
    # CodeLlama.
    _Family(
        ("▁<PRE>", "<PRE>"), ("▁<SUF>", "<SUF>"), ("▁<MID>", "<MID>"), "psm", ("▁<EOT>", "<EOT>")
    ),
    # DeepSeek-Coder: begin, hole, end.
    _Family(("<｜fim▁begin｜>",), ("<｜fim▁hole｜>",), ("<｜fim▁end｜>",), "psm", ("<|EOT|>",)),
    # Codestral: [SUFFIX] suffix [PREFIX] prefix, no middle token.
    _Family(("[PREFIX]",), ("[SUFFIX]",), (), "spm"),
)


def _token_id(tokenizer: Any, names: Sequence[str]) -> int | None:
    """The id of the first of ``names`` that is a whole token of the vocabulary."""
    for name in names:
        token = tokenizer.convert_tokens_to_ids(name)
        # Unknown names map to the unknown token (or None); check the way back.
        if isinstance(token, int) and tokenizer.convert_ids_to_tokens(token) == name:
            return token
    return None


def fim_tokens(tokenizer: Any) -> FimTokens | None:
    """The tokenizer's fill-in-the-middle tokens, or None when it has none."""
    for family in _FAMILIES:
        prefix = _token_id(tokenizer, family.prefix)
        suffix = _token_id(tokenizer, family.suffix)
        middle = _token_id(tokenizer, family.middle) if family.middle else None
        if prefix is None or suffix is None or (family.middle and middle is None):
            continue
        ends = (_token_id(tokenizer, (name,)) for name in family.ends)
        return FimTokens(
            prefix=prefix,
            suffix=suffix,
            middle=middle,
            order=family.order,
            ends=frozenset(t for t in ends if t is not None),
            file_sep=_token_id(tokenizer, family.file_sep),
            bos=_leading_token(tokenizer),
        )
    return None


def _leading_token(tokenizer: Any) -> int | None:
    """The BOS the tokenizer adds in front of a text, if it adds one."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    added = list(tokenizer("", add_special_tokens=True)["input_ids"])
    return bos if added[:1] == [bos] else None


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """A piece of the layout: its tokens without the tokenizer's own special tokens."""
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)] if text else []


def extra_tokens(tokenizer: Any, fim: FimTokens, files: Sequence[tuple[str, str]]) -> list[int]:
    """Context files (name, text) laid out before the prefix."""
    out: list[int] = []
    for name, text in files:
        body = text if not text or text.endswith("\n") else text + "\n"
        if fim.file_sep is not None:
            out.append(fim.file_sep)
        out.extend(encode_text(tokenizer, f"{name}\n{body}" if name else body))
    return out


def fim_prompt(
    fim: FimTokens,
    prefix: Sequence[int],
    suffix: Sequence[int],
    middle: Sequence[int] = (),
    extra: Sequence[int] = (),
) -> list[int]:
    """The prompt's token ids for a fill between ``prefix`` and ``suffix``."""
    out = [fim.bos] if fim.bos is not None else []
    out.extend(extra)
    if fim.order == "spm":
        out += [fim.suffix, *suffix, fim.prefix, *prefix]
    else:
        out += [fim.prefix, *prefix, fim.suffix, *suffix]
    if fim.middle is not None:
        out.append(fim.middle)
    out.extend(middle)
    return out


def fit_to_room(
    prefix: list[int], suffix: list[int], extra: list[list[int]], room: int
) -> tuple[list[int], list[int], list[list[int]], bool]:
    """Cut a fill's parts to ``room`` tokens, as llama.cpp's ``/infill`` does: the
    context files go first (the earliest first), then the prefix loses its start and
    the suffix its end, the suffix keeping at most a quarter of the room. Returns the
    parts and whether anything was cut."""
    extra = list(extra)
    total = len(prefix) + len(suffix) + sum(len(chunk) for chunk in extra)
    if total <= room:
        return prefix, suffix, extra, False
    while extra and total > room:
        total -= len(extra.pop(0))
    if total <= room:
        return prefix, suffix, extra, True
    room = max(room, 0)
    keep_suffix = min(len(suffix), max(room // 4, room - len(prefix)))
    keep_prefix = min(len(prefix), room - keep_suffix)
    return prefix[len(prefix) - keep_prefix :], suffix[:keep_suffix], [], True
