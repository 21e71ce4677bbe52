"""Structured output: the grammar a request's output must follow, as token masks.

OpenAI's ``response_format`` (``json_object``, ``json_schema``), and the regular
expressions, lists of choices and context-free grammars vLLM's and llama.cpp's
clients send, become a grammar spec, a canonical JSON text carried in
``SamplingParams.grammar``. The last stage
turns the spec into a matcher of the llguidance library (chosen over xgrammar and
outlines-core by measured mask cost and compile time on the model's real tokenizer,
``benchmarks/grammar_bench.py``) and, before every choice, sets the logits of the
tokens the grammar does not allow at that point to -inf.

A session's matcher is derived from its output tokens alone (``OutputConstraint.
sync``): whatever the frames did to the session (a verify window's rejected tail, a
failover that read every token again, a session started from a copy of another's
positions), the mask at a position depends only on the output before it. That is
what keeps speculation lossless: row ``i`` of a verify window is masked exactly as
plain decoding would mask that position, and a draft token the grammar forbids can
never be drawn, so it is rejected.

JSON is generated compactly, with ``", "`` and ``": "`` as separators and no other
whitespace between tokens: a small model given free whitespace can spend its whole
budget on newlines.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mesh.errors import Fatal, InvalidRequest

logger = logging.getLogger(__name__)

# Compiled grammars kept per stage (a compile is well under a millisecond for
# ordinary schemas; keeping them saves the lexer the library builds lazily).
GRAMMAR_CACHE_ENTRIES = 64
# Largest schema text accepted.
MAX_SCHEMA_CHARS = 100_000
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


# Largest number of alternatives of a ``choice`` constraint.
MAX_CHOICES = 256
# What each kind of spec is called in messages.
_KIND_NAMES = {
    "json_object": "the JSON schema",
    "json_schema": "the JSON schema",
    "regex": "the regex",
    "choice": "the choice",
    "lark": "the grammar",
}


def grammar_spec(kind: str, value: Any = None) -> str:
    """The spec of one output constraint, compact JSON: ``json_object``,
    ``json_schema`` (``value``: the schema), ``regex`` (a regular expression the whole
    output matches), ``choice`` (a list of strings, the output is one of them) or
    ``grammar`` (a context-free grammar in Lark syntax or llama.cpp's GBNF, kept as
    Lark). Raises InvalidRequest when the library cannot follow it."""
    if kind == "json_object":
        spec: dict[str, Any] = {"type": "json_object"}
    elif kind == "json_schema":
        if not isinstance(value, Mapping):
            raise InvalidRequest("json_schema needs 'schema', a JSON object")
        spec = {"type": "json_schema", "schema": dict(value)}
    elif kind == "regex":
        if not isinstance(value, str) or not value:
            raise InvalidRequest("regex needs a non-empty regular expression")
        spec = {"type": "regex", "regex": value}
    elif kind == "choice":
        if (
            not isinstance(value, Sequence)
            or isinstance(value, str)
            or not 1 <= len(value) <= MAX_CHOICES
            or not all(isinstance(item, str) and item for item in value)
        ):
            raise InvalidRequest(f"choice needs a list of 1 to {MAX_CHOICES} non-empty strings")
        spec = {"type": "choice", "choice": list(value)}
    elif kind == "grammar":
        spec = {"type": "lark", "lark": _as_lark(value)}
    else:
        raise InvalidRequest(
            f"unknown grammar kind {kind!r}; use json_object, json_schema, regex, choice or grammar"
        )
    # Key order is kept: it is the order the properties are generated in.
    text = json.dumps(spec, separators=(",", ":"))
    if len(text) > MAX_SCHEMA_CHARS:
        raise InvalidRequest(f"the {kind} is {len(text)} characters; at most {MAX_SCHEMA_CHARS}")
    check_grammar(text)
    return text


def _as_lark(text: Any) -> str:
    """A grammar's text in Lark syntax: Lark (a ``start:`` rule) as it is, GBNF (a
    ``root ::=`` rule, llama.cpp's) converted by the library."""
    from llguidance.gbnf_to_lark import any_to_lark

    if not isinstance(text, str) or not text.strip():
        raise InvalidRequest("grammar needs the grammar's text (Lark, or GBNF as llama.cpp's)")
    try:
        return any_to_lark(text)
    # The converter raises its GbnfToLarkError, and plain ``Exception`` for some
    # faults of the text (a rule used but never defined): every failure to convert
    # is the grammar's.
    except Exception as error:
        raise InvalidRequest(
            f"the grammar cannot be used: {error} (GBNF needs a 'root ::=' rule; Lark a "
            "'start:' rule)"
        ) from None


