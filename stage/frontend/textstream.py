"""Incremental detokenisation and stop strings.

``IncrementalDecoder`` turns a growing list of token ids into text deltas whose
concatenation equals decoding the whole list at once. It decodes a short window
(a few tokens already emitted, as context, plus the new ones) and emits the
difference, so a token that starts a multi-byte character, or a tokenizer that
drops a leading space at the start of a decode, never produces wrong text; text
that ends in an incomplete character is held back until the next token completes it.

A stream may start after context tokens (the prompt's last few), which are decoded
but not emitted: the first token's text is then what it adds to them.

``TextStream`` adds stop strings on top: it releases only text that cannot be the
start of a stop string, and when a stop string appears it cuts the text before it
(or right after it, with ``include_stop``) and reports ``stopped``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

_REPLACEMENT = "\ufffd"
# Tokens kept before the new ones as decoding context.
_CONTEXT_TOKENS = 5


class Decoder(Protocol):
    def decode(self, token_ids: Sequence[int], **kwargs) -> str: ...


class IncrementalDecoder:
    """Text deltas from a token stream, consistent with a full decode."""

    def __init__(
        self,
        tokenizer: Decoder,
        *,
        skip_special_tokens: bool = True,
        context: Sequence[int] = (),
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        # ``context``: tokens before the stream (the prompt's last few), decoded as
        # context only, so that the first token's text is what it adds after them (a
        # SentencePiece tokenizer strips the leading space of a decode's first word:
        # " Paris" after "The capital of France is", not "Paris").
        self._ids: list[int] = list(context)
        self._context = len(self._ids)
        self._prefix_offset = 0  # start of the context window
        self._read_offset = self._context  # tokens up to here have been turned into text

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(
            list(token_ids),
            skip_special_tokens=self._skip_special,
            clean_up_tokenization_spaces=False,
        )

    @property
    def token_count(self) -> int:
        return len(self._ids) - self._context

    def push(self, token_ids: Iterable[int]) -> str:
        """Add tokens; return the text they completed (possibly empty)."""
        self._ids.extend(token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """Return any held-back text (an incomplete character becomes U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        if not final and full_text.endswith(_REPLACEMENT):
            return ""
        if not full_text.startswith(prefix_text):
            # The context decoded differently once more tokens followed it; fall back
            # to diffing decodes from the very start, which is always consistent.
            prefix_text = self._decode(self._ids[: self._read_offset])
            full_text = self._decode(self._ids)
            if not full_text.startswith(prefix_text):
                prefix_text = prefix_text[: _common_prefix(prefix_text, full_text)]
        delta = full_text[len(prefix_text) :]
        self._read_offset = len(self._ids)
        self._prefix_offset = max(0, self._read_offset - _CONTEXT_TOKENS)
        return delta


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class TextStream:
    """Completion text from token ids, cut at the first stop string."""

    def __init__(
        self,
        tokenizer: Decoder,
        stop: Sequence[str] = (),
        *,
        skip_special_tokens: bool = True,
        include_stop: bool = False,
        context: Sequence[int] = (),
        shield: Callable[[str], int] | None = None,
        cut: Callable[[str], int | None] | None = None,
    ) -> None:
        """``shield``: where in the text so far stop strings stop applying (the start
        of a tool call, whose markup a stop string must not cut); None: nowhere.
        ``cut``: where the text so far must end, as at a stop string that is not
        kept (a repeated tool call), or None."""
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._decoder = IncrementalDecoder(
            tokenizer, skip_special_tokens=skip_special_tokens, context=context
        )
        self._stop = tuple(stop)
        self._shield = shield
        self._cut = cut
        # Whether the text keeps the stop string that ended it (it ends right after).
        self._include_stop = include_stop
        self._text = ""  # everything decoded so far
        self._sent = 0  # characters of _text already released
        self.stopped = False
        self.stop_string: str | None = None

    @property
    def text(self) -> str:
        """The text released so far."""
        return self._text[: self._sent]

    def push(self, token_ids: Iterable[int]) -> str:
        """Add tokens; return newly released text. After a stop string, returns ''."""
        if self.stopped:
            return ""
        self._text += self._decoder.push(token_ids)
        return self._release(final=False)

    def finish(self) -> str:
        """Generation ended without a stop string: release everything held back."""
        if self.stopped:
            return ""
        self._text += self._decoder.flush()
        return self._release(final=True)

    def _release(self, *, final: bool) -> str:
        cut = self._find_stop()
        if cut is not None:
            self.stopped = True
            end = cut + len(self.stop_string or "") if self._include_stop else cut
        elif final:
            end = len(self._text)
        else:
            end = len(self._text) - self._held_back()
        delta = self._text[self._sent : end]
        self._sent = max(self._sent, end)
        return delta

    def _find_stop(self) -> int | None:
        """Index of the earliest stop string at or after the released text."""
        best: int | None = None
        limit = self._shield(self._text) if self._shield is not None and self._stop else None
        for stop in self._stop:
            index = self._text.find(stop, self._sent)
            if limit is not None and index >= limit:
                continue  # inside a tool call's markup
            if index >= 0 and (best is None or index < best):
                best = index
                self.stop_string = stop
        if self._cut is not None:
            at = self._cut(self._text)
            if at is not None and (best is None or at < best):
                best, self.stop_string = max(at, self._sent), None
        return best

    def _held_back(self) -> int:
        """Length of the longest unreleased suffix that is a prefix of a stop string."""
        pending = self._text[self._sent :]
        longest = 0
        for stop in self._stop:
            for size in range(min(len(stop) - 1, len(pending)), longest, -1):
                if pending.endswith(stop[:size]):
                    longest = size
                    break
        return longest
