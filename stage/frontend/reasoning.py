"""Reasoning models' thoughts, apart from their answer.

Models such as DeepSeek-R1 (and its distills), QwQ and Qwen3 think before they
answer, between ``<think>`` and ``</think>``; Magistral between ``[THINK]`` and
``[/THINK]``. The chat API returns the thoughts as ``reasoning_content`` (the field
DeepSeek's API, vLLM and llama.cpp use) and only the rest as ``content``, so that
clients show the answer and tools parse it.

Whether a request's output is split follows the server's ``reasoning_format``:
``auto`` splits where the model's chat template speaks of one of the tag pairs
(``TAGS``, the first found), ``none`` never does. A template that opens the
thought itself (the prompt ends with the opening tag, as DeepSeek-R1's does)
starts the output inside it; otherwise a thought counts only at the very start of
the output. An output that ends before the closing tag is all thought.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Tags:
    """The tags around a thought."""

    open: str
    close: str


THINK = Tags("<think>", "</think>")
# Magistral (its template and tokenizer: special tokens in the 2509 release).
MISTRAL_THINK = Tags("[THINK]", "[/THINK]")
TAGS = (THINK, MISTRAL_THINK)
REASONING_FORMATS = ("auto", "none")
# Prompt tokens decoded to see whether the template opened a thought.
PROMPT_TAIL_TOKENS = 8


@dataclass(frozen=True)
class Thought:
    """How a request's output is split: its tags, and whether it starts inside a
    thought (the template opened one)."""

    inside: bool
    tags: Tags = THINK


def _thought(start: Thought | bool) -> Thought:
    return start if isinstance(start, Thought) else Thought(start)


def template_tags(tokenizer: Any) -> Tags | None:
    """The tags the model's chat template speaks of, or None."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        return None
    return next((tags for tags in TAGS if tags.open in template), None)


def reasoning_start(
    tokenizer: Any, prompt: Sequence[int], reasoning_format: str = "auto"
) -> Thought | None:
    """For a chat request of ``prompt`` tokens: None when its output is not split,
    else its tags and whether the output starts inside a thought."""
    if reasoning_format == "none":
        return None
    tags = template_tags(tokenizer)
    if tags is None:
        return None
    tail = tokenizer.decode(list(prompt[-PROMPT_TAIL_TOKENS:]), skip_special_tokens=False)
    return Thought(tail.rstrip().endswith(tags.open), tags)


class ThoughtTokens:
    """Counts an output's thought tokens from its token ids, for ``usage``: exact
    where the model's tokenizer has ``<think>`` and ``</think>`` as single tokens
    (reasoning models' tokenizers do), else not counted (``count`` None)."""

    def __init__(self, tokenizer: Any, start: Thought | bool) -> None:
        thought = _thought(start)
        inside = thought.inside
        open_ids = tokenizer.encode(thought.tags.open, add_special_tokens=False)
        close_ids = tokenizer.encode(thought.tags.close, add_special_tokens=False)
        single = len(open_ids) == 1 and len(close_ids) == 1
        self._open = open_ids[0] if single else None
        self._close = close_ids[0] if single else None
        self.count: int | None = 0 if single else None
        self._inside = inside
        self._started = inside
        self._done = not single

    def push(self, token: int) -> None:
        if self._done:
            return
        if not self._started:
            self._started = True
            self._inside = token == self._open
            if not self._inside:
                self._done = True
                return
        assert self.count is not None
        self.count += 1
        if token == self._close:
            self._done = True


def is_special_token(tokenizer: Any, text: str) -> bool:
    """Whether ``text`` is one token the tokenizer holds as special, which decoding
    with special tokens skipped leaves out of the text."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        return False
    entry = (getattr(tokenizer, "added_tokens_decoder", None) or {}).get(ids[0])
    if entry is not None and bool(getattr(entry, "special", False)):
        return True
    return ids[0] in set(getattr(tokenizer, "all_special_ids", ()) or ())


def tags_are_special(tokenizer: Any, tags: Tags = THINK) -> bool:
    """Whether the tokenizer has the thought's tags as special tokens, which decoding
    would leave out: such a model's text is decoded with special tokens kept, so that
    the split sees its tags."""
    return all(is_special_token(tokenizer, tag) for tag in (tags.open, tags.close))


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that starts ``tag`` (held back: the tag
    may be completed by the next piece)."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


@dataclass
class ReasoningSplitter:
    """Splits an output's text, piece by piece as it streams, into thought and answer.
    ``feed`` returns what can be released now; ``flush`` the rest at the end."""

    inside: bool
    tags: Tags = field(default=THINK)
    # Whether the output may still open a thought (only before any visible answer).
    _may_open: bool = True
    _pending: str = ""
    # Whether the answer has begun (whitespace right after ``</think>`` is dropped).
    _answer_started: bool = False
    reasoning: str = ""
    content: str = ""

    def __post_init__(self) -> None:
        self._may_open = not self.inside

    def feed(self, text: str) -> tuple[str, str]:
        """(thought, answer) text released by ``text``."""
        thought, answer = [], []
        rest = self._pending + text
        self._pending = ""
        while rest:
            if self.inside:
                end = rest.find(self.tags.close)
                if end < 0:
                    keep = _partial_tag(rest, self.tags.close)
                    thought.append(rest[: len(rest) - keep])
                    self._pending = rest[len(rest) - keep :]
                    break
                thought.append(rest[:end])
                rest = rest[end + len(self.tags.close) :]
                self.inside = False
                continue
            if self._may_open:
                stripped = rest.lstrip()
                if not stripped:
                    self._pending = rest
                    break
                if stripped.startswith(self.tags.open):
                    rest = stripped[len(self.tags.open) :]
                    self.inside, self._may_open = True, False
                    continue
                if self.tags.open.startswith(stripped):
                    self._pending = rest
                    break
                self._may_open = False
            if not self._answer_started:
                rest = rest.lstrip()
                if not rest:
                    break
                self._answer_started = True
            answer.append(rest)
            break
        released = "".join(thought), "".join(answer)
        self.reasoning += released[0]
        self.content += released[1]
        return released

    def flush(self) -> tuple[str, str]:
        """What was held back, at the end of the output: an unfinished tag is text."""
        rest, self._pending = self._pending, ""
        if self.inside:
            self.reasoning += rest
            return rest, ""
        rest = rest if self._answer_started else rest.lstrip()
        self.content += rest
        return "", rest


def split_reasoning(text: str, start: Thought | bool) -> tuple[str | None, str]:
    """(thought or None when there was none, answer) of a whole output."""
    thought = _thought(start)
    splitter = ReasoningSplitter(thought.inside, thought.tags)
    splitter.feed(text)
    splitter.flush()
    had = thought.inside or splitter.reasoning or splitter.inside
    return (splitter.reasoning if had else None), splitter.content


def splitter_for(start: Thought | bool) -> ReasoningSplitter:
    """A streaming splitter for an output that starts as ``start`` says."""
    thought = _thought(start)
    return ReasoningSplitter(thought.inside, thought.tags)


async def split_pieces(
    texts: AsyncIterator[str], reasoning: Thought | bool | None
) -> AsyncIterator[tuple[str, str]]:
    """(thought, answer) pieces of a streamed output: all answer unless ``reasoning``
    (where the output starts, as ``reasoning_start`` says) is set."""
    splitter = splitter_for(reasoning) if reasoning is not None else None
    async for text in texts:
        yield splitter.feed(text) if splitter is not None else ("", text)
    if splitter is not None:
        yield splitter.flush()