def _choice_lark(choices: Sequence[str]) -> str:
    # JSON string literals are Lark string literals (the same escapes).
    return "start: " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def _library_grammar(spec: str) -> str:
    """The llguidance grammar of a spec."""
    try:
        return _library_grammar_of(spec)
    except RecursionError:
        raise InvalidRequest(
            "the grammar spec is nested too deeply to read (recursion limit exceeded); "
            "flatten the schema"
        ) from None


def _library_grammar_of(spec: str) -> str:
    from llguidance import LLMatcher

    try:
        parsed = json.loads(spec)
    except json.JSONDecodeError as error:
        raise InvalidRequest(f"grammar spec is not JSON: {error}") from error
    kind = parsed.get("type") if isinstance(parsed, dict) else None
    if kind == "regex" and isinstance(parsed.get("regex"), str):
        return LLMatcher.grammar_from_regex(parsed["regex"])
    if kind == "choice" and isinstance(parsed.get("choice"), list):
        return LLMatcher.grammar_from_lark(_choice_lark(parsed["choice"]))
    if kind == "lark" and isinstance(parsed.get("lark"), str):
        return LLMatcher.grammar_from_lark(parsed["lark"])
    if kind == "json_object":
        schema: Any = {"type": "object"}
    elif kind == "json_schema" and isinstance(parsed.get("schema"), dict):
        schema = parsed["schema"]
    else:
        raise InvalidRequest(
            'grammar spec must be {"type": "json_object"}, {"type": "json_schema", "schema": '
            '{...}}, {"type": "regex", "regex": "..."}, {"type": "choice", "choice": [...]} '
            'or {"type": "lark", "lark": "..."}'
        )
    try:
        return LLMatcher.grammar_from_json_schema(schema, overrides=JSON_STYLE)  # type: ignore[arg-type]
    except ValueError as error:
        raise InvalidRequest(f"the JSON schema cannot be used: {error}") from error


def _library_error(matcher: Any) -> str:
    """The library's reason, without the parser state and grammar it appends (logged
    at debug level): what a client or an operator can read."""
    text = matcher.get_error() or ""
    if "\n" in text:
        logger.debug("grammar library error in full: %s", text)
    return text.split("\n", 1)[0].strip() or "refused"


def _kind_name(spec: str) -> str:
    try:
        kind = json.loads(spec).get("type")
    except (json.JSONDecodeError, AttributeError):
        kind = None
    return _KIND_NAMES.get(kind, "the grammar")


def check_grammar(spec: str) -> None:
    """Raise InvalidRequest (with the library's reason) when ``spec`` cannot be
    compiled; needs no tokenizer."""
    from llguidance import LLMatcher

    grammar = _library_grammar(spec)
    problem = LLMatcher.validate_grammar(grammar)
    if problem:
        raise InvalidRequest(f"{_kind_name(spec)} cannot be used: {problem.strip()}")


# Tokens ``TokenGrammars.check`` walks into a grammar.
CHECK_STEPS = 4
# How the library words a token its grammar forbids (the other errors of a consumed
# token are limits of its parser).
NOT_ALLOWED = "doesn't satisfy the grammar"


