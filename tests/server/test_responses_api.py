"""Issue 39, 9: POST /v1/responses on the live server (tests/server/conftest.py) through the official openai SDK:
string and item inputs, instructions, tools and tool_choice, text.format, max_output_tokens, streaming with
OpenAI's event sequence, usage, and previous_response_id from the byte-bounded store. Greedy answers are checked
against the chat completion the same conversation gets."""
from __future__ import annotations

import json
from typing import Literal

import openai
import pytest
from pydantic import BaseModel

from nanoserve.server.responses_protocol import ResponseStore

MODEL = "tiny"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city now.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                          "required": ["city"], "additionalProperties": False}}
GREEDY = dict(model=MODEL, temperature=0, max_output_tokens=6)


def chat_twin(live, messages, **kw):
    return live.client().chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                                 max_completion_tokens=6, **kw)


def test_a_string_input_with_instructions_is_the_chat_answer(live):
    r = live.client().responses.create(input="Tell me a story", instructions="Be brief.", **GREEDY)
    twin = chat_twin(live, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story"}])
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.output_text == twin.choices[0].message.content and r.output[0].type == "message"
    assert r.output[0].content[0].type == "output_text" and r.output[0].role == "assistant"
    assert (r.usage.input_tokens, r.usage.output_tokens) == (twin.usage.prompt_tokens, twin.usage.completion_tokens)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    if twin.choices[0].finish_reason == "length":
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    else:
        assert r.status == "completed" and r.incomplete_details is None


def test_the_stream_is_openais_event_sequence_and_joins_to_the_answer(live):
    kw = dict(input=[{"role": "user", "content": [{"type": "input_text", "text": "Once upon a time"}]}], **GREEDY)
    answer = live.client().responses.create(**kw)
    events = list(live.client().responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == f"response.{answer.status}"
    assert kinds[2:5] == ["response.output_item.added", "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == answer.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == answer.usage.output_tokens


def test_forced_calls_stream_their_arguments(live):
    kw = dict(input="Weather in Paris?", tools=[WEATHER], max_output_tokens=100, temperature=0, model=MODEL)
    for choice in ("required", {"type": "function", "name": "get_weather"}):
        answer = live.client().responses.create(tool_choice=choice, **kw)
        calls = [o for o in answer.output if o.type == "function_call"]
        assert calls and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_"), answer
        if answer.status == "completed":
            assert json.loads(calls[0].arguments)["city"] in ("Paris", "Rome")
        events = list(live.client().responses.create(tool_choice=choice, stream=True, **kw))
        added = [e.item for e in events if e.type == "response.output_item.added"]
        assert added[0].type == "function_call" and added[0].name == "get_weather"
        arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        done = next(e for e in events if e.type == "response.function_call_arguments.done")
        assert arguments == done.arguments == calls[0].arguments
        assert not [e for e in events if e.type == "response.output_text.delta"]


def test_function_call_items_are_the_tool_history(live):
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
               {"type": "function_call_output", "call_id": "call_1", "output": "18 C, sunny"}]
    r = live.client().responses.create(input=history, tools=[WEATHER], tool_choice="none", **GREEDY)
    twin = chat_twin(live, [history[0], {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}], tools=[
        {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}], tool_choice="none")
    assert r.output_text == twin.choices[0].message.content and r.usage.input_tokens == twin.usage.prompt_tokens


class Verdict(BaseModel):
    answer: Literal["yes", "no"]


def test_parse_gives_the_structured_output(live):
    r = live.client().responses.parse(model=MODEL, input="Is the sky blue?", text_format=Verdict, temperature=0,
                                      max_output_tokens=48)
    assert r.status == "completed", r
    assert isinstance(r.output_parsed, Verdict) and json.loads(r.output_text) == r.output_parsed.model_dump()


def test_previous_response_id_continues_the_conversation(live, monkeypatch):
    client = live.client()
    first = client.responses.create(input="Hi", **GREEDY)
    second = client.responses.create(input="And then?", previous_response_id=first.id, **GREEDY)
    twin = chat_twin(live, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": first.output_text},
                            {"role": "user", "content": "And then?"}])
    assert second.previous_response_id == first.id and second.usage.input_tokens == twin.usage.prompt_tokens
    assert second.output_text == twin.choices[0].message.content
    unstored = client.responses.create(input="Hi", store=False, **GREEDY)
    for missing in ("resp_nope", unstored.id):
        with pytest.raises(openai.BadRequestError) as err:
            client.responses.create(input="x", previous_response_id=missing, **GREEDY)
        assert err.value.body["param"] == "previous_response_id" and "not found" in err.value.body["message"]
    monkeypatch.setattr(live.app.state.responses.store, "max_bytes", 0)
    with pytest.raises(openai.BadRequestError, match="keeps no responses"):
        client.responses.create(input="x", previous_response_id=first.id, **GREEDY)


def test_the_store_is_bounded_in_bytes():
    store = ResponseStore(max_bytes=300)
    for i in range(10):
        store.keep(f"resp_{i}", [{"role": "user", "content": "x" * 60}])
    assert store.size <= 300 and store.history("resp_9") and len(store._items) < 10
    with pytest.raises(Exception, match="not found"):
        store.history("resp_0")
    store.keep("resp_big", [{"role": "user", "content": "x" * 400}])  # larger than the store: not kept
    assert "resp_big" not in store._items


@pytest.mark.parametrize("body,param", [
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"input": [{"type": "input_image", "image_url": "http://x/y.png"}]}, "input"),
    ({"background": True}, "background"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}}, "response_format"),
    ({"max_output_tokens": 10**6}, "max_output_tokens"),
    ({"temperature": "hot"}, "temperature"),
])
def test_bad_requests_are_400_naming_the_field(live, body, param):
    with live.http() as http:
        r = http.post("/v1/responses", json={"model": MODEL, "input": "Hi", **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
