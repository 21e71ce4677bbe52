"""Request bodies of the OpenAI-compatible endpoints (pydantic, strict types).

Types are strict: ``"1"`` is not an integer and ``true`` is not a number. A field
this server does not know, or knows but cannot honour (``best_of``, ``suffix``
for a model without fill-in-the-middle tokens, ...), is refused with a 400 that
names it rather than silently ignored: a client that asks for something gets it or
is told. Exceptions: OpenAI's
bookkeeping fields that do not change the answer (``IGNORED_FIELDS``), and unknown
fields inside messages (clients replay OpenAI's own message objects, with fields
such as ``refusal`` or ``annotations``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, Strict

from stage.frontend.chat_messages import (
    AllowedToolsChoice,
    ChatMessage,
    NamedToolChoice,
    Tool,
    tool_message_problem,
)
from stage.frontend.schemas_base import Bool, Int, Str, _Body

SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1
TOP_K_MAX = 2**32 - 1
MAX_TOKENS_MAX = 2**31 - 1
# Tokens a completion generates when the request sets no ``max_tokens`` (OpenAI's
# default for its completions API; chat has none: the room left in the context).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# Longest ``stop_token_ids`` list (an extension).
STOP_TOKEN_IDS_MAX = 64
USER_MAX_CHARS = 256
LOGIT_BIAS_MAX_ENTRIES = 1024
# DRY: the longest allowed repeat, and its sequence breakers (at most, characters each).
DRY_LENGTH_MAX = 1024
DRY_BREAKERS_MAX = 16
DRY_BREAKER_CHARS = 40
# What llama.cpp breaks DRY's repeats at when a request names no breakers.
DRY_DEFAULT_BREAKERS = ("\n", ":", '"', "*")

# Names ``chat_template_kwargs`` may not set: the server's own arguments of
# transformers' ``apply_chat_template`` and the variables it sets from the request.
TEMPLATE_ARGUMENTS = frozenset(
    {
        "conversation", "messages", "tools", "documents", "chat_template",
        "add_generation_prompt", "continue_final_message", "tokenize", "padding",
        "truncation", "max_length", "return_tensors", "return_dict",
        "return_assistant_tokens_mask", "tokenizer_kwargs", "bos_token", "eos_token",
    }
)  # fmt: skip
# Most choices (``n``) one request may ask for.
MAX_CHOICES = 16
# Longest ``prediction`` text (characters); longest per-request speculation window.
PREDICTION_MAX_CHARS = 1_000_000
MAX_WINDOW = 64


class StreamOptions(_Body):
    # OpenAI's fields (and vLLM's): anything else is a 400 naming it, as an
    # unknown top-level field is.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)

    include_usage: Bool | None = None
    # vLLM's extension: usage so far in every chunk that carries output.
    continuous_usage_stats: Bool | None = None
    # OpenAI's padding of streamed chunks against length side channels: accepted and
    # not applied (chunks carry no padding field).
    include_obfuscation: Bool | None = None


# OpenAI request fields that do not change what is generated: accepted and ignored.
# ``reasoning_effort`` values that ask a reasoning model not to think.
REST_EFFORTS = ("none", "minimal")
IGNORED_FIELDS = frozenset(
    {"metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"}
)


class JsonSchemaFormat(_Body):
    """``response_format.json_schema``: OpenAI's shape. The schema is always
    enforced, whether ``strict`` is set or not."""

    name: Annotated[str, Strict(), Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: Str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: Bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class PredictionTextPart(_Body):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)

    type: Literal["text"]
    text: Str


class Prediction(_Body):
    """OpenAI's Predicted Outputs: the text the client expects back (typically the
    file being edited), drafted from; it never changes the output."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)

    type: Literal["content"]
    content: (
        Annotated[str, Strict(), Field(max_length=PREDICTION_MAX_CHARS)] | list[PredictionTextPart]
    )

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


GuidedJson = dict[str, Any] | Str