class TokenGrammars:
    """A stage's grammar compiler: the tokenizer in the library's form (built by
    ``warm`` at load, or on first use: 1-4 s) and the compiled grammars of recent
    specs."""

    def __init__(self, tokenizer_dir: Path) -> None:
        self.tokenizer_dir = tokenizer_dir
        self._lock = threading.Lock()
        self._tokenizer: Any = None
        self._vocab = 0
        self._templates: OrderedDict[str, Any] = OrderedDict()

    def _library_tokenizer(self, vocab: int) -> Any:
        if self._tokenizer is not None and self._vocab == vocab:
            return self._tokenizer
        from llguidance.hf import from_tokenizer
        from transformers import AutoTokenizer

        started = time.perf_counter()
        try:
            hf = AutoTokenizer.from_pretrained(self.tokenizer_dir)
        except (OSError, ValueError) as error:
            raise InvalidRequest(
                f"structured output needs the model's tokenizer, which this stage cannot "
                f"load from {self.tokenizer_dir}: {error}"
            ) from error
        if hf.eos_token_id is None:
            raise InvalidRequest(
                "structured output needs the model's end-of-sequence token, and its "
                "tokenizer names none"
            )
        try:
            library = from_tokenizer(hf, n_vocab=vocab, eos_token=hf.eos_token_id)
        except (TypeError, ValueError, AttributeError) as error:
            raise InvalidRequest(
                f"structured output needs a fast (tokenizers) tokenizer: {error}"
            ) from error
        self._tokenizer = library
        self._vocab = vocab
        self._templates.clear()
        logger.info(
            "grammar tokenizer ready (%d tokens) in %.2fs",
            vocab,
            time.perf_counter() - started,
        )
        return self._tokenizer

    def warm(self, vocab: int) -> threading.Thread:
        """Build the tokenizer now, in a background thread, so that the first request
        with structured output does not wait for it (1-4 s: on the last stage, the
        whole frame carrying that request, every session in it, would wait). A
        ``constraint`` or ``check`` meanwhile waits for this build; a tokenizer that
        cannot be built is logged here and reported to the first request that needs
        it."""

        def build() -> None:
            try:
                with self._lock:
                    self._library_tokenizer(vocab)
            except InvalidRequest as error:
                logger.info("structured output will not be available: %s", error.message)
            except Exception:  # noqa: BLE001 - a background build must not die silently
                logger.exception("building the grammar tokenizer failed")

        thread = threading.Thread(target=build, name="grammar-tokenizer", daemon=True)
        thread.start()
        return thread

    def constraint(self, spec: str, vocab: int) -> OutputConstraint:
        """A fresh constraint for one session (``vocab``: the width of the logits)."""
        from llguidance import LLMatcher

        with self._lock:
            tokenizer = self._library_tokenizer(vocab)
            template = self._templates.get(spec)
            if template is None:
                template = LLMatcher(tokenizer, _library_grammar(spec), log_level=0)
                if template.is_error():
                    raise InvalidRequest(
                        f"{_kind_name(spec)} cannot be used: {_library_error(template)}"
                    )
                # Some limits show only when the first mask is computed (a schema
                # that refers to itself alone, a regex repeat too large to build):
                # compute it on a copy, so that they are the request's error here.
                OutputConstraint(spec, template.deep_copy(), vocab).allowed()
                self._templates[spec] = template
                while len(self._templates) > GRAMMAR_CACHE_ENTRIES:
                    self._templates.popitem(last=False)
            self._templates.move_to_end(spec)
            return OutputConstraint(spec, template.deep_copy(), vocab)

    def check(self, spec: str, vocab: int, steps: int = CHECK_STEPS) -> None:
        """Raise InvalidRequest where the library cannot follow ``spec``: compile it,
        then take the first allowed token ``steps`` times (its parser's limits show
        on the first tokens of a schema with no finite instance or a repeat too large
        to build). Milliseconds once the tokenizer is built; nothing is kept but the
        compiled grammar."""
        constraint = self.constraint(spec, vocab)
        for _ in range(steps):
            if constraint._matcher.is_stopped():  # noqa: SLF001 - its own class's state
                return
            allowed = constraint.allowed().nonzero()
            if not len(allowed):
                return
            constraint.consume(int(allowed[0]))


