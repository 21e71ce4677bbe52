"""``POST /tokenize`` and ``POST /detokenize``: the served model's tokenizer over HTTP,
in vLLM's shapes (llama.cpp's key names are accepted too), so that clients count
tokens, fit prompts to the context and build token-id prompts without a copy of
the tokenizer.

- ``/tokenize`` takes ``prompt`` (or llama.cpp's ``content``) with
  ``add_special_tokens`` (default true), or chat ``messages`` rendered with the
  model's chat template as a chat request would be (with the assistant's turn
  opened). It answers ``tokens``, ``count`` and ``max_model_len`` (the context).
  With llama.cpp's ``with_pieces`` each token is ``{"id", "piece"}``, the piece its
  text where its bytes are whole UTF-8, else the list of its bytes
  (``stage/frontend/token_bytes.py``); with vLLM's ``return_token_strs`` the answer
  adds ``token_strs``, the vocabulary's spelling of each token.
- ``/detokenize`` takes ``tokens`` and answers the text as ``prompt`` (and as
  llama.cpp's ``content``).
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from pydantic import ConfigDict, Field, Strict, ValidationError

from stage.frontend.errors import bad_request, from_validation_error
from stage.frontend.prepare import PromptContext, chat_prompt_tokens
from stage.frontend.schemas import ChatCompletionBody
from stage.frontend.schemas_base import Bool, Int, Str, _Body
from stage.frontend.token_bytes import piece

# Longest token list /detokenize takes (a context's worth of a large model).
DETOKENIZE_MAX_TOKENS = 1_048_576


class TokenizeBody(_Body):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, frozen=True)

    model: Annotated[str, Strict(), Field(min_length=1, max_length=512)] | None = None
    prompt: Str | None = None
    content: Str | None = None
    add_special_tokens: Bool | None = None
    # llama.cpp's name for add_special_tokens.
    add_special: Bool | None = None


class DetokenizeBody(_Body):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, frozen=True)

    model: Annotated[str, Strict(), Field(min_length=1, max_length=512)] | None = None
    tokens: Annotated[list[Int], Field(max_length=DETOKENIZE_MAX_TOKENS)]


def _check_model(model: str | None, ctx: PromptContext) -> None:
    if model is not None and model != ctx.model_id:
        raise bad_request(
            f"model {model!r} is not served here; this server serves {ctx.model_id!r}",
            "model",
            code="model_not_found",
        )


class TokenViews(_Body):
    """How ``/tokenize`` spells its tokens (for prompts and chat messages alike)."""

    with_pieces: Bool = False
    return_token_strs: Bool = False


VIEW_KEYS = ("with_pieces", "return_token_strs")


async def tokenize(payload: dict[str, Any], ctx: PromptContext) -> dict[str, Any]:
    """The answer of ``POST /tokenize`` for the JSON object ``payload``."""
    try:
        views = TokenViews.model_validate({k: payload[k] for k in VIEW_KEYS if k in payload})
    except ValidationError as exc:
        raise from_validation_error(exc) from None
    payload = {k: v for k, v in payload.items() if k not in VIEW_KEYS}
    tokens = await _tokens(payload, ctx)
    answer: dict[str, Any] = {"tokens": tokens, "count": len(tokens)}
    if views.with_pieces:
        answer["tokens"] = await asyncio.to_thread(
            lambda: [{"id": t, "piece": piece(ctx.tokenizer, t)} for t in tokens]
        )
    answer["max_model_len"] = ctx.context_length
    if views.return_token_strs:
        answer["token_strs"] = ctx.tokenizer.convert_ids_to_tokens(tokens)
    return answer


async def _tokens(payload: dict[str, Any], ctx: PromptContext) -> list[int]:
    """The token ids ``/tokenize`` answers for ``payload`` (its views taken out)."""
    if "messages" in payload:
        both = next((k for k in ("prompt", "content") if k in payload), None)
        if both is not None:
            raise bad_request(
                f"send either '{both}' (text) or 'messages' (a chat) to tokenize, not both",
                both,
            )
        try:
            chat = ChatCompletionBody.model_validate(payload)
        except ValidationError as exc:
            raise from_validation_error(exc) from None
        _check_model(chat.model, ctx)
        tokens = await asyncio.to_thread(chat_prompt_tokens, chat, ctx)
    else:
        try:
            body = TokenizeBody.model_validate(payload)
        except ValidationError as exc:
            raise from_validation_error(exc) from None
        unknown = sorted(body.model_extra or {})
        if unknown:
            raise bad_request(
                f"unknown parameter '{unknown[0]}'; /tokenize takes prompt (or content), "
                "add_special_tokens, with_pieces, return_token_strs, or chat messages",
                unknown[0],
            )
        _check_model(body.model, ctx)
        text = body.prompt if body.prompt is not None else body.content
        if text is None:
            raise bad_request(
                "send the text to tokenize as 'prompt' (or chat 'messages')", "prompt"
            )
        special = body.add_special_tokens
        if special is None:
            special = True if body.add_special is None else body.add_special
        encoded = await asyncio.to_thread(ctx.tokenizer.encode, text, add_special_tokens=special)
        tokens = [int(t) for t in encoded]
    return tokens


async def detokenize(payload: dict[str, Any], ctx: PromptContext) -> dict[str, Any]:
    """The answer of ``POST /detokenize`` for the JSON object ``payload``."""
    try:
        body = DetokenizeBody.model_validate(payload)
    except ValidationError as exc:
        raise from_validation_error(exc) from None
    unknown = sorted(body.model_extra or {})
    if unknown:
        raise bad_request(
            f"unknown parameter '{unknown[0]}'; /detokenize takes tokens (and model)",
            unknown[0],
        )
    _check_model(body.model, ctx)
    vocab = len(ctx.tokenizer)
    for index, token in enumerate(body.tokens):
        if not 0 <= token < vocab:
            raise bad_request(
                f"token {index} is {token}, outside the vocabulary [0, {vocab})", "tokens"
            )
    text = await asyncio.to_thread(ctx.tokenizer.decode, body.tokens)
    return {"prompt": text, "content": text}
