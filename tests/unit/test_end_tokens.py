"""The tokens that end an answer (mesh/package/end_tokens.py): from a GGUF's ids
and control tokens, and from a package's generation_config.json."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from transformers import AutoTokenizer

from mesh.package.builder import build_package
from mesh.package.end_tokens import end_tokens, gguf_end_tokens

# gguf's token types.
NORMAL, CONTROL = 1, 3


def write_vocab_gguf(path: Path, tokens: list[tuple[str, int]], **ids: int) -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_token_list([text for text, _ in tokens])
    writer.add_token_types([kind for _, kind in tokens])
    for key, value in ids.items():
        writer.add_uint32(f"tokenizer.ggml.{key}", value)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_gguf_ends_at_its_ids_and_at_control_tokens_spelled_as_end_markers(
    tmp_path: Path,
) -> None:
    from gguf import GGUFReader

    tokens = [
        ("<eos>", CONTROL),
        ("<start_of_turn>", CONTROL),
        ("<end_of_turn>", CONTROL),  # Gemma's end of turn: a control token
        ("hello", NORMAL),
        ("<|end|>", NORMAL),  # spelled as a marker but plain text: not an end
        ("<|eom_id|>", CONTROL),
        ("<|eot_id|>", CONTROL),
    ]
    path = write_vocab_gguf(tmp_path / "v.gguf", tokens, eos_token_id=0, eot_token_id=6)
    assert gguf_end_tokens(GGUFReader(str(path))) == (0, 6, 2, 5)
    bare = write_vocab_gguf(tmp_path / "bare.gguf", [("a", NORMAL), ("b", NORMAL)])
    assert gguf_end_tokens(GGUFReader(str(bare))) == ()


def test_the_frontend_ends_at_the_eos_and_every_listed_id(tmp_path: Path) -> None:
    class Tokenizer:
        eos_token_id = 7

    assert end_tokens(Tokenizer(), tmp_path) == {7}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 106]}))
    assert end_tokens(Tokenizer(), tmp_path) == {1, 7, 106}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 9}))
    assert end_tokens(Tokenizer(), tmp_path) == {7, 9}
    (tmp_path / "generation_config.json").write_text("{not json")
    assert end_tokens(Tokenizer(), tmp_path) == {7}
    assert end_tokens(object(), None) == frozenset()


def test_a_package_from_a_gguf_lists_its_end_tokens(tmp_path: Path, smollm2_gguf: Path) -> None:
    """SmolLM2's GGUF: EOS ``<|im_end|>`` and the control token ``<|endoftext|>``
    (which ends a document in a raw completion)."""
    build_package(str(smollm2_gguf), tmp_path / "pkg")
    listed = json.loads((tmp_path / "pkg" / "generation_config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "pkg")
    assert listed["eos_token_id"] == [
        tokenizer.convert_tokens_to_ids("<|im_end|>"),
        tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    ]
    assert end_tokens(tokenizer, tmp_path / "pkg") == set(listed["eos_token_id"])