class OutputConstraint:
    """One session's grammar state: the matcher after ``consumed`` (output tokens)."""

    def __init__(self, spec: str, matcher: Any, vocab: int) -> None:
        self.spec = spec
        self.vocab = vocab
        self._matcher = matcher
        self.consumed: list[int] = []
        # Whether the matcher counted each consumed token: once the grammar is done
        # (an end token taken), it takes more end tokens without counting them, and
        # a rollback counts only those it counted.
        self._counted: list[bool] = []
        self._bits = torch.zeros((1, (vocab + 31) // 32), dtype=torch.int32)

    def sync(self, output: Sequence[int]) -> None:
        """Bring the matcher to the state after ``output`` (the session's output
        tokens so far): roll back what differs, consume the rest."""
        same = 0
        limit = min(len(self.consumed), len(output))
        while same < limit and self.consumed[same] == output[same]:
            same += 1
        if same < len(self.consumed):
            counted = sum(self._counted[same:])
            if counted and not self._matcher.rollback(counted):
                raise Fatal(
                    f"the grammar matcher cannot roll back {counted} tokens "
                    f"({_library_error(self._matcher)}); the request cannot go on"
                )
            del self.consumed[same:]
            del self._counted[same:]
        for token in output[same:]:
            self.consume(int(token))

    def consume(self, token: int) -> None:
        counted = True
        if self._matcher.is_stopped() and not self._matcher.is_error():
            # The grammar is complete: it allows only its end token, and does not
            # count it again.
            if not bool(self.allowed()[token]):
                raise Fatal(
                    f"output token {token} follows the end of the request's grammar; "
                    "the request cannot go on"
                )
            counted = False
        elif not self._matcher.consume_token(token):
            reason = _library_error(self._matcher)
            if self._matcher.is_error() and NOT_ALLOWED not in reason:
                # The library gave up on the grammar (a limit of its parser), not on
                # a token the mask forbids.
                raise self._unfollowable()
            raise Fatal(
                f"output token {token} does not follow the request's grammar "
                f"({_library_error(self._matcher)}); the request cannot go on"
            )
        self.consumed.append(token)
        self._counted.append(counted)

    def _unfollowable(self) -> InvalidRequest:
        """The request's error when the library cannot go on with its grammar: a
        limit of the grammar library (a schema that refers only to itself, a repeat
        count too large, one with no finite instance), so the request's own."""
        return InvalidRequest(
            f"{_kind_name(self.spec)} cannot be followed: {_library_error(self._matcher)}; "
            "simplify it (bounded repeats, a schema with a finite instance)"
        )

    def allowed(self) -> torch.Tensor:
        """The tokens the grammar allows next, as a bool tensor ``[vocab]``."""
        from llguidance.torch import fill_next_token_bitmask

        fill_next_token_bitmask(self._matcher, self._bits)
        if self._matcher.is_error():
            raise self._unfollowable()
        bits = np.unpackbits(self._bits.numpy().view(np.uint8), bitorder="little")
        return torch.from_numpy(bits[: self.vocab]).to(torch.bool)


def mask_rows(
    constraint: OutputConstraint, logits: torch.Tensor, output: Sequence[int], drafts: Sequence[int]
) -> torch.Tensor:
    """``logits`` ``[rows, vocab]`` with what the grammar forbids set to -inf: row 0
    follows ``output``, row ``i`` follows ``output`` and ``drafts[:i]`` (a verify
    window). Rows after a draft token the grammar forbids are left as they are: the
    draw at that token's row cannot be it, so verification stops there."""
    masked = logits.clone()
    constraint.sync(output)
    for row in range(logits.shape[0]):
        allowed = constraint.allowed().to(logits.device)
        masked[row].masked_fill_(~allowed, float("-inf"))
        if row >= len(drafts):
            break
        token = int(drafts[row])
        if not 0 <= token < constraint.vocab or not bool(allowed[token]):
            break
        constraint.consume(token)
    return masked
