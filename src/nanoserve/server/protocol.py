"""OpenAI request bodies as pydantic models: types are strict ("5" is not an int, 1.5 is not an int) and unknown
fields are refused with a 400 naming the field, as api.openai.com does; value ranges are checked once, by
SamplingParams. Decoding and the error format: server/request_body.py.
"""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from nanoserve.config import MAX_LOGPROBS
from nanoserve.engine.prompts import is_token_ids
from nanoserve.server.request_body import without_ignored

# ---- request bodies ---------------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class JSONSchemaFormat(BaseModel):
    """response_format.json_schema: OpenAI's {name, description, schema, strict} (strict is what xgrammar does
    anyway: the output always follows the schema)."""

    name: str
    description: str | None = None
    json_schema: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: "text" (what every request gets), "json_object" (JSON mode: any object) or
    "json_schema" (an object following the schema); the last two become structured outputs."""

    type: str
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _known_type(self):
        if self.type not in ("text", "json_object", "json_schema"):
            raise ValueError(f"type: must be \"text\", \"json_object\" or \"json_schema\", got {self.type!r}")
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.json_schema is None):
            raise ValueError("json_schema: type \"json_schema\" needs json_schema.schema, the JSON schema to follow")
        return self

    def structured_outputs(self) -> dict | None:
        if self.type == "json_object":
            return {"json_object": True}
        return {"json": self.json_schema.json_schema} if self.type == "json_schema" else None


class _SamplingRequest(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI names + vLLM extras)."""

    model: str
    response_format: ResponseFormat | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool = False  # vLLM's: choices carry token_ids (and prompt_token_ids, first chunk only)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None  # JSON keys are text: token ids as strings, as OpenAI sends them
    # vLLM's (extra_body): one of json, regex, choice, grammar, json_object (checked by SamplingParams)
    structured_outputs: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _drop_ignored(cls, data):
        return without_ignored(data)

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, bias):
        if bias is None:
            return None
        bad = next((k for k in bias if not k.strip().isdigit()), None)
        if bad is not None:
            raise ValueError(f"logit_bias: keys must be token ids (integers >= 0 as strings), got {bad!r}")
        return {int(k): v for k, v in bias.items()}

    def sampling_kwargs(self) -> dict[str, Any]:
        """The SamplingParams keyword arguments this request sets (unset ones keep SamplingParams' defaults)."""
        names = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "presence_penalty",
                 "frequency_penalty", "repetition_penalty", "ignore_eos", "min_tokens", "include_stop_str_in_output",
                 "skip_special_tokens", "logit_bias")
        kwargs = {k: getattr(self, k) for k in names if getattr(self, k) is not None}
        structured = self.structured_outputs
        if structured is None and self.response_format is not None:
            structured = self.response_format.structured_outputs()
        if structured is not None:
            kwargs["structured_outputs"] = structured
        return kwargs

    @property
    def structured_outputs_param(self) -> str:
        """The request field the output constraint came from (where a 400 about it points)."""
        return "structured_outputs" if self.structured_outputs is not None else "response_format"

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: Stream options can only be defined when `stream=True`.")
        return self

    @model_validator(mode="after")
    def _one_constraint(self):
        if self.structured_outputs is not None and self.response_format is not None and \
                self.response_format.type != "text":
            raise ValueError(f"structured_outputs: both it and response_format ({self.response_format.type}) "
                             "constrain the output; give one")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingRequest):
    # a string, a list of strings, a list of token ids, or a list of token-id lists
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False  # the prompt in front of each choice (server/echo.py); with max_tokens 0: the prompt alone

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _token_ids_first(cls, value, handler):
        """One list of token ids (what benchmarks and tokenizing clients send) is checked with one C-level pass
        over its types; the union's member-by-member validation took ~0.2 ms for 1024 ids."""
        if type(value) is list and value and is_token_ids(value):
            return value
        return handler(value)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall

    def for_template(self) -> dict:
        """As chat templates expect it (and vLLM passes it): arguments parsed into an object when they are one."""
        try:
            arguments = json.loads(self.function.arguments)
        except ValueError:
            arguments = self.function.arguments
        if not isinstance(arguments, dict):
            arguments = self.function.arguments
        return {"id": self.id, "type": self.type, "function": {"name": self.function.name, "arguments": arguments}}


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant messages that called tools (content may be null)
    tool_call_id: str | None = None  # tool messages: the call they answer

    @model_validator(mode="before")
    @classmethod
    def _text_parts_only(cls, data):
        """A part of another type (image_url, input_audio, file) gets a 400 saying so, not a list of forms."""
        parts = data.get("content") if isinstance(data, dict) else None
        for i, part in enumerate(parts if isinstance(parts, list) else ()):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind != "text":
                raise ValueError(f"content.{i}.type: this model takes text only: {kind} parts are not supported")
        return data

    @model_validator(mode="after")
    def _check_role_fields(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content: Field required (only an assistant message with tool_calls may omit it)")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls: only assistant messages carry tool_calls")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("tool_call_id: Field required for tool messages")
        return self

    def for_template(self) -> dict:
        # null content (an assistant message that only called tools) reaches templates as "": many of them
        # concatenate message['content'] as a string
        content = "" if self.content is None else self.content if isinstance(self.content, str) else \
            "".join(p.text for p in self.content)
        msg: dict[str, Any] = {"role": self.role, "content": content}
        if self.name is not None:
            msg["name"] = self.name
        if self.tool_calls is not None:
            msg["tool_calls"] = [t.for_template() for t in self.tool_calls]
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        return msg


