"""From a validated OpenAI body to a ``GenerationRequest``.

Checks the model name, the parameters this server cannot honour and the stop
strings; renders chat messages through the tokenizer's chat template; tokenises
(in a worker thread, so a long prompt does not stall other streams); and fits the
token budget to the context:

- a prompt of ``context_length`` tokens or more is refused (400,
  ``context_length_exceeded``);
- ``max_tokens`` (or ``max_completion_tokens``) larger than the room left after the
  prompt is clamped to that room, and generation then ends with
  ``finish_reason="length"`` when it runs out; with no ``max_tokens`` the budget is
  ``limits.default_max_tokens`` or, when that is None, the body's ``unset_max_tokens``
  (16 on completions, as OpenAI's) or the whole room;
- ``max_tokens`` 0 (completions with ``echo`` only) reads the prompt and generates
  nothing; with ``logprobs`` too the prompt is scored (``score_prompt``).

A completion's ``prompt`` may be a batch (strings or token-id lists): each prompt
gets ``n`` choices (see ``PreparedGeneration.choice_requests``).

Sampling defaults are the model's recommended ones where its generation_config.json
gives them (stage/frontend/model_defaults.py), else OpenAI's: temperature 1, top_p
1, no top-k, no penalties.
A request without ``seed`` gets a fresh random one; a negative seed wraps modulo
2**64 (as an int64 would), so every seed OpenAI clients send is accepted.
``logit_bias`` keys must be token ids of the model's vocabulary.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from jinja2 import TemplateError, TemplateSyntaxError

from mesh.errors import InvalidRequest
from mesh.grammar import grammar_spec
from mesh.types import SamplingParams
from stage.frontend import dry
from stage.frontend.backend import POOLINGS, GenerationRequest
from stage.frontend.errors import OpenAIError, bad_request
from stage.frontend.fim import FimTokens, encode_text, fim_prompt
from stage.frontend.model_defaults import SamplingDefaults
from stage.frontend.reasoning import (
    REASONING_FORMATS,
    Thought,
    reasoning_start,
    tags_are_special,
)
from stage.frontend.schemas import ChatCompletionBody, CompletionBody, GenerationBody
from stage.frontend.tool_formats import (
    ToolFormat,
    ToolUse,
    forced_call_grammar,
    forced_prefix,
    marks_are_special,
    short_call_ids,
    tool_format,
)
from stage.frontend.tools import TemplateTools, generic_messages, template_tools
from stage.frontend.xml_tools import param_types

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FrontendLimits:
    """Bounds on request content, beyond the body size limit."""

    max_stop_sequences: int = 4
    max_stop_chars: int = 256
    default_max_tokens: int | None = None
    retry_after_s: int = 1
    # Reasoning models' thoughts apart from the answer (stage/frontend/reasoning.py).
    reasoning_format: str = "auto"
    # Responses kept for previous_response_id (stage/frontend/response_store.py).
    stored_responses: int = 1024
    # How /v1/embeddings pools a prompt's positions (stage/frontend/embeddings.py).
    embedding_pooling: str = "mean"
    # What unset sampling parameters default to (stage/frontend/model_defaults.py).
    sampling_defaults: SamplingDefaults = SamplingDefaults()

    def __post_init__(self) -> None:
        if self.max_stop_sequences < 0 or self.max_stop_chars < 1:
            raise ValueError(
                f"stop limits must be >= 0 sequences of >= 1 characters, got "
                f"{self.max_stop_sequences} and {self.max_stop_chars}"
            )
        if self.default_max_tokens is not None and self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1, got {self.default_max_tokens}")
        if self.stored_responses < 0:
            raise ValueError(f"stored_responses must be >= 0, got {self.stored_responses}")
        if self.embedding_pooling not in POOLINGS:
            raise ValueError(
                f"embedding_pooling must be one of {', '.join(POOLINGS)}, got "
                f"{self.embedding_pooling!r}"
            )
        if self.retry_after_s < 0:
            raise ValueError(f"retry_after_s must be >= 0, got {self.retry_after_s}")
        if self.reasoning_format not in REASONING_FORMATS:
            raise ValueError(
                f"reasoning_format must be one of {', '.join(REASONING_FORMATS)}, got "
                f"{self.reasoning_format!r}"
            )


@dataclass(frozen=True)
class PreparedGeneration:
    """Everything needed to run one request and format its answer."""

    kind: Literal["chat", "completion"]
    response_id: str
    created: int
    model_id: str
    # One per prompt: a batched completion has several (see ``choice_requests``).
    requests: tuple[GenerationRequest, ...]
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    fingerprint: str | None = None
    # Streamed chunks with output carry the usage so far (vLLM's
    # ``continuous_usage_stats``).
    continuous_usage: bool = False
    tools: ToolUse | None = None
    # ``n``: choices generated for each prompt (see ``choice_requests``).
    choices: int = 1
    # Completions' ``echo``: each prompt's text, put before its choices' text.
    echo: tuple[str, ...] = ()
    # Chat with a reasoning model: None when the output is not split into thought and
    # answer, else its tags and whether it starts inside the thought
    # (stage/frontend/reasoning.py).
    reasoning: Thought | None = None
    # The text keeps the stop string that ended it; special tokens are left out.
    include_stop: bool = False
    skip_special_tokens: bool = True

    @property
    def request(self) -> GenerationRequest:
        """The first prompt's request (its first choice's)."""
        return self.requests[0]

    def echo_of(self, index: int) -> str:
        """The echoed prompt text of choice ``index`` ("" without ``echo``)."""
        return self.echo[index // self.choices] if self.echo else ""

    def choice_requests(self) -> list[GenerationRequest]:
        """One request per choice, prompt by prompt: choice i of prompt p has index
        p * n + i (OpenAI's order). Choice 0 of a prompt is that prompt's request;
        choice i reads the same prompt from a copy of choice 0's session
        (``fork_of``) unless the prompt is scored (each choice then reads it, to get
        its scores), under its own request id, with seed + i (mod 2**64) so that
        sampled choices differ and each one is the answer of its prompt alone with
        n 1 and that seed."""
        out = []
        for number, first in enumerate(self.requests):
            out.append(first)
            for choice in range(1, self.choices):
                sampling = replace(first.sampling, seed=(first.sampling.seed + choice) % 2**64)
                out.append(
                    replace(
                        first,
                        request_id=f"{self.response_id}-{number * self.choices + choice}",
                        sampling=sampling,
                        fork_of="" if first.score_prompt else first.request_id,
                    )
                )
        return out


@dataclass(frozen=True)
class PromptContext:
    """What preparation needs from the app: the tokenizer and the served model."""

    tokenizer: Any
    model_id: str
    context_length: int
    stop_token_ids: frozenset[int]
    limits: FrontendLimits
    fingerprint: str | None = None
    # Who sent the request, by its API key (mesh/api_keys.py); "" without keys.
    tenant: str = ""
    # The model's fill-in-the-middle tokens (stage/frontend/fim.py), None without.
    fim: FimTokens | None = None
    # Checks a grammar spec against the served model's tokenizer (InvalidRequest
    # where the grammar library cannot follow it; blocking), where the backend can.
    check_grammar: Callable[[str], None] | None = None
    # Rows of the served model's embedding (0: unknown): a tokenizer may hold more
    # tokens (added ones) than the model has.
    model_vocab: int = 0

    def vocab(self) -> int:
        """Token ids a request may use: the tokenizer's, within the model's rows."""
        size = len(self.tokenizer)
        return min(size, self.model_vocab) if self.model_vocab > 0 else size


# The top_p a request's 0 stands for: only the likeliest token passes it.
MIN_TOP_P = 1e-9


def check_common(body: GenerationBody, ctx: PromptContext) -> tuple[str, ...]:
    if body.model is not None and body.model != ctx.model_id:
        raise OpenAIError(
            404,
            f"model {body.model!r} is not served here; this server serves {ctx.model_id!r} "
            "(see GET /v1/models)",
            param="model",
            code="model_not_found",
        )
    for param, message in body.unsupported():
        raise bad_request(message, param, code="unsupported_parameter")
    stop = body.stop_list
    limits = ctx.limits
    if len(stop) > limits.max_stop_sequences:
        raise bad_request(
            f"at most {limits.max_stop_sequences} stop sequences are allowed, got {len(stop)}",
            "stop",
        )
    for item in stop:
        if not item or len(item) > limits.max_stop_chars:
            raise bad_request(
                f"each stop sequence must have 1 to {limits.max_stop_chars} characters, "
                f"got {len(item)}",
                "stop",
            )
    return stop


def _stop_ids(body: GenerationBody, ctx: PromptContext) -> frozenset[int]:
    """The token ids that end the output: the model's (none with ``ignore_eos``) and
    the request's ``stop_token_ids``."""
    vocab = ctx.vocab()
    extra = body.stop_token_ids or []
    for token in extra:
        if not 0 <= token < vocab:
            raise bad_request(
                f"stop_token_ids holds {token}, outside the vocabulary [0, {vocab})",
                "stop_token_ids",
            )
    model = frozenset() if body.ignore_eos else ctx.stop_token_ids
    return model | frozenset(extra)


def _sampling(
    body: GenerationBody,
    prompt_len: int,
    vocab: int,
    stop_ids: frozenset[int] = frozenset(),
    breakers: tuple[int, ...] = (),
    defaults: SamplingDefaults = SamplingDefaults(),
) -> SamplingParams:
    """The request's sampling parameters, ``defaults`` for those it leaves unset;
    ``breakers`` are DRY's as token ids."""
    seed = secrets.randbits(63) if body.seed is None else body.seed % 2**64
    # llama.cpp's windows: -1 every token (0 on the wire), 0 the sampler off.
    penalties = body.repeat_last_n != 0
    dry_on = bool(body.dry_multiplier) and body.dry_penalty_last_n != 0
    return SamplingParams(
        temperature=defaults.temperature if body.temperature is None else body.temperature,
        # top_p 0 (OpenAI takes it) keeps the likeliest token alone, as the least
        # positive top_p does.
        top_p=defaults.top_p if body.top_p is None else max(body.top_p, MIN_TOP_P),
        top_k=defaults.top_k if body.top_k is None else body.top_k,
        seed=seed,
        presence_penalty=(body.presence_penalty or 0.0) if penalties else 0.0,
        frequency_penalty=(body.frequency_penalty or 0.0) if penalties else 0.0,
        repetition_penalty=(
            1.0
            if not penalties
            else defaults.repetition_penalty
            if body.repetition_penalty is None
            else body.repetition_penalty
        ),
        min_p=defaults.min_p if body.min_p is None else body.min_p,
        logit_bias=_logit_bias(body.logit_bias or {}, vocab),
        prompt_tokens=prompt_len,
        top_logprobs=body.requested_top_logprobs,
        grammar=_grammar(body),
        min_tokens=body.min_tokens or 0,
        hold_back=tuple(sorted(stop_ids)) if body.min_tokens else (),
        penalty_last_n=max(0, body.repeat_last_n or 0),
        typical_p=1.0 if body.typical_p is None else body.typical_p,
        top_n_sigma=max(0.0, body.top_n_sigma or 0.0),
        xtc_probability=body.xtc_probability or 0.0,
        xtc_threshold=0.1 if body.xtc_threshold is None else body.xtc_threshold,
        dry_multiplier=(body.dry_multiplier or 0.0) if dry_on else 0.0,
        dry_base=1.75 if body.dry_base is None else body.dry_base,
        dry_allowed_length=2 if body.dry_allowed_length is None else body.dry_allowed_length,
        dry_penalty_last_n=max(0, body.dry_penalty_last_n or 0),
        dry_breakers=breakers if dry_on else (),
        dynatemp_range=body.dynatemp_range or 0.0,
        dynatemp_exponent=1.0 if body.dynatemp_exponent is None else body.dynatemp_exponent,
    )


def _grammar(body: GenerationBody) -> str:
    """The grammar spec of the request's constraint on its output ("" for none:
    ``response_format`` text, or nothing set)."""
    constraints = body.output_constraints()
    if not constraints:
        return ""
    param, kind, value = constraints[0]
    if kind == "json_schema" and isinstance(value, str):
        # vLLM's guided_json also takes the schema as JSON text.
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise bad_request(f"{param} is not a JSON schema: {error}", param) from None
    try:
        return grammar_spec(kind, value)
    except InvalidRequest as error:
        raise bad_request(error.message, param) from None


def _logit_bias(bias: Mapping[str, float], vocab: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``{"token id": bias}`` as sorted (token, bias) pairs."""
    pairs = []
    for key, value in bias.items():
        token = int(key) if key.isascii() and key.isdigit() else -1
        if not 0 <= token < vocab:
            raise bad_request(
                f"logit_bias key {key!r} is not a token id of this model; keys are token ids "
                f"in [0, {vocab}) written as strings",
                "logit_bias",
            )
        pairs.append((token, float(value)))
    return tuple(sorted(pairs))


def longest_token_chars(tokenizer: Any) -> int:
    """The most characters one token of ``tokenizer`` stands for (its longest
    vocabulary entry; a byte-level token's entry has a character per byte)."""
    cached = getattr(tokenizer, "_mesh_longest_token_chars", None)
    if cached is None:
        cached = max((len(t) for t in tokenizer.get_vocab()), default=1) or 1
        try:
            tokenizer._mesh_longest_token_chars = cached
        except AttributeError:
            pass
    return int(cached)


def check_text_fits(chars: int, ctx: PromptContext, param: str, name: str = "the prompt") -> None:
    """400 before tokenizing when text of ``chars`` characters holds more tokens than
    the context for certain: at least one token per ``longest_token_chars``. A text
    a hundred times the context would otherwise be tokenized whole first (memory and
    seconds per request)."""
    longest = longest_token_chars(ctx.tokenizer)
    least = chars // longest
    if least >= ctx.context_length:
        raise bad_request(
            f"{name} has {chars} characters, so at least {least} tokens (no token of this "
            f"model is longer than {longest} characters), but the model's context is "
            f"{ctx.context_length} tokens; shorten the prompt",
            param,
            code="context_length_exceeded",
        )


def _budget(
    prompt_len: int,
    requested: int | None,
    ctx: PromptContext,
    param: str,
    name: str = "the prompt",
    unset: int | None = None,
) -> int:
    if prompt_len == 0:
        raise bad_request(f"{name} is empty; send some text or token ids", param)
    room = ctx.context_length - prompt_len
    if room <= 0:
        raise bad_request(
            f"{name} has {prompt_len} tokens but the model's context is "
            f"{ctx.context_length} tokens; shorten the prompt",
            param,
            code="context_length_exceeded",
        )
    wanted = requested if requested is not None else ctx.limits.default_max_tokens
    wanted = wanted if wanted is not None else unset
    return room if wanted is None else min(wanted, room)


@dataclass(frozen=True)
class TemplateUse:
    """How a chat request renders through its template: the request's own template
    ``variables`` (``chat_template_kwargs``), whether the assistant's turn is opened
    (``generation_prompt``) or the last message continued (``continue_final``)."""

    variables: Mapping[str, Any] | None = None
    generation_prompt: bool = True
    continue_final: bool = False


def render_chat(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    use: TemplateUse = TemplateUse(),
) -> list[int]:
    """Prompt token ids of chat ``messages`` (and ``tools``, for a template that
    renders them) through the tokenizer's chat template, as ``use`` says."""
    extra: dict[str, Any] = dict(use.variables or {})
    if tools:
        extra["tools"] = list(tools)
    if use.continue_final:
        extra["continue_final_message"] = True
    if not getattr(tokenizer, "chat_template", None):
        raise bad_request(
            "this model has no chat template, so chat messages cannot be turned into a "
            "prompt: send the prompt text, in the format the model expects, to "
            "/v1/completions",
            "messages",
        )
    messages = [dict(m) for m in messages]
    marked, specials = _mark_special_text(messages, special_texts(tokenizer))
    try:
        if specials:
            return _render_marked(tokenizer, marked, specials, use, extra)
        encoded = tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=use.generation_prompt and not use.continue_final,
            tokenize=True,
            return_dict=True,
            **extra,
        )
    except TemplateSyntaxError as exc:
        # The package's fault, not the request's: every chat request meets it.
        raise OpenAIError(
            500,
            f"the model's chat template cannot be compiled ({exc}); the operator must "
            "fix the package's chat template (tokenizer_config.json or "
            "chat_template.jinja); /v1/completions still serves prompt text",
            error_type="server_error",
            code="chat_template_broken",
        ) from None
    except TemplateError as exc:
        message = f"the model's chat template rejected the messages: {exc}"
        raise bad_request(message, "messages") from None
    except (ValueError, TypeError, KeyError, IndexError) as exc:
        raise bad_request(f"cannot apply the model's chat template: {exc}", "messages") from None
    ids = encoded["input_ids"] if isinstance(encoded, Mapping) else encoded
    return [int(i) for i in ids]


# Where a message's text holds a special token's text, the text goes through the
# template as a marker of these private-use characters and is read as plain text.
_MARK = re.compile("\ue000(\\d+)\ue001")


def special_texts(tokenizer: Any) -> tuple[str, ...]:
    """The texts of the tokenizer's special tokens (``<|im_end|>``...), longest first;
    cached on the tokenizer."""
    cached = getattr(tokenizer, "_mesh_special_texts", None)
    if cached is None:
        decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        found = {t.content for t in decoder.values() if getattr(t, "special", False)}
        found.update(getattr(tokenizer, "all_special_tokens", ()) or ())
        cached = tuple(sorted((t for t in found if t), key=len, reverse=True))
        try:
            tokenizer._mesh_special_texts = cached
        except AttributeError:
            pass
    return cached


def _mark_special_text(
    messages: list[dict[str, Any]], specials: Sequence[str]
) -> tuple[list[dict[str, Any]], list[str]]:
    """``messages`` with each special token's text in their strings (but roles)
    replaced by a marker, and the texts replaced, by marker number; ([], []) when
    no string holds one (the common case: nothing is copied)."""
    if not specials or not any(_holds(m, specials) for m in messages):
        return [], []
    pattern = re.compile("|".join(re.escape(t) for t in specials))
    found: list[str] = []

    def mark(value: Any, key: str = "") -> Any:
        if isinstance(value, str):
            if key == "role":
                return value

            def one(match: re.Match[str]) -> str:
                found.append(match.group(0))
                return f"\ue000{len(found) - 1}\ue001"

            return pattern.sub(one, value)
        if isinstance(value, dict):
            return {k: mark(v, k) for k, v in value.items()}
        if isinstance(value, list):
            return [mark(v) for v in value]
        return value

    return [mark(m) for m in messages], found


def _holds(value: Any, specials: Sequence[str]) -> bool:
    if isinstance(value, str):
        return any(t in value for t in specials)
    if isinstance(value, dict):
        return any(_holds(v, specials) for k, v in value.items() if k != "role")
    if isinstance(value, list):
        return any(_holds(v, specials) for v in value)
    return False


def _render_marked(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    specials: list[str],
    use: TemplateUse,
    extra: dict[str, Any],
) -> list[int]:
    """The prompt of messages whose text held special tokens' texts (marked by
    ``_mark_special_text``): the template's own text read as the template does (its
    special tokens are tokens), each marked text as plain text, so a message that
    writes ``<|im_end|>`` cannot end its turn or open another."""
    text = tokenizer.apply_chat_template(
        messages,
        add_generation_prompt=use.generation_prompt and not use.continue_final,
        tokenize=False,
        **extra,
    )
    parts = _MARK.split(text)
    if sorted(int(i) for i in parts[1::2]) != list(range(len(specials))):
        raise bad_request(
            "the model's chat template changed the text of a message that holds a "
            f"special token's text ({specials[0]!r}), so it cannot be read as plain "
            "text; leave such text out of the messages",
            "messages",
        )
    ids: list[int] = []
    for index, part in enumerate(parts):
        if index % 2 == 0:
            if part:
                ids.extend(tokenizer(part, add_special_tokens=False)["input_ids"])
        else:
            plain = tokenizer(
                specials[int(part)], add_special_tokens=False, split_special_tokens=True
            )
            ids.extend(plain["input_ids"])
    return [int(i) for i in ids]


def _chat_prompt(
    body: ChatCompletionBody, ctx: PromptContext, grammar: bool = True
) -> tuple[list[int], ToolUse | None]:
    """The prompt's token ids and what the answer is parsed for; with ``grammar``, a
    forced tool_choice's grammar too (token counts need none)."""
    messages = [m.template_dict() for m in body.messages]
    choice = body.tool_choice_name if body.tools else "none"
    tools = [t.template_dict() for t in body.offered_tools or ()] if choice != "none" else None
    mode = template_tools(getattr(ctx.tokenizer, "chat_template", None))
    if tools and mode is TemplateTools.OTHER:
        raise bad_request(
            "this model's chat template writes tool calls in a format this server does not "
            "parse (Hermes <tool_call> JSON, Llama 3 JSON, Mistral [TOOL_CALLS], "
            "Qwen3-Coder and GLM-4.5 XML are); omit tools",
            "tools",
            code="unsupported_parameter",
        )
    use = TemplateUse(
        body.template_variables(),
        body.add_generation_prompt is not False,
        bool(body.continue_final_message),
    )
    history = any(m["role"] == "tool" or m.get("tool_calls") for m in messages)
    fmt = ToolFormat.HERMES
    if mode is TemplateTools.NATIVE:
        fmt = tool_format(getattr(ctx.tokenizer, "chat_template", None))
        if fmt in (ToolFormat.MISTRAL, ToolFormat.MISTRAL_ARGS):
            messages = short_call_ids(messages)
        prompt = render_chat(ctx.tokenizer, messages, tools, use)
    elif tools or history:
        prompt = render_chat(ctx.tokenizer, generic_messages(messages, tools), None, use)
    else:
        prompt = render_chat(ctx.tokenizer, messages, None, use)
    if not tools:
        return prompt, None
    prefix = forced_prefix(fmt, choice)
    if prefix:
        prompt += [int(i) for i in ctx.tokenizer.encode(prefix, add_special_tokens=False)]
    names = tuple(t["function"]["name"] for t in tools)
    parallel = body.parallel_tool_calls is not False
    spec = _forced_call_spec(fmt, choice, tools, parallel, ctx) if prefix and grammar else ""
    types = tuple(param_types(tools).items())
    return prompt, ToolUse(names, parallel, prefix, fmt, spec, types)


def _forced_call_spec(
    fmt: ToolFormat,
    choice: str,
    tools: Sequence[Mapping[str, Any]],
    parallel: bool,
    ctx: PromptContext | None = None,
) -> str:
    """The grammar spec that keeps a forced tool_choice's answer to well-formed calls
    with schema-following arguments. Where the grammar library cannot follow a
    function's ``parameters`` schema (a reference it cannot resolve, a pattern it
    cannot compile, two functions defining one name differently), the calls are still
    held to the request's function names with JSON objects as arguments, and a
    warning names the reason; '' (the answer free after its forced start) only for
    formats without a call grammar (the XML styles, Mistral's name/args form)."""
    if not forced_call_grammar(fmt, choice, tools, parallel, schemas=False):
        return ""
    try:
        grammar = forced_call_grammar(fmt, choice, tools, parallel)
        if not grammar:
            raise InvalidRequest("two functions' schemas define one name differently")
        spec = grammar_spec("grammar", grammar)
        if ctx is not None and ctx.check_grammar is not None:
            ctx.check_grammar(spec)  # what only the model's tokenizer shows
        return spec
    except InvalidRequest as error:
        logger.warning(
            "tool_choice %r: the calls' arguments are held to JSON objects, not to their "
            "schemas: %s",
            choice,
            error.message,
        )
    return grammar_spec("grammar", forced_call_grammar(fmt, choice, tools, parallel, False))


def chat_prompt_tokens(body: ChatCompletionBody, ctx: PromptContext) -> list[int]:
    """The token ids a chat request's prompt has (its messages and tools through the
    chat template, the assistant's turn opened), as ``/tokenize`` reports them."""
    return _chat_prompt(body, ctx, grammar=False)[0]


async def checked_chat_prompt(body: ChatCompletionBody, ctx: PromptContext) -> list[int]:
    """The prompt ``prepare_chat`` would read for ``body``, after the same checks of
    the request (model, parameters) but none of its length: for counting tokens."""
    check_common(body, ctx)
    return await asyncio.to_thread(chat_prompt_tokens, body, ctx)


def encode_prompt(tokenizer: Any, prompt: str | list[int], name: str = "prompt") -> list[int]:
    """Prompt token ids of a completion prompt (text, or token ids checked against the
    vocab); ``name`` says which prompt in messages ("prompt 2" of a batch)."""
    if isinstance(prompt, str):
        return [int(i) for i in tokenizer.encode(prompt)]
    vocab = len(tokenizer)
    for i, token in enumerate(prompt):
        if not 0 <= token < vocab:
            raise bad_request(
                f"{name} token {i} is {token}, outside the vocabulary [0, {vocab})", "prompt"
            )
    return list(prompt)


def _completion_prompts(
    tokenizer: Any, prompts: Sequence[str | list[int]], echo: bool
) -> tuple[list[list[int]], tuple[str, ...]]:
    """Each prompt's token ids and, with ``echo``, its text: a string prompt as sent,
    token ids decoded (special tokens kept, as the logprobs' tokens show them)."""
    names = ["prompt"] if len(prompts) == 1 else [f"prompt {i}" for i in range(len(prompts))]
    encoded = [encode_prompt(tokenizer, p, name) for p, name in zip(prompts, names, strict=True)]
    if not echo:
        return encoded, ()
    texts = tuple(
        p
        if isinstance(p, str)
        else tokenizer.decode(p, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        for p in prompts
    )
    return encoded, texts


def _prediction(body: GenerationBody, ctx: PromptContext) -> tuple[int, ...] | None:
    """The prediction's tokens (no special tokens: it stands for the output)."""
    if body.prediction is None:
        return None
    return tuple(
        int(t) for t in ctx.tokenizer.encode(body.prediction.text, add_special_tokens=False)
    )


def _check_model_vocab(
    prompts: Sequence[list[int]], names: Sequence[str], param: str, ctx: PromptContext
) -> None:
    """400 for a prompt holding a token the tokenizer has and the model does not (an
    added token: the tokenizer is larger than the model's vocabulary), naming its
    text, which the sender may not know maps to such a token."""
    vocab = ctx.vocab()
    for prompt, name in zip(prompts, names, strict=True):
        beyond = [t for t in prompt if not 0 <= t < vocab]
        if beyond:
            text = ctx.tokenizer.decode([beyond[0]]) if beyond[0] < len(ctx.tokenizer) else ""
            raise bad_request(
                f"{name} holds token {beyond[0]} ({text!r}), outside the model's vocabulary "
                f"[0, {vocab}): the tokenizer has {len(ctx.tokenizer)} tokens, the model "
                f"{ctx.model_vocab}; leave that text out",
                param,
            )


def prepared_generation(
    kind: Literal["chat", "completion"],
    body: GenerationBody,
    prompts: Sequence[list[int]],
    stop: tuple[str, ...],
    ctx: PromptContext,
    tools: ToolUse | None = None,
    prediction: tuple[int, ...] | None = None,
    echo: tuple[str, ...] = (),
) -> PreparedGeneration:
    prefix = "chatcmpl" if kind == "chat" else "cmpl"
    response_id = f"{prefix}-{uuid.uuid4().hex}"
    choices = body.n or 1
    param = "messages" if kind == "chat" else "prompt"
    names = ["the prompt"] if len(prompts) == 1 else [f"prompt {i}" for i in range(len(prompts))]
    budgets = [
        _budget(len(p), body.requested_max_tokens, ctx, param, name, body.unset_max_tokens)
        for p, name in zip(prompts, names, strict=True)
    ]
    # One seed for the whole request: prompt p's choice i is the answer of that
    # prompt alone with seed + i.
    stop_ids = _stop_ids(body, ctx)
    breakers = ()
    if body.dry_multiplier:
        breakers = dry.breaker_ids(ctx.tokenizer, dry.breakers_of(body))
    _check_model_vocab(prompts, names, param, ctx)
    sampling = _sampling(
        body,
        len(prompts[0]),
        ctx.vocab(),
        stop_ids,
        breakers,
        ctx.limits.sampling_defaults,
    )
    if tools is not None and tools.grammar and not sampling.grammar:
        # A forced tool_choice, and no constraint of the request's own.
        sampling = replace(sampling, grammar=tools.grammar)
    first = GenerationRequest(
        request_id=response_id,
        prompt_tokens=tuple(prompts[0]),
        max_new_tokens=budgets[0],
        sampling=sampling,
        stop_token_ids=stop_ids,
        tenant=ctx.tenant,
        cache_salt=body.cache_salt or "",
        # The drafter's corpus partition: the tenant's, then the user's within it.
        scope=f"{ctx.tenant}/{body.user or ''}" if ctx.tenant else body.user or "",
        prediction_tokens=prediction,
        speculation=body.speculation is not False,
        max_window=getattr(body.speculation, "max_window", 0),
        # Completions' echo with logprobs reports the prompt's log-probabilities.
        score_prompt=bool(echo) and body.requested_top_logprobs >= 0,
    )
    requests = [first] + [
        replace(
            first,
            request_id=f"{response_id}-{number * choices}",
            prompt_tokens=tuple(prompt),
            max_new_tokens=budget,
            sampling=replace(sampling, prompt_tokens=len(prompt)),
        )
        for number, (prompt, budget) in enumerate(zip(prompts, budgets, strict=True))
        if number > 0
    ]
    return PreparedGeneration(
        kind=kind,
        response_id=response_id,
        created=int(time.time()),
        model_id=ctx.model_id,
        requests=tuple(requests),
        stop=stop,
        stream=bool(body.stream),
        include_usage=body.include_usage,
        continuous_usage=body.continuous_usage,
        fingerprint=ctx.fingerprint,
        tools=tools,
        choices=choices,
        echo=echo,
        include_stop=bool(body.include_stop_str_in_output),
        skip_special_tokens=body.skip_special_tokens is not False,
    )


async def prepare_chat(body: ChatCompletionBody, ctx: PromptContext) -> PreparedGeneration:
    stop = check_common(body, ctx)
    check_text_fits(sum(len(m.text()) for m in body.messages), ctx, "messages", "the messages")
    await dry.warm(body, ctx.tokenizer)
    prompt, tools = await asyncio.to_thread(_chat_prompt, body, ctx)
    prediction = await asyncio.to_thread(_prediction, body, ctx)
    prepared = prepared_generation("chat", body, [prompt], stop, ctx, tools, prediction)
    if tools is not None and marks_are_special(ctx.tokenizer, tools.format):
        # The calls' marks are special tokens: decoded with them kept, or the
        # answer's text would lose them.
        prepared = replace(prepared, skip_special_tokens=False)
    reasoning = reasoning_start(ctx.tokenizer, prompt, ctx.limits.reasoning_format)
    if reasoning is None:
        return prepared
    keep_special = tags_are_special(ctx.tokenizer, reasoning.tags)
    return replace(
        prepared,
        reasoning=reasoning,
        skip_special_tokens=prepared.skip_special_tokens and not keep_special,
    )


async def prepare_completion(body: CompletionBody, ctx: PromptContext) -> PreparedGeneration:
    """A completion of one prompt or a batch of them (``n`` choices each); with
    ``echo``, each prompt's text goes before its choices' text, and with ``logprobs``
    too the prompt is scored."""
    stop = check_common(body, ctx)
    batch = body.prompts()
    for index, text in enumerate(batch):
        if isinstance(text, str):
            name = "the prompt" if len(batch) == 1 else f"prompt {index}"
            check_text_fits(len(text), ctx, "prompt", name)
    await dry.warm(body, ctx.tokenizer)
    prompts, echo = await asyncio.to_thread(
        _completion_prompts, ctx.tokenizer, body.prompts(), bool(body.echo)
    )
    if body.suffix:
        # Fill in the middle: each prompt is the text before the gap.
        fim = fim_of(ctx, "suffix")
        check_text_fits(len(body.suffix), ctx, "suffix", "the suffix")
        suffix = await asyncio.to_thread(encode_text, ctx.tokenizer, body.suffix)
        prompts = [fim_prompt(fim, prompt, suffix) for prompt in prompts]
        ctx = replace(ctx, stop_token_ids=ctx.stop_token_ids | fim.ends)
    prediction = await asyncio.to_thread(_prediction, body, ctx)
    return prepared_generation(
        "completion", body, prompts, stop, ctx, prediction=prediction, echo=echo
    )


def fim_of(ctx: PromptContext, param: str) -> FimTokens:
    """The model's fill-in-the-middle tokens; 400 when it has none."""
    if ctx.fim is None:
        raise bad_request(
            f"{param}: the model {ctx.model_id!r} has no fill-in-the-middle tokens (such as "
            "<|fim_prefix|>, <fim_prefix> or <PRE>), so it cannot fill a gap; serve a code "
            "model trained for it (Qwen2.5-Coder, StarCoder2, CodeLlama, DeepSeek-Coder, "
            "Codestral) or send the text before the gap alone",
            param,
            code="unsupported_parameter",
        )
    return ctx.fim
