"""The Responses API's request (POST /v1/responses, what the OpenAI Agents SDK sends by default) and how it becomes a
chat request, plus the store `previous_response_id` reads.

A Responses request is a chat request in other words: `instructions` is a system message, `input` (a string, or
message / function_call / function_call_output items) the conversation, function `tools` the tools, `text.format`
the response_format, `max_output_tokens` max_completion_tokens. So it is checked here for its own shape (a 400 names
its own fields), then rewritten as a ChatCompletionRequest and served by the chat path (server/handlers.py), whose
rules (templates, tool calls, structured outputs, limits) it shares. With `previous_response_id`, the stored
conversation of that response (its input and output, not its instructions, as OpenAI does) comes first.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Literal

import msgspec
from pydantic import Field, ValidationError, field_validator, model_validator

from nanoserve.server.protocol import ChatCompletionRequest, _Strict
from nanoserve.server.request_body import IGNORED_FIELDS, APIError, validation_message, without_ignored

RESPONSES_STORE_BYTES = 64 * 2**20  # conversations kept for previous_response_id; the oldest go first
# accepted and ignored (logged once), beyond the chat ones: they tune what this server does not have
RESPONSES_IGNORED = IGNORED_FIELDS - {"store", "metadata"} | {"reasoning", "truncation", "include", "stream_options",
                                                              "prompt_cache_retention", "max_tool_calls"}


class TextContent(_Strict):
    """A text part of a message: input_text (user, system), output_text (an assistant's, sent back as history)."""

    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: list | None = None
    logprobs: list | None = None


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextContent]
    id: str | None = None
    status: str | None = None
    phase: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextContent]
    id: str | None = None
    status: str | None = None


_ITEMS = {"message": MessageItem, "function_call": FunctionCallItem, "function_call_output": FunctionCallOutputItem}


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedTool(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: str | None = None  # accepted and ignored


class ResponsesRequest(_Strict):
    model: str
    input: str | list[MessageItem | FunctionCallItem | FunctionCallOutputItem]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedTool | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    background: bool = False

    @model_validator(mode="before")
    @classmethod
    def _drop_ignored(cls, data):
        return without_ignored(data, RESPONSES_IGNORED)

    @field_validator("input", mode="before")
    @classmethod
    def _items_by_type(cls, value):
        """Each item as its own type says (no type: a message), one line for an item of another kind."""
        if not isinstance(value, list):
            return value
        items = []
        for i, item in enumerate(value):
            kind = item.get("type", "message") if isinstance(item, dict) else None
            if kind not in _ITEMS:
                raise ValueError(f"input.{i}.type: {kind!r} items are not supported here (message, function_call, "
                                 "function_call_output)")
            items.append(_ITEMS[kind].model_validate(item))
        return items

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, tools):
        for i, tool in enumerate(tools if isinstance(tools, list) else ()):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise ValueError(f"tools.{i}.type: only function tools are served here, not {kind!r}")
        return tools

    @model_validator(mode="after")
    def _no_background(self):
        if self.background:
            raise ValueError("background: background responses are not supported; stream instead")
        return self

    def as_chat(self, history: list[dict]) -> ChatCompletionRequest:
        """The chat request this asks for, after `history` (the previous response's conversation)."""
        messages = ([{"role": "system", "content": self.instructions}] if self.instructions is not None else [])
        messages += history + self.input_messages()
        chat: dict[str, Any] = {"model": self.model, "messages": messages, "stream": self.stream,
                                "parallel_tool_calls": self.parallel_tool_calls}
        if self.tools:
            chat["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                             for t in self.tools]
        if isinstance(self.tool_choice, NamedTool):
            chat["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            chat["tool_choice"] = self.tool_choice
        form = self.text.format if self.text is not None else None
        if form is not None and form.type != "text":
            chat["response_format"] = {"type": form.type} if form.type == "json_object" else {
                "type": "json_schema", "json_schema": {"name": form.name or "output", "schema": form.json_schema,
                                                       "strict": form.strict}}
        for ours, theirs in (("max_output_tokens", "max_completion_tokens"), ("temperature", "temperature"),
                             ("top_p", "top_p")):
            if getattr(self, ours) is not None:
                chat[theirs] = getattr(self, ours)
        try:
            return ChatCompletionRequest.model_validate(chat)
        except ValidationError as e:  # said in chat's words (history, say: its messages)
            message, param = validation_message(e.errors(include_url=False))
            raise APIError(400, message, param=param) from None

    def input_messages(self) -> list[dict]:
        """`input` as chat messages: consecutive function calls join one assistant message, an output answers its
        call as a tool message."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        messages: list[dict] = []
        for item in self.input:
            if isinstance(item, MessageItem):
                messages.append({"role": item.role, "content": item.text()})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                    last["tool_calls"].append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            else:
                output = item.output if isinstance(item.output, str) else "".join(p.text for p in item.output)
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
        return messages

    def text_config(self) -> dict:
        """`text` as the response object echoes it."""
        form = self.text.format if self.text is not None and self.text.format is not None else None
        return {"format": form.model_dump(by_alias=True, exclude_none=True) if form else {"type": "text"}}


class ResponseStore:
    """Conversations by response id, for previous_response_id: in memory, at most `max_bytes` of them (as JSON), the
    oldest dropped first. 0 turns it off."""

    def __init__(self, max_bytes: int = RESPONSES_STORE_BYTES):
        self.max_bytes, self.size = max_bytes, 0
        self._items: OrderedDict[str, tuple[bytes, int]] = OrderedDict()

    def history(self, response_id: str | None) -> list[dict]:
        """The stored conversation up to and including that response (a 400 when there is none)."""
        if response_id is None:
            return []
        if self.max_bytes == 0:
            raise APIError(400, "previous_response_id: this server keeps no responses (--responses-store-bytes 0); "
                                "send the whole conversation as `input`.", param="previous_response_id")
        entry = self._items.get(response_id)
        if entry is None:
            raise APIError(400, f"Previous response with id '{response_id}' not found (responses are kept in memory, "
                                f"the oldest dropped beyond {self.max_bytes} bytes).", param="previous_response_id")
        self._items.move_to_end(response_id)
        return msgspec.json.decode(entry[0])

    def keep(self, response_id: str, conversation: list[dict]) -> None:
        data = msgspec.json.encode(conversation)
        if len(data) > self.max_bytes:
            return
        self._items[response_id] = (data, len(data))
        self.size += len(data)
        while self.size > self.max_bytes:
            _, (_, size) = self._items.popitem(last=False)
            self.size -= size


__all__ = ["RESPONSES_STORE_BYTES", "ResponseStore", "ResponsesRequest"]
