"""``POST /infill``: llama.cpp's code-completion route, for editor plugins written
against llama-server (llama.vscode, llama.vim and others).

The body takes the text before and after the cursor (``input_prefix``,
``input_suffix``), files for context (``input_extra``: ``[{"filename", "text"}]``)
and the start of the middle the editor already has (``prompt``), with llama.cpp's
names beside this server's parameters (llama_api.py: ``LlamaBody``). It runs as one
completion of the fill-in-the-middle prompt (fim.py); a prompt longer than the
context is cut as llama.cpp cuts it (context files first, then the prefix's start
and the suffix's end) and the answer says ``truncated``. The answer has
llama.cpp's shape (llama_api.py).
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Annotated

from pydantic import Field

from stage.frontend import dry
from stage.frontend.fim import FimTokens, encode_text, extra_tokens, fim_prompt, fit_to_room
from stage.frontend.llama_api import LlamaBody, LlamaRequest
from stage.frontend.prepare import (
    PromptContext,
    check_common,
    check_text_fits,
    fim_of,
    longest_token_chars,
    prepared_generation,
)
from stage.frontend.schemas_base import Str, _Body

INFILL_PATH = "/infill"
# Tokens kept free for the middle when the request sets no n_predict (at most a
# quarter of the context).
DEFAULT_MIDDLE_ROOM = 256
MAX_EXTRA_FILES = 256


class InputFile(_Body):
    filename: Str = ""
    text: Str = ""


class InfillBody(LlamaBody):
    """``/infill``'s body: llama.cpp's fields and this server's generation ones."""

    input_prefix: Str = ""
    input_suffix: Str = ""
    input_extra: Annotated[list[InputFile], Field(max_length=MAX_EXTRA_FILES)] = []
    # The start of the middle the client already has (after the middle token).
    prompt: Str = ""


def _prompt(body: InfillBody, ctx: PromptContext, fim: FimTokens) -> tuple[list[int], bool]:
    tokenizer = ctx.tokenizer
    # Text that cannot be kept is not tokenized: a text holds at least one token per
    # ``longest_token_chars``, so ``reach`` characters hold twice the context, and
    # what fit_to_room keeps of the prefix's end (the suffix's start) lies well
    # inside the part taken.
    reach = 2 * ctx.context_length * longest_token_chars(tokenizer)
    prefix = encode_text(tokenizer, body.input_prefix[-reach:])
    suffix = encode_text(tokenizer, body.input_suffix[:reach])
    middle = encode_text(tokenizer, body.prompt)
    chunks = list(body.input_extra)
    # A file of over half of ``reach`` characters holds more than the context: it and
    # every file before it would be cut (the earliest go first), so none is read.
    too_long = [i for i, chunk in enumerate(chunks) if 2 * len(chunk.text) > reach]
    skipped = too_long[-1] + 1 if too_long else 0
    files = [
        extra_tokens(tokenizer, fim, [(chunk.filename, chunk.text)]) for chunk in chunks[skipped:]
    ]
    fixed = len(fim_prompt(fim, [], [], middle))
    wanted = body.requested_max_tokens or min(DEFAULT_MIDDLE_ROOM, ctx.context_length // 4)
    room = ctx.context_length - fixed - wanted
    prefix, suffix, files, cut = fit_to_room(prefix, suffix, files, room)
    extra = [token for chunk in files for token in chunk]
    return fim_prompt(fim, prefix, suffix, middle, extra), cut or skipped > 0


async def prepare_infill(body: InfillBody, ctx: PromptContext) -> LlamaRequest:
    stop = check_common(body, ctx)
    check_text_fits(len(body.prompt), ctx, "prompt", "the start of the middle ('prompt')")
    await dry.warm(body, ctx.tokenizer)
    fim = fim_of(ctx, "input_prefix")
    prompt, truncated = await asyncio.to_thread(_prompt, body, ctx, fim)
    ctx = replace(ctx, stop_token_ids=ctx.stop_token_ids | fim.ends)
    prepared = prepared_generation("completion", body, [prompt], stop, ctx)
    return LlamaRequest.of(prepared, body, truncated)
