"""OpenAI's Responses API (``POST /v1/responses``) over the chat generation path.

A request is translated into the chat completion body it means and run exactly as
``/v1/chat/completions`` would run it (stage/frontend/translated.py):
``instructions`` become the first system message; ``input`` (a string: one user
message; or a list of items) becomes the messages: ``message`` items (roles
``user``, ``system``, ``developer``, ``assistant``; text as a string or
``input_text`` / ``output_text`` parts), ``function_call`` items (an assistant turn's
calls, merged into that turn) and ``function_call_output`` items (``tool``
messages); flat function ``tools``, ``tool_choice``, ``parallel_tool_calls``,
``text.format`` (``response_format``), ``max_output_tokens``, ``temperature``,
``top_p``, ``user`` and, as an extension, ``seed`` map to their chat twins.

The answer is a ``response`` whose ``output`` holds a ``message`` item
(``output_text``) and one ``function_call`` item per call the model made; status
``completed``, or ``incomplete`` with reason ``max_output_tokens`` when the token
budget ran out; streamed, the Responses API's events (responses_answer.py).

Stage 0 keeps the responses it answered (unless ``store: false``) for
``previous_response_id``, ``item_reference`` items and ``GET`` / ``DELETE
/v1/responses/{id}`` (response_store.py); what needs other state (``conversation``,
``prompt``, ``background``) is refused with a 400 that says to send the whole input;
so are built-in tools, image / file / audio input, ``reasoning`` (but effort
``none``), ``include``, ``truncation: "auto"``, ``text.verbosity`` and fields this
server does not know (``top_logprobs``, ``max_tool_calls``, a typo). Bookkeeping
fields that change nothing are accepted and ignored (``IGNORED_FIELDS``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Discriminator, Field, Strict, Tag, ValidationError, model_validator

from stage.frontend.chat_messages import FunctionName, tool_message_problem
from stage.frontend.errors import bad_request, from_validation_error
from stage.frontend.schemas import MAX_TOKENS_MAX, ChatCompletionBody
from stage.frontend.schemas_base import Bool, Int, Str, _Body

# Request fields that do not change what is generated: accepted and ignored.
IGNORED_FIELDS = frozenset(
    {
        "metadata",
        "service_tier",
        "prompt_cache_key",
        "prompt_cache_retention",
        "safety_identifier",
        "stream_options",
    }
)
# Fields that need state this server does not keep, with what to do instead.
STATEFUL_FIELDS = {
    "conversation": "this server keeps no conversations; send the whole conversation as 'input'",
    "prompt": "this server keeps no prompt templates; send the prompt as 'instructions' "
    "and 'input'",
}
MEDIA_PARTS = frozenset({"input_image", "input_file", "input_audio"})
TEXT_PARTS = frozenset({"input_text", "output_text"})
# ``reasoning.effort``: none and minimal ask a reasoning model not to think (through
# its template's ``enable_thinking``, as Qwen3's reads it); the others to think.
EFFORTS = ("none", "minimal", "low", "medium", "high")
ITEM_TYPES = frozenset({"message", "function_call", "function_call_output", "reasoning"})
CallId = Annotated[str, Strict(), Field(min_length=1, max_length=256)]


class TextPart(_Body):
    """A content part; only text, since the served model reads only text."""

    type: Str
    text: Str | None = None

    @model_validator(mode="after")
    def _text_only(self) -> TextPart:
        if self.type in MEDIA_PARTS:
            raise ValueError(
                f"'{self.type}' parts are not supported: the served model reads only text; "
                "send 'input_text' parts"
            )
        if self.type not in TEXT_PARTS:
            raise ValueError(
                f"content part type {self.type!r} is not supported; only 'input_text' and "
                "'output_text'"
            )
        if self.text is None:
            raise ValueError(f"an '{self.type}' part needs a 'text' string")
        return self


def _joined(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "\n".join(p.text or "" for p in content)


class MessageItem(_Body):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Str | list[TextPart]


class FunctionCallItem(_Body):
    type: Literal["function_call"]
    call_id: CallId
    name: FunctionName
    arguments: Str


class FunctionCallOutputItem(_Body):
    type: Literal["function_call_output"]
    call_id: CallId
    output: Str | list[TextPart]


class ReasoningItem(_Body):
    """An earlier answer's thought, sent back by clients: not shown to the model again
    (reasoning models' templates drop earlier thoughts too)."""

    type: Literal["reasoning"]


class OtherItem(_Body):
    """An input item this server cannot take: always refused, saying why."""

    @model_validator(mode="before")
    @classmethod
    def _refuse(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            raise ValueError(
                "each input item must be an object: a message, 'function_call' or "
                "'function_call_output' item"
            )
        if value.get("type") == "item_reference":
            raise ValueError(
                "item references need stored items, which this server does not keep; send "
                "the items themselves"
            )
        raise ValueError(
            f"input items of type {value.get('type')!r} are not supported; send 'message', "
            "'function_call' and 'function_call_output' items"
        )


def _item_kind(value: Any) -> str:
    """The tag of an input item: its ``type`` (a message may leave it out). Tags hold
    a '-', so that error locations leave them out (errors.py)."""
    if isinstance(value, dict):
        kind = value.get("type", "message")
    else:
        kind = getattr(value, "type", None)
    return f"item-{kind}" if kind in ITEM_TYPES else "item-other"


InputItem = Annotated[
    Annotated[MessageItem, Tag("item-message")]
    | Annotated[FunctionCallItem, Tag("item-function_call")]
    | Annotated[FunctionCallOutputItem, Tag("item-function_call_output")]
    | Annotated[ReasoningItem, Tag("item-reasoning")]
    | Annotated[OtherItem, Tag("item-other")],
    Discriminator(_item_kind),
]


class FunctionTool(_Body):
    """The Responses API's flat function tool (chat nests it under ``function``)."""

    type: Str
    name: FunctionName | None = None
    description: Str | None = None
    parameters: dict[str, Any] | None = None
    strict: Bool | None = None

    @model_validator(mode="after")
    def _function_only(self) -> FunctionTool:
        if self.type != "function":
            raise ValueError(
                f"built-in tool {self.type!r} is not supported: this server runs only "
                "'function' tools, which the client executes"
            )
        if self.name is None:
            raise ValueError("a function tool needs a 'name'")
        return self

    def function(self) -> dict[str, Any]:
        """Chat's ``function`` of this tool (unset fields left out)."""
        return self.model_dump(exclude={"type"}, exclude_none=True)

    def echo(self) -> dict[str, Any]:
        """The tool as a response reports it."""
        return {"type": "function"} | self.model_dump(exclude={"type"})


class FunctionChoice(_Body):
    type: Str
    name: FunctionName | None = None

    @model_validator(mode="after")
    def _function_only(self) -> FunctionChoice:
        if self.type != "function" or self.name is None:
            raise ValueError(
                "tool_choice must be 'auto', 'none', 'required' or "
                "{'type': 'function', 'name': ...}"
            )
        return self


class AllowedFunction(_Body):
    type: Literal["function"]
    name: FunctionName


class ResponsesAllowedTools(_Body):
    """The Responses API's ``allowed_tools`` tool_choice (flat: mode and tools beside
    the type)."""

    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: Annotated[list[AllowedFunction], Field(min_length=1, max_length=128)]

    def chat(self) -> dict[str, Any]:
        """The same choice in the chat API's shape."""
        named = [{"type": "function", "function": {"name": tool.name}} for tool in self.tools]
        return {"type": "allowed_tools", "allowed_tools": {"mode": self.mode, "tools": named}}


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Strict(), Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")] | None = None
    description: Str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: Bool | None = None

    @model_validator(mode="after")
    def _schema_present(self) -> TextFormat:
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise ValueError("format 'json_schema' needs 'name' and 'schema'")
        return self

    def response_format(self) -> dict[str, Any]:
        """Chat's ``response_format`` for this format."""
        if self.type != "json_schema":
            return {"type": self.type}
        schema = {"name": self.name, "schema": self.schema_, "strict": self.strict}
        if self.description is not None:
            schema["description"] = self.description
        return {"type": "json_schema", "json_schema": schema}


class TextConfig(_Body):
    format: TextFormat | None = None
    verbosity: Str | None = None


class ResponsesBody(_Body):
    """The Responses API request. Unknown top-level fields are refused, as on the
    chat endpoint, except ``IGNORED_FIELDS``."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False, frozen=True)

    model: Annotated[str, Strict(), Field(min_length=1, max_length=512)] | None = None
    input: Str | Annotated[list[InputItem], Field(min_length=1)]
    instructions: Str | None = None
    max_output_tokens: Annotated[int, Strict(), Field(ge=1, le=MAX_TOKENS_MAX)] | None = None
    temperature: Annotated[float, Strict(), Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Strict(), Field(gt=0.0, le=1.0)] | None = None
    stream: Bool | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=128)] | None = None
    tool_choice: (
        Literal["auto", "none", "required"] | ResponsesAllowedTools | FunctionChoice | None
    ) = None
    parallel_tool_calls: Bool | None = None
    text: TextConfig | None = None
    user: Str | None = None
    # Not in the Responses API: an extension, as on chat.
    seed: Int | None = None
    truncation: Literal["auto", "disabled"] | None = None
    background: Bool | None = None
    # Keep the response for previous_response_id (the default, as OpenAI's).
    store: Bool | None = None
    reasoning: dict[str, Any] | None = None
    include: list[Str] | None = None

    def refusals(self) -> list[tuple[str, str]]:
        """(param, message) for each field set to something this server cannot do."""
        problems = [
            (name, f"{name} is not supported: {advice}")
            for name, advice in STATEFUL_FIELDS.items()
            if (self.model_extra or {}).get(name) is not None
        ]
        for name in sorted(set(self.model_extra or {}) - IGNORED_FIELDS - set(STATEFUL_FIELDS)):
            problems.append(
                (name, f"unknown parameter '{name}'; this server does not support it: remove it")
            )
        if self.background:
            problems.append(
                ("background", "background responses need stored responses; omit 'background'")
            )
        asked = {k: v for k, v in (self.reasoning or {}).items() if v is not None}
        if set(asked) - {"effort"} or asked.get("effort", "none") not in EFFORTS:
            problems.append(
                (
                    "reasoning",
                    "reasoning takes only 'effort' (none, minimal, low, medium, high): a "
                    "reasoning model's thought comes back whole, as a reasoning item",
                )
            )
        if self.include:
            problems.append(("include", f"include {self.include[0]!r} is not supported"))
        if self.truncation == "auto":
            problems.append(
                (
                    "truncation",
                    "truncation 'auto' is not supported: an input longer than the context is "
                    "refused; send 'disabled' or shorten the input",
                )
            )
        if self.text is not None and self.text.verbosity is not None:
            problems.append(("text", "text.verbosity is not supported; omit it"))
        form = self.format
        if self.tools and form is not None and form.type != "text":
            problems.append(
                (
                    "text",
                    "text.format other than 'text' with tools is not supported: the grammar "
                    "would forbid function calls; send one or the other",
                )
            )
        if not self.tools and (
            self.tool_choice == "required"
            or isinstance(self.tool_choice, FunctionChoice | ResponsesAllowedTools)
        ):
            problems.append(("tool_choice", "this tool_choice needs 'tools'"))
        return problems

    @property
    def format(self) -> TextFormat | None:
        return self.text.format if self.text is not None else None

    def chat_body(self, model_id: str) -> dict[str, Any]:
        """The same request as a chat completion body."""
        for param, message in self.refusals():
            raise bad_request(message, param, code="unsupported_parameter")
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
        else:
            messages += _chat_messages(self.input)
        body: dict[str, Any] = {
            "model": self.model or model_id,
            "messages": messages,
            "stream": bool(self.stream),
        }
        if self.max_output_tokens is not None:
            body["max_tokens"] = self.max_output_tokens
        for name in ("temperature", "top_p", "seed", "user"):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        if self.format is not None and self.format.type != "text":
            body["response_format"] = self.format.response_format()
        effort = (self.reasoning or {}).get("effort")
        if effort is not None:
            body["chat_template_kwargs"] = {"enable_thinking": effort not in ("none", "minimal")}
        if self.tools:
            body["tools"] = [{"type": "function", "function": t.function()} for t in self.tools]
            choice = self.tool_choice
            if isinstance(choice, FunctionChoice):
                body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
            elif isinstance(choice, ResponsesAllowedTools):
                body["tool_choice"] = choice.chat()
            elif choice is not None:
                body["tool_choice"] = choice
            if self.parallel_tool_calls is not None:
                body["parallel_tool_calls"] = self.parallel_tool_calls
        return body


def _chat_messages(items: list[Any]) -> list[dict[str, Any]]:
    """Chat messages of input items: a function call joins the assistant turn it
    follows (its text and other calls), or opens one."""
    out: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, MessageItem):
            out.append({"role": item.role, "content": _joined(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            out.append(
                {"role": "tool", "tool_call_id": item.call_id, "content": _joined(item.output)}
            )
    return out


def parse_body(payload: dict[str, Any], model_id: str) -> tuple[ResponsesBody, ChatCompletionBody]:
    """The Responses request and its chat completion twin; OpenAIError (400) when
    either is invalid."""
    try:
        body = ResponsesBody.model_validate(payload)
    except ValidationError as exc:
        raise from_validation_error(exc) from None
    try:
        chat = ChatCompletionBody.model_validate(body.chat_body(model_id))
    except ValidationError as exc:
        # The chat twin's fields are not the request's: name what was sent.
        error = from_validation_error(exc)
        if error.param == "messages" or (error.param or "").startswith("messages."):
            raise bad_request(
                "input holds no message to answer (only reasoning or empty items); "
                "send at least one message or function call output"
                if "at least 1 item" in error.message
                else error.message.replace("'messages", "'input"),
                "input",
            ) from None
        raise error from None
    problem = tool_message_problem(chat.messages)
    if problem:
        # Counted over the conversation the input makes (instructions first).
        raise bad_request(f"input, read as a conversation: {problem}", "input")
    return body, chat