class StructuredOutputs(_Body):
    """vLLM's ``structured_outputs`` (an extension): exactly one constraint on the
    output, enforced as ``response_format`` is. Its other keys (``structural_tag``,
    whitespace settings) are refused."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)

    json_: GuidedJson | None = Field(default=None, alias="json")
    json_object: Bool | None = None
    regex: Str | None = None
    choice: list[Str] | None = None
    grammar: Str | None = None

    def constraints(self) -> list[tuple[str, Any]]:
        """(kind, value) of each constraint set."""
        found: list[tuple[str, Any]] = []
        if self.json_ is not None:
            found.append(("json_schema", self.json_))
        if self.json_object:
            found.append(("json_object", None))
        for kind in ("regex", "choice", "grammar"):
            if getattr(self, kind) is not None:
                found.append((kind, getattr(self, kind)))
        return found


class SpeculationControl(_Body):
    """The ``speculation`` extension as an object: a cap on this request's window."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)

    max_window: Annotated[int, Strict(), Field(ge=1, le=MAX_WINDOW)]


class GenerationBody(_Body):
    """Fields shared by /v1/chat/completions and /v1/completions."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False, frozen=True)

    # Optional: a mesh serves one model (llama-server and vLLM accept it missing too).
    model: Annotated[str, Strict(), Field(min_length=1, max_length=512)] | None = None
    max_tokens: Annotated[int, Strict(), Field(ge=1, le=MAX_TOKENS_MAX)] | None = None
    temperature: Annotated[float, Strict(), Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Strict(), Field(ge=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Strict(), Field(ge=0, le=TOP_K_MAX)] | None = None
    seed: Annotated[int, Strict(), Field(ge=SEED_MIN, le=SEED_MAX)] | None = None
    stop: Str | list[Str] | None = None
    n: Int | None = None
    user: Annotated[str, Strict(), Field(max_length=USER_MAX_CHARS)] | None = None
    stream: Bool | None = None
    stream_options: StreamOptions | None = None
    presence_penalty: Annotated[float, Strict(), Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Strict(), Field(ge=-2.0, le=2.0)] | None = None
    # Not OpenAI's, but sent by llama.cpp, vLLM and many clients.
    repetition_penalty: Annotated[float, Strict(), Field(gt=0.0, le=10.0)] | None = None
    min_p: Annotated[float, Strict(), Field(ge=0.0, le=1.0)] | None = None
    # llama.cpp's samplers (extensions, llama.cpp's names and ranges; mesh/sampling.py).
    # The penalties' window: -1 every token, 0 no penalties, n the last n.
    repeat_last_n: Annotated[int, Strict(), Field(ge=-1)] | None = None
    typical_p: Annotated[float, Strict(), Field(gt=0.0, le=1.0)] | None = None
    # 0 or less: off (llama.cpp's -1).
    top_n_sigma: Annotated[float, Strict(), Field(le=100.0)] | None = None
    xtc_probability: Annotated[float, Strict(), Field(ge=0.0, le=1.0)] | None = None
    xtc_threshold: Annotated[float, Strict(), Field(ge=0.0, le=1.0)] | None = None
    dry_multiplier: Annotated[float, Strict(), Field(ge=0.0, le=100.0)] | None = None
    dry_base: Annotated[float, Strict(), Field(ge=1.0, le=10.0)] | None = None
    dry_allowed_length: Annotated[int, Strict(), Field(ge=0, le=DRY_LENGTH_MAX)] | None = None
    # -1 every token, 0 DRY off, n the last n.
    dry_penalty_last_n: Annotated[int, Strict(), Field(ge=-1)] | None = None
    dry_sequence_breakers: (
        Annotated[
            list[Annotated[str, Strict(), Field(min_length=1, max_length=DRY_BREAKER_CHARS)]],
            Field(max_length=DRY_BREAKERS_MAX),
        ]
        | None
    ) = None
    dynatemp_range: Annotated[float, Strict(), Field(ge=0.0, le=10.0)] | None = None
    dynatemp_exponent: Annotated[float, Strict(), Field(gt=0.0, le=10.0)] | None = None
    logit_bias: (
        Annotated[
            dict[Str, Annotated[float, Strict(), Field(ge=-100.0, le=100.0)]],
            Field(max_length=LOGIT_BIAS_MAX_ENTRIES),
        ]
        | None
    ) = None
    # Structured output (chat, and completions as an extension, as vLLM does).
    response_format: ResponseFormat | None = None
    # More constraints on the output (extensions): vLLM's ``structured_outputs`` and
    # its earlier ``guided_*`` names, llama.cpp's ``grammar`` (GBNF) and
    # ``json_schema``. At most one constraint per request (``output_constraint``).
    structured_outputs: StructuredOutputs | None = None
    guided_json: GuidedJson | None = None
    guided_regex: Str | None = None
    guided_choice: list[Str] | None = None
    guided_grammar: Str | None = None
    grammar: Str | None = None
    json_schema: dict[str, Any] | None = None
    # Extension (vLLM's name): kept prefixes are shared only among requests with the
    # same salt (within the tenant), so other users cannot probe for this prompt.
    cache_salt: Annotated[str, Strict(), Field(min_length=1, max_length=256)] | None = None
    # Predicted Outputs (chat, and completions as an extension).
    prediction: Prediction | None = None
    # Extension: false turns speculation off for this request; {"max_window": N}
    # caps its draft window (true: the server's policy, the default).
    speculation: Bool | SpeculationControl | None = None
    # Extensions vLLM and llama.cpp clients send: generate past the model's end token
    # (``ignore_eos``), more token ids that end the output (``stop_token_ids``), and
    # no end before ``min_tokens`` output tokens.
    ignore_eos: Bool | None = None
    # Extensions (vLLM's names): keep the stop string that ended the text in it, and
    # write special tokens (other than the end token) into the text.
    include_stop_str_in_output: Bool | None = None
    skip_special_tokens: Bool | None = None
    stop_token_ids: Annotated[list[Int], Field(max_length=STOP_TOKEN_IDS_MAX)] | None = None
    min_tokens: Annotated[int, Strict(), Field(ge=0, le=MAX_TOKENS_MAX)] | None = None

    def unsupported(self) -> list[tuple[str, str]]:
        """(param, message) for each field set to something this server cannot do."""
        problems: list[tuple[str, str]] = []
        limit = self.requested_max_tokens
        if self.min_tokens and limit is not None and self.min_tokens > limit:
            problems.append(
                (
                    "min_tokens",
                    f"min_tokens ({self.min_tokens}) is more than max_tokens ({limit}); "
                    "lower it or raise max_tokens",
                )
            )
        for field in sorted(set(self.model_extra or {}) - IGNORED_FIELDS):
            problems.append(
                (field, f"unknown parameter '{field}'; this server does not support it: remove it")
            )
        if self.n is not None and not 1 <= self.n <= MAX_CHOICES:
            problems.append(("n", f"n={self.n}: n must be between 1 and {MAX_CHOICES}"))
        if self.stream_options is not None and not self.stream:
            problems.append(("stream_options", "stream_options is only allowed with stream=true"))
        form = self.response_format
        if form is not None and form.type == "json_schema" and form.json_schema is None:
            problems.append(
                ("response_format", "type 'json_schema' needs 'json_schema': {name, schema}")
            )
        if self.structured_outputs is not None and not self.structured_outputs.constraints():
            problems.append(
                (
                    "structured_outputs",
                    "structured_outputs needs one of json, json_object, regex, choice, grammar",
                )
            )
        constraints = self.output_constraints()
        if len(constraints) > 1:
            named = ", ".join(f"{param} ({kind})" for param, kind, _ in constraints)
            problems.append(
                (
                    constraints[1][0],
                    f"one constraint on the output per request; this one sets {named}: keep one",
                )
            )
        return problems

    def output_constraints(self) -> list[tuple[str, str, Any]]:
        """(param, kind, value) of every constraint on the output the request sets:
        kind as ``mesh.grammar.grammar_spec`` takes it."""
        found: list[tuple[str, str, Any]] = []
        form = self.response_format
        if form is not None and form.type != "text":
            schema = form.json_schema.schema_ if form.json_schema is not None else None
            found.append(("response_format", form.type, schema))
        if self.structured_outputs is not None:
            found += [("structured_outputs", *c) for c in self.structured_outputs.constraints()]
        for param, kind in (
            ("guided_json", "json_schema"),
            ("guided_regex", "regex"),
            ("guided_choice", "choice"),
            ("guided_grammar", "grammar"),
            ("grammar", "grammar"),
            ("json_schema", "json_schema"),
        ):
            if getattr(self, param) is not None:
                found.append((param, kind, getattr(self, param)))
        return found

    @property
    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def unset_max_tokens(self) -> int | None:
        """The budget of a request that sets no ``max_tokens`` where the operator set
        no default: None, the room left in the context."""
        return None

    @property
    def requested_top_logprobs(self) -> int:
        """-1: no log-probabilities; else how many alternatives per token."""
        return -1

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        options = self.stream_options
        return bool(self.stream and options and options.continuous_usage_stats)


class ChatCompletionBody(GenerationBody):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Strict(), Field(ge=1, le=MAX_TOKENS_MAX)] | None = None
    logprobs: Bool | None = None
    top_logprobs: Annotated[int, Strict(), Field(ge=0, le=20)] | None = None
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: (
        Literal["none", "auto", "required"] | NamedToolChoice | AllowedToolsChoice | None
    ) = None
    parallel_tool_calls: Bool | None = None
    functions: list[Any] | None = None
    # Extension (vLLM's and llama.cpp's name): more variables for the model's chat
    # template, such as Qwen3's ``enable_thinking``.
    chat_template_kwargs: dict[str, Any] | None = None
    # Extensions (vLLM's names): ``continue_final_message`` continues the last
    # message, an assistant's, instead of opening a new turn (assistant prefill; it
    # needs ``add_generation_prompt`` false); ``add_generation_prompt`` false alone
    # leaves the assistant's turn unopened.
    add_generation_prompt: Bool | None = None
    continue_final_message: Bool | None = None
    # OpenAI's: how hard a reasoning model thinks. Reaches the template as
    # ``enable_thinking`` (false for none / minimal), as the Responses API's does.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    # OpenAI's output modalities: text, the default, is the one served.
    modalities: list[Str] | None = None

    def template_variables(self) -> dict[str, Any] | None:
        """``chat_template_kwargs``, with ``reasoning_effort``'s ``enable_thinking``
        where the request does not set it there itself."""
        variables = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            variables.setdefault("enable_thinking", self.reasoning_effort not in REST_EFFORTS)
        return variables or self.chat_template_kwargs

    @property
    def tool_choice_name(self) -> str:
        """``none``, ``auto`` (the default with tools), ``required`` or a function name."""
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            return choice.function.name
        if isinstance(choice, AllowedToolsChoice):
            return choice.allowed_tools.mode
        return choice or "auto"

    @property
    def allowed_names(self) -> set[str] | None:
        """The function names an ``allowed_tools`` tool_choice allows (None: every tool)."""
        choice = self.tool_choice
        if not isinstance(choice, AllowedToolsChoice):
            return None
        return {tool.function.name for tool in choice.allowed_tools.tools}

    @property
    def offered_tools(self) -> list[Tool] | None:
        """The tools the model is shown and may call: ``tools``, narrowed to the
        ``allowed_tools`` of such a tool_choice."""
        allowed = self.allowed_names
        if allowed is None or not self.tools:
            return self.tools
        return [tool for tool in self.tools if tool.function.name in allowed]

    @property
    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    @property
    def requested_top_logprobs(self) -> int:
        return (self.top_logprobs or 0) if self.logprobs else -1

    def unsupported(self) -> list[tuple[str, str]]:
        problems = super().unsupported()
        if self.top_logprobs is not None and not self.logprobs:
            problems.append(("top_logprobs", "top_logprobs needs logprobs=true"))
        if self.functions:
            problems.append(("functions", "'functions' is deprecated; send 'tools'"))
        if self.modalities is not None and list(self.modalities) != ["text"]:
            problems.append(
                ("modalities", "only text output is supported: send modalities ['text']")
            )
        if not self.tools:
            for name in ("tool_choice", "parallel_tool_calls"):
                if getattr(self, name) is not None:
                    problems.append((name, f"{name} is only allowed with tools"))
        else:
            names = [tool.function.name for tool in self.tools]
            if len(set(names)) != len(names):
                problems.append(("tools", "two tools have the same function name"))
            choice = self.tool_choice_name
            if choice not in ("none", "auto", "required") and choice not in names:
                problems.append(
                    ("tool_choice", f"tool_choice names {choice!r}, which is not in tools")
                )
            unknown = sorted((self.allowed_names or set()) - set(names))
            if unknown:
                problems.append(
                    (
                        "tool_choice",
                        f"tool_choice.allowed_tools names {', '.join(map(repr, unknown))}, "
                        "which is not in tools",
                    )
                )
        tool_problem = tool_message_problem(self.messages)
        if tool_problem:
            problems.append(("messages", tool_problem))
        if self.continue_final_message:
            last = self.messages[-1]
            if last.role != "assistant" or not last.text() or last.tool_calls:
                problems.append(
                    (
                        "continue_final_message",
                        "continue_final_message needs the last message to be the assistant's "
                        "text to continue",
                    )
                )
            if self.add_generation_prompt is not False:
                problems.append(
                    (
                        "add_generation_prompt",
                        "continue_final_message continues the last message: set "
                        "add_generation_prompt to false",
                    )
                )
            if self.tools and self.tool_choice_name not in ("auto", "none"):
                problems.append(
                    (
                        "continue_final_message",
                        "continue_final_message cannot be combined with a forced tool_choice",
                    )
                )
        taken = sorted(set(self.chat_template_kwargs or {}) & TEMPLATE_ARGUMENTS)
        if taken:
            problems.append(
                (
                    "chat_template_kwargs",
                    f"chat_template_kwargs may not set {', '.join(taken)}: the server sets "
                    "it from the request",
                )
            )
        constraints = self.output_constraints()
        if constraints and self.tools:
            param = constraints[0][0]
            problems.append(
                (
                    param,
                    f"{param} with tools is not supported: the grammar would forbid "
                    "tool calls; send one or the other",
                )
            )
        return problems


TokenList = Annotated[list[Int], Field(min_length=1)]


class CompletionBody(GenerationBody):
    # A batch's token lists may be empty here: the check that names which one is
    # empty comes with the others' tokenisation (prepare.py).
    prompt: Str | TokenList | list[Str] | list[list[Int]]
    # 0 only with ``echo``: the prompt is read (and scored, with ``logprobs``), nothing
    # is generated (OpenAI's legacy idiom for scoring text).
    max_tokens: Annotated[int, Strict(), Field(ge=0, le=MAX_TOKENS_MAX)] | None = None
    echo: Bool | None = None
    logprobs: Annotated[int, Strict(), Field(ge=0, le=5)] | None = None
    best_of: Int | None = None
    suffix: Str | None = None

    @property
    def unset_max_tokens(self) -> int | None:
        """OpenAI's default for completions (16): the budget of a request that sets no
        ``max_tokens`` where the operator set no default either."""
        return COMPLETIONS_DEFAULT_MAX_TOKENS

    @property
    def requested_top_logprobs(self) -> int:
        return -1 if self.logprobs is None else self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one, or several for a batched ``prompt``."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and isinstance(prompt[0], int):
            return [list(prompt)]
        return list(prompt)

    def unsupported(self) -> list[tuple[str, str]]:
        problems = super().unsupported()
        prompts = len(self.prompts())
        choices = prompts * (self.n or 1)
        if prompts == 0:
            problems.append(("prompt", "prompt is empty; send a string or a list of token ids"))
        elif choices > MAX_CHOICES and 1 <= (self.n or 1) <= MAX_CHOICES:
            problems.append(
                (
                    "prompt",
                    f"{prompts} prompts with n={self.n or 1} ask for {choices} choices; at most "
                    f"{MAX_CHOICES} per request: send fewer prompts or a smaller n",
                )
            )
        if self.max_tokens == 0 and not self.echo:
            problems.append(
                (
                    "max_tokens",
                    "max_tokens=0 is only allowed with echo=true (to read or score the prompt "
                    "without generating); ask for at least 1 token",
                )
            )
        if self.best_of is not None and self.best_of != 1:
            problems.append(("best_of", "best_of is not supported; only best_of=1"))
        if self.suffix and self.echo:
            problems.append(
                ("suffix", "suffix (fill in the middle) cannot be combined with echo; send one")
            )
        return problems
