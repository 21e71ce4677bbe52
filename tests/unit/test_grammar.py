"""Structured output's parts (mesh/grammar.py) on SmolLM2's real tokenizer: specs
checked before any stage sees them, a session's grammar state that follows its
output whatever happened to it, and the masks of a verify window's rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mesh.errors import Fatal, InvalidRequest
from mesh.grammar import TokenGrammars, grammar_spec, mask_rows

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0},
        "pet": {"enum": ["cat", "dog"]},
    },
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}
DOCUMENT = '{"name": "Ada", "age": 36, "pet": "cat"}'


def test_specs_keep_the_schema_and_bad_schemas_are_refused() -> None:
    spec = json.loads(grammar_spec("json_schema", SCHEMA))
    assert spec == {"type": "json_schema", "schema": SCHEMA}
    # The properties' order is the order they are generated in.
    assert list(spec["schema"]["properties"]) == ["name", "age", "pet"]
    assert json.loads(grammar_spec("json_object")) == {"type": "json_object"}
    for bad, words in (
        ({"type": "strange"}, "strange"),
        ({"$ref": "#/definitions/missing"}, "missing"),
        ({"type": "string", "pattern": "(("}, "regex"),
    ):
        with pytest.raises(InvalidRequest, match=words):
            grammar_spec("json_schema", bad)
    with pytest.raises(InvalidRequest, match="schema"):
        grammar_spec("json_schema", None)
    with pytest.raises(InvalidRequest, match="unknown grammar kind"):
        grammar_spec("yaml")


def allowed_after(smollm2_grammars: TokenGrammars, spec: str, output: list[int]) -> torch.Tensor:
    fresh = smollm2_grammars.constraint(spec, VOCAB)
    fresh.sync(output)
    return fresh.allowed()


VOCAB = 49152


def follow_to_eos(constraint, smollm2_tokenizer, ids: list[int]) -> None:
    """Every token of ``ids`` is allowed where it comes (among some, not all), and
    after the last only the end token is."""
    for i, token in enumerate(ids):
        constraint.sync(ids[:i])
        allowed = constraint.allowed()
        assert allowed[token], (i, smollm2_tokenizer.decode([token]))
        assert 0 < int(allowed.sum()) < VOCAB
    constraint.sync(ids)
    assert constraint.allowed().nonzero().flatten().tolist() == [smollm2_tokenizer.eos_token_id]


def test_the_mask_follows_a_document_and_ends_at_eos(smollm2_grammars, smollm2_tokenizer) -> None:
    spec = grammar_spec("json_schema", SCHEMA)
    constraint = smollm2_grammars.constraint(spec, VOCAB)
    ids = smollm2_tokenizer.encode(DOCUMENT)
    follow_to_eos(constraint, smollm2_tokenizer, ids)
    # What the schema forbids: another key, a string for the age, a third pet.
    constraint.sync(smollm2_tokenizer.encode('{"name": "Ada", "age": '))
    assert not constraint.allowed()[smollm2_tokenizer.encode('"')[0]]


def test_sync_rolls_back_and_replays_to_any_output(smollm2_grammars, smollm2_tokenizer) -> None:
    spec = grammar_spec("json_schema", SCHEMA)
    ids = smollm2_tokenizer.encode(DOCUMENT)
    constraint = smollm2_grammars.constraint(spec, VOCAB)
    # Forward, back to a shorter output (a rejected window), to another branch
    # (a failover's re-read), forward again: the mask is always a fresh matcher's.
    for cut in (len(ids), 3, 7, 5, len(ids) - 1, 0, 9):
        constraint.sync(ids[:cut])
        assert constraint.consumed == ids[:cut]
        assert torch.equal(constraint.allowed(), allowed_after(smollm2_grammars, spec, ids[:cut]))
    other = smollm2_tokenizer.encode('{"name": "Bob", "age": 7')
    constraint.sync(other)
    assert torch.equal(constraint.allowed(), allowed_after(smollm2_grammars, spec, other))


def test_an_output_that_leaves_the_grammar_fails_the_session(
    smollm2_grammars, smollm2_tokenizer
) -> None:
    constraint = smollm2_grammars.constraint(grammar_spec("json_object"), VOCAB)
    with pytest.raises(Fatal, match="does not follow") as raised:
        constraint.sync(smollm2_tokenizer.encode("hello"))
    # The library's reason, without the parser state and grammar it appends.
    message = str(raised.value)
    assert "\n" not in message and "<state>" not in message
    assert "doesn't satisfy the grammar" in message


def test_verify_rows_are_masked_after_their_drafts(smollm2_grammars, smollm2_tokenizer) -> None:
    spec = grammar_spec("json_schema", SCHEMA)
    ids = smollm2_tokenizer.encode(DOCUMENT)
    output, drafts = ids[:4], ids[4:8]
    logits = torch.randn(len(drafts) + 1, VOCAB)
    masked = mask_rows(smollm2_grammars.constraint(spec, VOCAB), logits, output, drafts)
    for row in range(len(drafts) + 1):
        want = allowed_after(smollm2_grammars, spec, output + drafts[:row])
        assert torch.equal(masked[row] > float("-inf"), want)
        assert torch.equal(masked[row][want], logits[row][want])
    # A draft the grammar forbids: its row is masked (the draw cannot be it) and the
    # rows after it, which verification never reaches, are left alone.
    bad = smollm2_tokenizer.encode("[")[0]
    drafts = [ids[1], bad, ids[3]]  # after '{"name' only the rest of that key may come
    logits = torch.randn(4, VOCAB)
    masked = mask_rows(smollm2_grammars.constraint(spec, VOCAB), logits, ids[:1], drafts)
    assert masked[1][bad] == float("-inf")
    assert torch.equal(masked[2], logits[2]) and torch.equal(masked[3], logits[3])


def test_end_tokens_drafted_past_the_grammars_end_roll_back_cleanly(
    smollm2_grammars, smollm2_tokenizer
) -> None:
    # The library takes any number of end tokens once the grammar is complete but
    # counts only the first: a rollback of all of them must not undo real tokens.
    spec = grammar_spec("grammar", 'start: "a" ("\\n" "a")*')
    eos = smollm2_tokenizer.eos_token_id
    a, newline = smollm2_tokenizer.encode("a\na")[:2]
    constraint = smollm2_grammars.constraint(spec, VOCAB)
    logits = torch.randn(4, VOCAB)
    masked = mask_rows(constraint, logits, [a], [eos, eos, eos])
    assert masked[0][eos] > float("-inf") and masked[0][newline] > float("-inf")
    assert all(masked[row][eos] > float("-inf") for row in (1, 2, 3))
    # The verdict rejected the first end token: the output goes on with a newline.
    constraint.sync([a, newline])
    assert torch.equal(constraint.allowed(), allowed_after(smollm2_grammars, spec, [a, newline]))
    constraint.sync([a, newline, a, eos, eos])
    with pytest.raises(Fatal, match="follows the end"):
        constraint.sync([a, newline, a, eos, a])


def test_a_stage_without_a_tokenizer_refuses_the_grammar(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest, match="tokenizer"):
        TokenGrammars(tmp_path).constraint(grammar_spec("json_object"), VOCAB)


def test_regex_choice_and_grammar_specs_and_bad_ones_are_refused() -> None:
    assert json.loads(grammar_spec("regex", r"\d+")) == {"type": "regex", "regex": r"\d+"}
    assert json.loads(grammar_spec("choice", ["yes", 'say "no"'])) == {
        "type": "choice",
        "choice": ["yes", 'say "no"'],
    }
    # llama.cpp's GBNF is kept as the Lark the library converts it to; Lark as it is.
    gbnf = json.loads(grammar_spec("grammar", 'root ::= "n=" [0-9]+'))
    assert gbnf["type"] == "lark" and "start:" in gbnf["lark"]
    lark = 'start: "n=" NUM\nNUM: /[0-9]+/'
    assert json.loads(grammar_spec("grammar", lark)) == {"type": "lark", "lark": lark}
    for kind, bad, words in (
        ("regex", "(unclosed", "regex cannot be used"),
        ("regex", "", "non-empty"),
        ("choice", [], "1 to 256"),
        ("choice", "yes", "1 to 256"),
        ("choice", ["yes", ""], "non-empty"),
        ("grammar", "root ::= (", "root ::="),
        ("grammar", "start: (", "grammar cannot be used"),
        ("grammar", "   ", "grammar's text"),
    ):
        with pytest.raises(InvalidRequest, match=words):
            grammar_spec(kind, bad)


@pytest.mark.parametrize(
    ("kind", "value", "text"),
    [
        ("choice", ["yes", "no", "not sure"], "not sure"),
        ("regex", r"\(\d{3}\) \d{3}-\d{4}", "(555) 010-9999"),
        ("grammar", 'root ::= "x = " num ";"\nnum ::= [0-9]+', "x = 42;"),
        ("grammar", 'start: "color: " COLOR\nCOLOR: "red" | "blue"', "color: blue"),
    ],
)
def test_regex_choice_and_grammar_masks_follow_a_text_and_end_at_eos(
    smollm2_grammars, smollm2_tokenizer, kind: str, value, text: str
) -> None:
    spec = grammar_spec(kind, value)
    ids = smollm2_tokenizer.encode(text)
    constraint = smollm2_grammars.constraint(spec, VOCAB)
    follow_to_eos(constraint, smollm2_tokenizer, ids)
    # Anything else at the start is forbidden.
    assert not allowed_after(smollm2_grammars, spec, [])[smollm2_tokenizer.encode("Hello")[0]]


@pytest.mark.parametrize(
    "kind, value",
    [
        ("json_schema", {"$ref": "#"}),
        (
            "json_schema",
            {
                "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                "$ref": "#/$defs/a",
            },
        ),
        ("json_schema", {"type": "string", "pattern": "^a{1000000}$"}),
        (
            "json_schema",
            {
                "$defs": {
                    "n": {
                        "type": "object",
                        "properties": {"c": {"$ref": "#/$defs/n"}},
                        "required": ["c"],
                    }
                },
                "$ref": "#/$defs/n",
            },
        ),
        ("grammar", 'start: "a"{1000000}'),
    ],
)
def test_grammars_the_library_cannot_follow_are_the_request_s_error(
    smollm2_grammars, kind: str, value
) -> None:
    """They compile without a tokenizer; with it, their first mask or first tokens
    fail in the library: InvalidRequest (the request's 400), never Fatal."""
    spec = grammar_spec(kind, value)
    with pytest.raises(InvalidRequest, match="cannot be followed"):
        smollm2_grammars.check(spec, VOCAB)


def test_a_sound_grammar_passes_the_check_and_is_kept(smollm2_grammars) -> None:
    spec = grammar_spec("json_schema", SCHEMA)
    smollm2_grammars.check(spec, VOCAB)
    smollm2_grammars.check(grammar_spec("choice", ["yes", "no"]), VOCAB)
    assert spec in smollm2_grammars._templates  # noqa: SLF001


def test_warming_builds_the_tokenizer_before_the_first_request(
    smollm2_tokenizer_dir, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    """A stage warms its grammar compiler at load: the tokenizer is built in the
    background, and the first constraint finds it built (before, the first request
    with structured output built it inside its frame). A directory without a
    tokenizer logs why and fails the first request that needs it, clearly."""
    import logging

    from mesh.errors import InvalidRequest
    from mesh.grammar import TokenGrammars, grammar_spec

    grammars = TokenGrammars(smollm2_tokenizer_dir)
    with caplog.at_level(logging.INFO, logger="mesh.grammar"):
        grammars.warm(49152).join(timeout=120)
        assert caplog.text.count("grammar tokenizer ready") == 1
        spec = grammar_spec("json_object")
        grammars.constraint(spec, 49152).allowed()
        assert caplog.text.count("grammar tokenizer ready") == 1  # not built again

    empty = TokenGrammars(tmp_path)
    with caplog.at_level(logging.INFO, logger="mesh.grammar"):
        empty.warm(49152).join(timeout=60)
    assert "structured output will not be available" in caplog.text
    with pytest.raises(InvalidRequest, match="tokenizer"):
        empty.constraint(grammar_spec("json_object"), 49152)


def test_a_spec_nested_past_the_recursion_limit_is_the_request_s_error(smollm2_grammars) -> None:
    """A stage given a grammar spec nested thousands deep (the HTTP API refuses such
    schemas before; a peer on the data plane need not) answers InvalidRequest, not an
    internal RecursionError."""
    deep = '{"type": "json_schema", "schema": ' + '{"a": ' * 5000 + "1" + "}" * 5000 + "}"
    with pytest.raises(InvalidRequest, match="nested too deeply"):
        smollm2_grammars.constraint(deep, VOCAB)
