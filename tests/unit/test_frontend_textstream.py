"""Incremental detokenisation and stop strings, with SmolLM2's real tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stage.frontend.textstream import IncrementalDecoder, TextStream

TRICKY = "Héllo wörld — 你好，世界! 🎉🚀 naïve café\n\tcode: x = [1, 2]  # ok ¿qué?"


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)


def _stream_all(decoder: IncrementalDecoder, ids: list[int], chunk: int) -> list[str]:
    pieces = [decoder.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    pieces.append(decoder.flush())
    return pieces


def _reference_stop(
    tokenizer, ids: list[int], stops: list[str], chunk: int = 1
) -> tuple[str, bool]:
    """Decode the whole prefix after every chunk; cut at the first stop string seen."""
    for k in [*range(chunk, len(ids), chunk), len(ids)]:
        text = tokenizer.decode(ids[:k], skip_special_tokens=True)
        if text.endswith("\ufffd") and k < len(ids):
            continue
        found = [text.find(s) for s in stops if s in text]
        if found:
            return text[: min(found)], True
    return tokenizer.decode(ids, skip_special_tokens=True), False


@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
def test_multibyte_text_streams_exactly(tokenizer, chunk: int) -> None:
    ids = tokenizer.encode(TRICKY)
    # Byte-level BPE splits the emoji and CJK characters over several tokens.
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)
    pieces = _stream_all(IncrementalDecoder(tokenizer), ids, chunk)
    assert "".join(pieces) == tokenizer.decode(ids) == TRICKY
    assert not any("\ufffd" in piece for piece in pieces)


def test_incomplete_character_is_held_then_flushed(tokenizer) -> None:
    ids = tokenizer.encode("🎉")
    assert len(ids) > 1
    decoder = IncrementalDecoder(tokenizer)
    assert decoder.push(ids[:1]) == ""
    assert decoder.flush() == tokenizer.decode(ids[:1])


def test_stop_string_cuts_before_it_and_holds_back_prefixes(tokenizer) -> None:
    ids = tokenizer.encode("alpha beta STOP gamma")
    stream = TextStream(tokenizer, ["STOP", "never"])
    released = []
    for token in ids:
        released.append(stream.push([token]))
        if stream.stopped:
            break
    assert "".join(released) == "alpha beta "
    assert stream.stopped and stream.stop_string == "STOP"
    assert not any("ST" in piece for piece in released)
    assert stream.push(tokenizer.encode(" more")) == "" and stream.finish() == ""


def test_include_stop_keeps_the_stop_string_and_nothing_after(tokenizer) -> None:
    for text, stops, want in (
        ("alpha beta STOP gamma", ["STOP", "never"], "alpha beta STOP"),
        ("one two three four", ["four", "o thr"], "one two thr"),
    ):
        stream = TextStream(tokenizer, stops, include_stop=True)
        out = "".join(stream.push([t]) for t in tokenizer.encode(text)) + stream.finish()
        assert out == want and stream.stopped


def test_special_tokens_kept_when_asked(tokenizer) -> None:
    ids = tokenizer.encode("<|im_start|>hi")
    assert "".join(TextStream(tokenizer).push([t]) for t in ids) == "hi"
    kept = TextStream(tokenizer, skip_special_tokens=False)
    assert "".join(kept.push([t]) for t in ids) == "<|im_start|>hi"


def test_stop_string_spanning_token_boundary_and_earliest_wins(tokenizer) -> None:
    text = "one two three four"
    ids = tokenizer.encode(text)
    stream = TextStream(tokenizer, ["four", "o thr"])
    out = "".join(stream.push([t]) for t in ids)
    assert out == "one tw" and stream.stop_string == "o thr"


def test_held_back_prefix_is_released_when_no_stop_follows(tokenizer) -> None:
    ids = tokenizer.encode("the end is ST")
    stream = TextStream(tokenizer, ["STOP"])
    out = "".join(stream.push([t]) for t in ids)
    assert out == "the end is "
    assert stream.finish() == "ST" and not stream.stopped


def test_stop_at_the_very_start_gives_empty_text(tokenizer) -> None:
    stream = TextStream(tokenizer, ["Hello"])
    assert stream.push(tokenizer.encode("Hello world")) == ""
    assert stream.stopped and stream.text == ""


def test_empty_stop_string_is_refused(tokenizer) -> None:
    with pytest.raises(ValueError):
        TextStream(tokenizer, [""])


ALPHABET = "ab c-é你🎉\n"


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    text=st.text(alphabet=ALPHABET, min_size=1, max_size=40),
    stops=st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=4), max_size=4),
    chunk=st.integers(min_value=1, max_value=4),
)
def test_streaming_matches_whole_decode(tokenizer, text: str, stops: list[str], chunk: int) -> None:
    ids = tokenizer.encode(text)
    stream = TextStream(tokenizer, stops)
    out = "".join(stream.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk))
    out += stream.finish()
    expected, stopped = _reference_stop(tokenizer, ids, stops, chunk)
    assert out == expected
    assert stream.stopped == stopped
    if not stops:
        assert out == tokenizer.decode(ids)


def test_a_stream_after_context_tokens_emits_what_it_adds_to_them(tokenizer) -> None:
    from frontend_support import sentencepiece_style

    spiece = sentencepiece_style()
    ids = spiece.encode("hi hi hi", add_special_tokens=False)
    after = TextStream(spiece, context=ids[:1])
    assert after.push(ids[1:]) + after.finish() == " hi hi"
    alone = TextStream(spiece)
    assert alone.push(ids[1:]) + alone.finish() == "hi hi"
    # A byte-level tokenizer's decodes join: context changes nothing.
    text = "Plain words, 世界 and code()"
    byte_ids = tokenizer.encode(text, add_special_tokens=False)
    stream = TextStream(tokenizer, context=byte_ids[:3])
    assert stream.push(byte_ids[3:]) + stream.finish() == tokenizer.decode(byte_ids[3:])
