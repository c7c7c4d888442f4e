"""POST /v1/responses: the Responses API over the chat path (the request: server/responses_protocol.py).

The answer is a `response` object whose `output` holds a `message` item (its text as one output_text part) and a
`function_call` item per tool call, in the order the model wrote them; `status` is "incomplete" (with
incomplete_details.reason "max_output_tokens") when max_output_tokens cut it. Streamed, the same items are built by
OpenAI's event sequence: response.created, response.in_progress, then per item response.output_item.added,
(response.content_part.added, response.output_text.delta…, response.output_text.done, response.content_part.done |
response.function_call_arguments.delta…, response.function_call_arguments.done), response.output_item.done, and
last response.completed (or response.incomplete), each with its sequence_number. One OutputBuilder makes the items
for both, so a stream's deltas join to the non-streamed answer. A stored response (`store`, the default) keeps its
conversation for previous_response_id.
"""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

import msgspec
from fastapi import Request
from fastapi.responses import Response

from nanoserve.server.collector import EngineError, RequestRejectedError
from nanoserve.server.handlers import OpenAIServer, _close, _engine_error, json_response
from nanoserve.server.request_body import parse_request
from nanoserve.server.responses_protocol import ResponsesRequest, ResponseStore
from nanoserve.server.sse import SSEResponse


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputBuilder:
    """A response's output items, grown from chat deltas (content text, tool-call deltas); each change also gives the
    stream events that say it (a non-streamed answer drops them)."""

    def __init__(self):
        self.items: list[dict] = []
        self.open: dict | None = None  # the item still growing
        self.seq = 0

    def event(self, kind: str, **fields) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + msgspec.json.encode(data) + b"\n\n"

    def _where(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.items) - 1}

    def content(self, text: str) -> list[bytes]:
        events = [] if self.open is not None and self.open["type"] == "message" else self.close()
        if self.open is None:
            self.open = {"id": _id("msg"), "type": "message", "status": "in_progress", "role": "assistant",
                         "content": []}
            self.items.append(self.open)
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events += [self.event("response.output_item.added", output_index=len(self.items) - 1,
                                  item=_copy(self.open)),
                       self.event("response.content_part.added", **self._where(), content_index=0, part=part)]
            self.open["content"].append(dict(part))
        self.open["content"][0]["text"] += text
        return events + [self.event("response.output_text.delta", **self._where(), content_index=0, delta=text,
                                    logprobs=[])]

    def call(self, delta: dict) -> list[bytes]:
        """A chat tool-call delta: one that opens a call (its id and name) starts an item, the others add arguments."""
        events: list[bytes] = []
        arguments = delta["function"].get("arguments") or ""
        if delta.get("id") is not None:
            events = self.close()
            self.open = {"id": _id("fc"), "type": "function_call", "status": "in_progress", "call_id": delta["id"],
                         "name": delta["function"]["name"], "arguments": ""}
            self.items.append(self.open)
            events.append(self.event("response.output_item.added", output_index=len(self.items) - 1,
                                     item=_copy(self.open)))
        if arguments:
            self.open["arguments"] += arguments
            events.append(self.event("response.function_call_arguments.delta", **self._where(), delta=arguments))
        return events

    def close(self, status: str = "completed") -> list[bytes]:
        """End the growing item (if any) with its closing events."""
        if self.open is None:
            return []
        item, where, events = self.open, self._where(), []
        item["status"] = status
        if item["type"] == "message":
            part = item["content"][0]
            events += [self.event("response.output_text.done", **where, content_index=0, text=part["text"],
                                  logprobs=[]),
                       self.event("response.content_part.done", **where, content_index=0, part=_copy(part))]
        else:
            events.append(self.event("response.function_call_arguments.done", **where, name=item["name"],
                                     arguments=item["arguments"]))
        events.append(self.event("response.output_item.done", output_index=where["output_index"], item=_copy(item)))
        self.open = None
        return events

    def feed(self, delta: dict) -> list[bytes]:
        """A chat delta ({"content", "tool_calls"}) into items."""
        events = self.content(delta["content"]) if delta.get("content") else []
        for call in delta.get("tool_calls") or ():
            events += self.call(call)
        return events

    def conversation_message(self) -> dict:
        """The output as the assistant message a chat conversation holds (for previous_response_id)."""
        text = "".join(i["content"][0]["text"] for i in self.items if i["type"] == "message")
        calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
                 for i in self.items if i["type"] == "function_call"]
        return {"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}


def _copy(item: dict) -> dict:
    return msgspec.json.decode(msgspec.json.encode(item))


class ResponsesAPI:
    def __init__(self, server: OpenAIServer, store: ResponseStore):
        self.server, self.store = server, store

    async def create(self, request: Request) -> Response:
        body = await parse_request(request, ResponsesRequest)
        history = self.store.history(body.previous_response_id)
        chat = body.as_chat(history)
        collector, tracker, tools, ids, params = await self.server.start_chat(chat, "max_output_tokens", "resp")
        run = _Run(self, body, history, _id("resp"))
        if body.stream:
            return SSEResponse(run.events(collector, tracker, tools), on_close=lambda: _close(collector, tracker))
        [(_, out)] = await self.server.result(request, collector, tracker)
        c = out.outputs[0]
        message, finish_reason = tools.message(c.text, c.finish_reason)
        builder = run.builder
        builder.feed({"content": message.get("content"), "tool_calls": [
            {"id": t["id"], "function": t["function"]} for t in message.get("tool_calls") or ()]})
        builder.close("incomplete" if finish_reason == "length" else "completed")
        return json_response(run.finish(finish_reason, self.server.usage(collector)))


class _Run:
    """One response being made: its request, its output builder, and the response object around them."""

    def __init__(self, api: ResponsesAPI, body: ResponsesRequest, history: list[dict], response_id: str):
        self.api, self.body, self.history, self.id = api, body, history, response_id
        self.builder, self.created = OutputBuilder(), int(time.time())

    def response(self, status: str, usage: dict | None = None, finish_reason: str | None = None) -> dict:
        body = self.body
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if finish_reason == "length" else None,
                "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
                "model": self.api.server.model_name, "output": self.builder.items if usage else [],
                "parallel_tool_calls": body.parallel_tool_calls, "previous_response_id": body.previous_response_id,
                "temperature": body.temperature, "top_p": body.top_p, "text": body.text_config(),
                "tool_choice": _tool_choice(body), "tools": [t.model_dump(exclude_none=True) for t in body.tools or ()],
                "store": body.store, "metadata": body.metadata or {}, "truncation": "disabled", "background": False,
                "usage": _usage(usage) if usage else None}

    def finish(self, finish_reason: str | None, usage: dict) -> dict:
        """The finished response object; stored when asked (the default)."""
        if self.body.store and self.api.store.max_bytes:
            self.api.store.keep(self.id, self.history + self.body.input_messages() +
                                [self.builder.conversation_message()])
        return self.response("incomplete" if finish_reason == "length" else "completed", usage, finish_reason)

    async def events(self, collector, tracker, tools) -> AsyncIterator[bytes]:
        b, stream, finish_reason = self.builder, tools.stream() if tools.parses else None, None
        try:
            yield b.event("response.created", response=self.response("in_progress")) + \
                b.event("response.in_progress", response=self.response("in_progress"))
            while True:
                events = []
                for _, out in await collector.get():
                    for c in out.outputs:
                        delta = {"content": c.text} if stream is None else stream.delta(c.text, c.finish_reason)[0]
                        events += b.feed(delta)
                        finish_reason = c.finish_reason or finish_reason
                if events:
                    yield b"".join(events)
                if collector.finished:
                    break
            final = b.close("incomplete" if finish_reason == "length" else "completed")
            response = self.finish(finish_reason, self.api.server.usage(collector))
            kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
            yield b"".join(final) + b.event(kind, response=response)
        except (EngineError, RequestRejectedError) as e:
            tracker.end("error")
            error = _engine_error(e)
            yield b.event("error", code=error.code, message=error.message, param=None)
        finally:
            _close(collector, tracker)


def _tool_choice(body: ResponsesRequest):
    choice = body.tool_choice
    if choice is None:
        return "auto" if body.tools else "none"
    return choice if isinstance(choice, str) else choice.model_dump()


def _usage(usage: dict) -> dict:
    return {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"]}


__all__ = ["OutputBuilder", "ResponsesAPI"]