class FunctionDefinition(_Strict):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class ToolDefinition(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


TOOL_CHOICES = ("none", "auto", "required")


def tools_for_template(tools: list[ToolDefinition] | None) -> list[dict] | None:
    """The tools as the client sent them: what transformers passes a chat template as `tools`."""
    return [t.model_dump(exclude_unset=True) for t in tools] if tools else None


class ToolFields(_Strict):
    """OpenAI's tools, tool_choice and parallel_tool_calls (chat completions; tools also on /tokenize)."""

    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # None: auto with tools, else none
    parallel_tool_calls: bool = True

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _one_tool_choice(cls, choice):
        """One line naming the forms (not pydantic's per-member errors)."""
        if isinstance(choice, dict):
            try:
                return NamedToolChoice.model_validate(choice)
            except ValidationError as e:
                err = e.errors(include_url=False)[0]
                raise ValueError(f"{'.'.join(map(str, err['loc'])) or 'tool_choice'}: {err['msg']}") from None
        if choice is not None and choice not in TOOL_CHOICES:
            raise ValueError(f'must be "none", "auto", "required" or a named function '
                             f'{{"type":"function","function":{{"name":...}}}}, got {choice!r}')
        return choice

    @model_validator(mode="after")
    def _choice_needs_its_tools(self):
        names = [t.function.name for t in self.tools or ()]
        twice = next((n for i, n in enumerate(names) if n in names[:i]), None)
        if twice is not None:
            raise ValueError(f"tools: function names must be unique, {twice!r} is given twice")
        if self.tool_choice not in (None, "none") and not names:
            raise ValueError(f"tool_choice: {self.chosen_mode!r} needs `tools`, and none are given")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice: the function {self.tool_choice.function.name!r} is not in `tools` "
                             f"(given: {', '.join(names)})")
        return self

    @property
    def chosen_mode(self) -> str:
        """none | auto | required | named (OpenAI's default: auto when tools are given, none otherwise)."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or ("auto" if self.tools else "none")

    def template_tools(self) -> list[dict] | None:
        return tools_for_template(self.tools)


class ChatCompletionRequest(_SamplingRequest, ToolFields):
    messages: list[ChatMessage] = Field(min_length=1)
    functions: list[FunctionDefinition] | None = None  # legacy: mapped to `tools` (kept: the answer's legacy shape)
    function_call: Any = None  # legacy: mapped to `tool_choice`
    max_completion_tokens: int | None = None
    max_tokens: int | None = None  # deprecated OpenAI name; max_completion_tokens wins when both are set
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # checked here: SamplingParams calls it logprobs
    chat_template: str | None = None  # needs --trust-request-chat-template
    add_generation_prompt: bool = True

    @model_validator(mode="before")
    @classmethod
    def _legacy_functions(cls, data):
        """OpenAI's deprecated `functions` / `function_call` (and their messages) as tools: one call at most, as
        they had; the answer then carries `message.function_call` (server/tool_calls.py)."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if isinstance(data.get("messages"), list):
            data["messages"] = legacy_messages(data["messages"])
        if data.get("functions") is None and data.get("function_call") is None:
            return data
        if "tools" in data or "tool_choice" in data:
            raise ValueError("functions: give `tools` and `tool_choice`, or the deprecated `functions` and "
                             "`function_call`, not both")
        if data.get("functions") is not None:
            functions = data["functions"]
            data["tools"] = [{"type": "function", "function": f} for f in functions] \
                if isinstance(functions, list) else functions
            data["parallel_tool_calls"] = False
        choice = data.get("function_call")
        if isinstance(choice, dict):
            data["tool_choice"] = {"type": "function", "function": choice}
        elif choice is not None:
            data["tool_choice"] = choice
        return data


def legacy_messages(messages: list) -> list:
    """Deprecated message forms as today's: an assistant's `function_call` → one tool call (id call_legacy_<i>),
    a `function` role message → the tool message answering the last such call."""
    out, last_id = [], None
    for i, m in enumerate(messages):
        if isinstance(m, dict) and m.get("role") == "assistant" and isinstance(m.get("function_call"), dict):
            last_id = f"call_legacy_{i}"
            m = {k: v for k, v in m.items() if k != "function_call"}
            m["tool_calls"] = [{"id": last_id, "type": "function", "function": messages[i]["function_call"]}]
        elif isinstance(m, dict) and m.get("role") == "function":
            m = {**m, "role": "tool", "tool_call_id": last_id or f"call_legacy_{m.get('name')}"}
        out.append(m)
    return out
