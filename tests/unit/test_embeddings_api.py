"""The /v1/embeddings answer's shape (stage/frontend/embeddings.py): unit-length
vectors, base64 of little-endian float32, OpenAI's usage, and the checks made before
any input is read."""

from __future__ import annotations

import base64
import math
import struct

import pytest

from stage.frontend.embeddings import (
    EmbeddingBody,
    answer,
    check_body,
    embedding_requests,
    unit_length,
)
from stage.frontend.errors import OpenAIError
from stage.frontend.prepare import FrontendLimits, PromptContext


class _Tokenizer:
    def __len__(self) -> int:
        return 100

    def encode(self, text: str) -> list[int]:
        return [ord(c) % 100 for c in text]


CTX = PromptContext(
    tokenizer=_Tokenizer(),
    model_id="m",
    context_length=16,
    stop_token_ids=frozenset(),
    limits=FrontendLimits(),
)


def test_vectors_are_scaled_to_length_one_and_sent_as_asked() -> None:
    vectors = [(3.0, 4.0, 0.0), (0.0, 0.0, 0.0)]
    floats = answer(EmbeddingBody(input=["a", "b"]), vectors, [[1, 2], [3]], "m")
    assert floats["object"] == "list" and floats["model"] == "m"
    assert [d["embedding"] for d in floats["data"]] == [[0.6, 0.8, 0.0], [0.0, 0.0, 0.0]]
    assert [d["index"] for d in floats["data"]] == [0, 1]
    assert floats["usage"] == {"prompt_tokens": 3, "total_tokens": 3}
    packed = answer(EmbeddingBody(input="a", encoding_format="base64"), vectors[:1], [[1]], "m")
    raw = base64.b64decode(packed["data"][0]["embedding"])
    assert struct.unpack("<3f", raw) == pytest.approx((0.6, 0.8, 0.0))


def test_unit_length_keeps_direction() -> None:
    scaled = unit_length([1e-20, -2e-20, 2e-20])
    assert math.isclose(math.fsum(v * v for v in scaled), 1.0)
    assert scaled == pytest.approx([1 / 3, -2 / 3, 2 / 3])


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x", "truncate": 5}, "truncate"),
        ({"input": "x", "model": "other"}, "model"),
        ({"input": []}, "input"),
        ({"input": ["x"] * 2049}, "input"),
        ({"input": "x", "dimensions": 4}, "dimensions"),
    ],
)
def test_what_cannot_be_served_is_refused_before_anything_is_read(body, param) -> None:
    with pytest.raises(OpenAIError) as caught:
        check_body(EmbeddingBody.model_validate(body), CTX, 3)
    assert caught.value.status == 400 and caught.value.param == param


def test_dimensions_of_the_models_own_size_are_accepted() -> None:
    check_body(EmbeddingBody(input="x", dimensions=3), CTX, 3)
    check_body(EmbeddingBody(input="x", dimensions=7), CTX, None)  # checked on the answer
    with pytest.raises(OpenAIError):
        answer(EmbeddingBody(input="x", dimensions=7), [(1.0, 0.0, 0.0)], [[1]], "m")


def test_inputs_in_every_shape_become_one_request_each() -> None:
    assert EmbeddingBody(input="ab").inputs() == ["ab"]
    assert EmbeddingBody(input=[1, 2]).inputs() == [[1, 2]]
    assert EmbeddingBody(input=[[1], [2, 3]]).inputs() == [[1], [2, 3]]
    requests = embedding_requests([[1, 2], [3]], "last", "tenant")
    assert [r.prompt_tokens for r in requests] == [(1, 2), (3,)]
    assert all(r.pooling == "last" and r.max_new_tokens == 0 for r in requests)
    assert all(not r.speculation and r.tenant == "tenant" for r in requests)
    assert len({r.request_id for r in requests}) == 2
