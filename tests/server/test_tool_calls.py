"""Tool calling on the live server (tests/server/conftest.py), through the official `openai` client: request checks,
tools in the chat template (a Qwen2.5-style one and SmolLM2's), the constraint "required" and named choices hand
the engine, and the tool_calls of answers and streams. For the answer shapes the engine client's output is
scripted (a given model text, in pieces); everything from there on (handler, parser, SSE, the client) is real.
The end-to-end test of "required" on the real SmolLM2 GGUF runs where structured outputs are enforced."""
from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from pydantic import BaseModel

from nanoserve.engine.output import CompletionOutput, RequestOutput
from nanoserve.server.collector import RequestCollector
from nanoserve.server.tool_calls import NO_PARAMETERS, required_schema
from nanoserve.server import protocol
from nanoserve.server.protocol import FunctionDefinition

MODEL = "tiny"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["C", "F"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]

# Qwen2.5's chat template with its instructions shortened (the tiny model's max_model_len is 256): what Hermes-style
# templates do with tools, tool_calls and tool messages
QWEN_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are Qwen.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n<tools>' }}{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\nCall as <tool_call>\\n{\"name\": <name>, \"arguments\": <args>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are Qwen.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}{%- if tool_call.function is defined %}"
    "{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

HISTORY = ASK + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]


def post_chat(live, **body) -> httpx.Response:
    with live.http() as http:
        return http.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 2, **body})


@pytest.mark.parametrize("body,param,words", [
    ({"tool_choice": "auto"}, "tool_choice", "needs `tools`"),
    ({"tool_choice": "required", "tools": []}, "tool_choice", "needs `tools`"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice",
     "'get_time' is not in `tools` (given: get_weather)"),
    ({"tools": [WEATHER], "tool_choice": "any"}, "tool_choice", 'must be "none", "auto", "required" or a named'),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice", "tool_choice.function: Field required"),
    ({"tools": [{"type": "custom", "function": {"name": "f"}}]}, "tools", "tools.0.type"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools", "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]}, "tools",
     "tools.0.function.parameters"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "'get_weather' is given twice"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "parallel_tool_calls"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
      "tool_choice": "required"}, "tools", "tools[].function.parameters"),  # the constraint's schema does not compile
])
def test_bad_tool_requests_are_400_naming_the_problem(live, body, param, words):
    r = post_chat(live, **body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert words in error["message"] and error["param"] == param and error["type"] == "invalid_request_error"


def test_tool_choice_none_without_tools_is_fine(live):
    assert post_chat(live, tool_choice="none").status_code == 200


def test_an_unknown_tool_call_parser_is_refused_before_anything_loads():
    from nanoserve.server.app import build_app

    with pytest.raises(ValueError, match="tool_call_parser must be one of auto, none, hermes, llama3_json, got 'x'"):
        build_app("/no/such/model", tool_call_parser="x")


# -- the prompt ------------------------------------------------------------------------------------------------------
def rendered(live, messages, tools=None) -> str:
    """The prompt the server builds, from /tokenize (the same template path as chat)."""
    with live.http() as http:
        r = http.post("/tokenize", json={"messages": messages, **({"tools": tools} if tools else {})})
    assert r.status_code == 200, r.text
    return live.prompt_tokenizer.decode(r.json()["tokens"])


def test_tools_and_tool_history_reach_a_qwen_template(live, monkeypatch):
    monkeypatch.setattr(live.prompt_tokenizer, "chat_template", QWEN_TEMPLATE)
    text = rendered(live, HISTORY, [WEATHER, TIME])
    assert text == live.prompt_tokenizer.apply_chat_template(
        [{"role": "user", "content": ASK[0]["content"]},
         {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
             "name": "get_weather", "arguments": {"city": "Paris"}}}]},
         {"role": "tool", "content": "18 C, sunny", "tool_call_id": "call_1"}],
        tools=[WEATHER, TIME], tokenize=False, add_generation_prompt=True)
    assert "<tools>\n" + json.dumps(WEATHER) + "\n" + json.dumps(TIME) + "\n</tools>" in text  # as the client sent them
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>' in text
    assert "<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response><|im_end|>" in text
    # a chat request renders the same prompt, tool_choice "none" included (vLLM's default: tools stay in the prompt)
    expected = len(live.prompt_tokenizer.encode(rendered(live, ASK, [TIME]), add_special_tokens=False))
    assert expected > len(live.prompt_tokenizer.encode(rendered(live, ASK), add_special_tokens=False))
    for choice in ("auto", "none"):
        r = live.client().chat.completions.create(model=MODEL, messages=ASK, tools=[TIME], tool_choice=choice,
                                                  max_tokens=1)
        assert r.usage.prompt_tokens == expected


def test_tool_history_renders_in_smollm2_template_with_tools(smollm2_gguf):
    from nanoserve.model_files import load_tokenizer
    from nanoserve.server.protocol import ChatCompletionRequest

    body = ChatCompletionRequest.model_validate({"model": "m", "messages": HISTORY, "tools": [WEATHER]})
    tokenizer = load_tokenizer(str(smollm2_gguf))
    text = tokenizer.apply_chat_template([m.for_template() for m in body.messages], tools=body.template_tools(),
                                         tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>assistant\n<|im_end|>\n<|im_start|>tool\n18 C, sunny<|im_end|>" in text


# -- answers (the engine's output scripted) ------------------------------------------------------------------------
@pytest.fixture
def scripted(live, monkeypatch):
    """scripted(*texts, piece=3) → the SamplingParams the next requests hand the engine: choice j of a request gets
    texts[j] (in pieces of `piece` characters, one token each), then finishes with "stop"."""
    seen, script = [], {}

    def add(prompts, params, prefix="req", observer=None):
        seen.append(params)
        collector = RequestCollector([f"{prefix}-scripted-0"], [prompts[0][1]], params.n, lambda c: None, observer)
        asyncio.get_running_loop().create_task(_play(collector, prompts[0][1], params.n))
        return collector

    async def _play(collector, prompt_ids, n):
        texts = [script["texts"][j % len(script["texts"])] for j in range(n)]
        pieces = [[t[i:i + script["piece"]] for i in range(0, len(t), script["piece"])] for t in texts]
        for step in range(max(map(len, pieces)) + 1):
            outs = [CompletionOutput(j, p[step] if step < len(p) else "", [7] if step < len(p) else [],
                                     "stop" if step == len(p) else None, None, None)
                    for j, p in enumerate(pieces) if step <= len(p)]
            collector.put(0, RequestOutput(collector.request_ids[0], None, prompt_ids, outs,
                                           finished=step == max(map(len, pieces))))
            await asyncio.sleep(0.001)

    def start(*texts, piece=3):
        script.update(texts=texts, piece=piece)
        return seen

    monkeypatch.setattr(live.engine_client, "add", add)
    return start


CALLS = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n'
         '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
TWO_CALLS = [("get_weather", '{"city":"Paris","unit":"C"}'), ("get_time", "{}")]  # arguments compact, as OpenAI's


def calls_of(message):
    return [(t.function.name, t.function.arguments) for t in message.tool_calls or ()]


async def _renders(self=None) -> bool:
    return True


@pytest.fixture
def renders_tools(live, monkeypatch):
    """The server as it is for a model whose template renders `tools` (the tiny model's does not)."""
    monkeypatch.setattr(live.app.state.server, "template_renders_tools", _renders)


@pytest.fixture
def hermes(live, monkeypatch, renders_tools):
    """The server as it is for a model whose template asks for <tool_call> (--tool-call-parser auto → hermes)."""
    monkeypatch.setattr(live.app.state.server, "model_tool_parser", "hermes")


def test_auto_tool_calls_are_parsed_per_choice(live, scripted, hermes):
    scripted(CALLS, "Just text, no <tool_call> here")
    r = live.client().chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], n=2)
    first, second = r.choices
    assert first.message.content == "Let me check." and calls_of(first.message) == TWO_CALLS
    assert first.finish_reason == "tool_calls" and first.message.role == "assistant"
    ids = [t.id for t in first.message.tool_calls]
    assert all(i.startswith("call_") and len(i) == 29 for i in ids) and len(set(ids)) == 2
    assert all(t.type == "function" for t in first.message.tool_calls)
    assert second.message.content == "Just text, no <tool_call> here" and second.message.tool_calls is None
    assert second.finish_reason == "stop"


def test_a_call_only_answer_has_null_content_and_parallel_false_keeps_the_first(live, scripted, hermes):
    scripted(CALLS.split("\n", 1)[1])
    body = live.client().chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME],
                                                 parallel_tool_calls=False)
    assert body.choices[0].message.content is None and calls_of(body.choices[0].message) == TWO_CALLS[:1]


def test_without_a_parser_or_with_none_the_text_is_content(live, scripted, monkeypatch, renders_tools):
    scripted(CALLS)
    r = live.client().chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER])  # no parser known
    assert r.choices[0].message.content == CALLS and r.choices[0].finish_reason == "stop"
    monkeypatch.setattr(live.app.state.server, "model_tool_parser", "hermes")
    r = live.client().chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none")
    assert r.choices[0].message.content == CALLS and r.choices[0].message.tool_calls is None


def streamed(live, **kw):
    """(per choice: content, [(id, name, arguments)], finish_reason), reassembled from the stream's deltas; each
    call's first delta carries its id, type and name, later ones only argument fragments."""
    out = {}
    for chunk in live.client().chat.completions.create(model=MODEL, messages=ASK, stream=True, **kw):
        for c in chunk.choices:
            content, calls, _ = out.setdefault(c.index, ["", {}, None])
            out[c.index][0] = content + (c.delta.content or "")
            for t in c.delta.tool_calls or ():
                if t.index not in calls:
                    assert t.id and t.type == "function" and t.function.name, t
                    calls[t.index] = [t.id, t.function.name, t.function.arguments or ""]
                else:
                    assert t.id is None and t.function.name is None, t
                    calls[t.index][2] += t.function.arguments
            if c.finish_reason:
                out[c.index][2] = c.finish_reason
    return [(content, [tuple(v) for _, v in sorted(calls.items())], reason) for _, (content, calls, reason)
            in sorted(out.items())]


@pytest.mark.parametrize("piece", [1, 4, 50])
def test_streamed_calls_reassemble_to_the_answer(live, scripted, hermes, piece):
    scripted(CALLS, "plain", piece=piece)
    (content, calls, reason), (plain, none, plain_reason) = streamed(live, tools=[WEATHER, TIME], n=2)
    assert content == "Let me check." and [(n, a) for _, n, a in calls] == TWO_CALLS and reason == "tool_calls"
    assert (plain, none, plain_reason) == ("plain", [], "stop")


def test_llama3_json_calls(live, scripted, monkeypatch, renders_tools):
    monkeypatch.setattr(live.app.state.server, "model_tool_parser", "llama3_json")  # --tool-call-parser llama3_json
    scripted('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}; '
             '{"name": "get_time", "parameters": {}}', piece=5)
    [(content, calls, reason)] = streamed(live, tools=[WEATHER, TIME])
    assert (content, [(n, a) for _, n, a in calls], reason) == ("", TWO_CALLS, "tool_calls")
    r = live.client().chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME])
    assert calls_of(r.choices[0].message) == TWO_CALLS and r.choices[0].message.content is None


def test_openai_stream_helper_assembles_the_calls(live, scripted, hermes):
    scripted(CALLS, piece=2)
    with live.client().chat.completions.stream(model=MODEL, messages=ASK, tools=[WEATHER, TIME]) as stream:
        final = stream.get_final_completion()
    assert calls_of(final.choices[0].message) == TWO_CALLS and final.choices[0].finish_reason == "tool_calls"


def test_required_is_constrained_to_an_array_of_calls(live, scripted):
    seen = scripted('[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
                    '{"name": "get_time", "parameters": {}}]')
    r = live.client().chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required")
    assert calls_of(r.choices[0].message) == [("get_weather", '{"city":"Paris"}'), ("get_time", "{}")]
    assert r.choices[0].message.content is None and r.choices[0].finish_reason == "tool_calls"
    schema = seen[-1].structured_outputs.json
    functions = [FunctionDefinition(**WEATHER["function"]), FunctionDefinition(**TIME["function"])]
    assert schema == required_schema(functions, parallel=True)
    assert schema["minItems"] == 1 and "maxItems" not in schema
    assert [i["properties"]["name"] for i in schema["items"]["anyOf"]] == [{"type": "string", "enum": ["get_weather"]},
                                                                          {"type": "string", "enum": ["get_time"]}]
    assert schema["items"]["anyOf"][0]["properties"]["parameters"] == WEATHER["function"]["parameters"]
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == NO_PARAMETERS

    streamed(live, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    one = seen[-1].structured_outputs.json
    assert one["maxItems"] == 1 and one["items"]["properties"]["name"]["enum"] == ["get_weather"]


def test_a_named_function_is_constrained_to_its_parameters(live, scripted):
    seen = scripted('{"city": "Paris"}')
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = live.client().chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=named)
    assert calls_of(r.choices[0].message) == [("get_weather", '{"city":"Paris"}')]
    assert r.choices[0].message.content is None and r.choices[0].finish_reason == "stop"  # as OpenAI and vLLM
    assert seen[-1].structured_outputs.json == WEATHER["function"]["parameters"]
    [(content, [(_, name, arguments)], reason)] = streamed(live, tools=[WEATHER, TIME], tool_choice=named)
    assert (content, name, arguments, reason) == ("", "get_weather", '{"city":"Paris"}', "stop")
    r = live.client().chat.completions.create(model=MODEL, messages=ASK, tools=[TIME],
                                              tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert seen[-1].structured_outputs.json == NO_PARAMETERS


def test_auto_and_none_leave_the_output_unconstrained(live, scripted, hermes):
    seen = scripted("hi")
    for choice in ("auto", "none"):
        live.client().chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice=choice)
        assert seen[-1].structured_outputs is None


# -- issue 39, 7 ------------------------------------------------------------------------------------------------------
def test_auto_on_a_template_that_drops_tools_is_a_400(live, monkeypatch):
    """The tiny model's template (as SmolLM2's) ignores `tools`: "auto" would silently drop them."""
    for kw in ({}, {"tool_choice": "auto"}):
        r = post_chat(live, tools=[TIME], **kw)
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text
        assert "chat template does not render `tools`" in r.json()["error"]["message"]
    for kw in ({"tool_choice": "none"}, {"tool_choice": "required"}):  # they need no template support
        assert post_chat(live, tools=[TIME], **kw).status_code == 200
    monkeypatch.setattr(live.prompt_tokenizer, "chat_template", QWEN_TEMPLATE)  # as --chat-template gives it
    assert post_chat(live, tools=[TIME], max_tokens=1).status_code == 200


def test_a_required_call_cut_off_leaves_no_content(live):
    """max_tokens cut the constrained output at its start ('['): that text is no answer to show as content."""
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=1)
    r = live.client().chat.completions.create(**kw)
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content is None, r
    chunks = list(live.client().chat.completions.create(stream=True, **kw))
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks


def test_streamed_chat_token_ids_are_where_vllm_puts_them(live):
    """prompt_token_ids on the first chunk's top level (as the non-streamed answer has them), token_ids per choice."""
    kw = dict(model=MODEL, messages=ASK, max_tokens=4, extra_body={"return_token_ids": True, "ignore_eos": True})
    answer = live.client().chat.completions.create(temperature=0, **kw).model_dump()
    chunks = [c.model_dump() for c in live.client().chat.completions.create(stream=True, temperature=0, **kw)]
    assert chunks[0]["prompt_token_ids"] == answer["prompt_token_ids"] and answer["prompt_token_ids"]
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert all("prompt_token_ids" not in choice for c in chunks for choice in c["choices"])
    assert [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids") or ()] == \
        answer["choices"][0]["token_ids"]


# -- issue 39, 8: the deprecated functions / function_call ----------------------------------------------------------
def test_legacy_functions_are_tools_answered_in_their_shape(live, scripted, hermes):
    seen = scripted('{"city": "Paris"}')
    legacy = dict(functions=[WEATHER["function"], TIME["function"]], function_call={"name": "get_weather"})
    r = live.client().chat.completions.create(model=MODEL, messages=ASK, **legacy)
    message = r.choices[0].message
    assert (message.function_call.name, message.function_call.arguments) == ("get_weather", '{"city":"Paris"}')
    assert message.tool_calls is None and seen[-1].structured_outputs.json == WEATHER["function"]["parameters"]
    scripted(CALLS)
    r = live.client().chat.completions.create(model=MODEL, messages=ASK, functions=legacy["functions"])
    assert r.choices[0].finish_reason == "function_call" and r.choices[0].message.function_call.name == "get_weather"
    name, arguments = None, ""
    for chunk in live.client().chat.completions.create(model=MODEL, messages=ASK, functions=legacy["functions"],
                                                       function_call="auto", stream=True):
        call = chunk.choices[0].delta.function_call if chunk.choices else None
        name, arguments = (name or (call.name if call else None)), arguments + (call.arguments or "" if call else "")
    assert (name, arguments) == TWO_CALLS[0]


def test_legacy_function_messages_render_as_tool_history(live, scripted, renders_tools):
    scripted("It is sunny.")
    history = ASK + [{"role": "assistant", "content": None,
                      "function_call": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                     {"role": "function", "name": "get_weather", "content": "18 C, sunny"}]
    body = protocol.ChatCompletionRequest.model_validate({"model": MODEL, "messages": history})
    assert body.messages[1].tool_calls[0].id == body.messages[2].tool_call_id == "call_legacy_1"
    r = live.client().chat.completions.create(model=MODEL, messages=history, functions=[WEATHER["function"]])
    assert r.choices[0].message.content == "It is sunny."


# -- issue 39: parameters with $defs / $ref (pydantic_function_tool, zod, MCP) --------------------------------------
class Address(BaseModel):
    street: str
    city: str


class Person(BaseModel):
    name: str
    home: Address
    friends: list["Person"] = []


TREE = {"type": "function", "function": {"name": "tree", "parameters": {
    "type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}, "required": ["kids"]}}}


def test_forced_calls_take_tools_with_defs_and_refs(live):
    """Was a 400 "Cannot find field '$defs'": the definitions stayed inside the wrapper the schema was put in."""
    person = openai.pydantic_function_tool(Person)
    for choice in ("required", {"type": "function", "function": {"name": "Person"}}):
        r = live.client().chat.completions.create(model=MODEL, messages=ASK, tools=[person, TREE], tool_choice=choice,
                                                  max_tokens=4)
        assert r.choices[0].finish_reason in ("length", "tool_calls", "stop"), r


def _accepts(schema: dict, text: str) -> bool:
    import xgrammar as xgr

    return xgr.testing._is_grammar_accept_string(xgr.Grammar.from_json_schema(json.dumps(schema)), text)


def test_hoisted_refs_point_where_they_pointed():
    """The enforced grammar accepts what each tool's own schema accepts, and "#" is the tool's parameters, not the
    array of calls around them."""
    functions = [FunctionDefinition(**openai.pydantic_function_tool(Person)["function"]),
                 FunctionDefinition(**TREE["function"])]
    schema = required_schema(functions, parallel=True)
    person = {"name": "Ann", "home": {"street": "Rue 1", "city": "Paris"},
              "friends": [{"name": "Bo", "home": {"street": "A", "city": "B"}, "friends": []}]}
    assert _accepts(schema, json.dumps([{"name": "Person", "parameters": person}]))
    assert not _accepts(schema, json.dumps([{"name": "Person", "parameters": {**person, "home": {"city": "x"}}}]))
    assert _accepts(schema, json.dumps([{"name": "tree", "parameters": {"kids": [{"kids": []}]}}]))
    wrapper_shaped = [{"name": "tree", "parameters": {"kids": [[{"name": "tree", "parameters": {"kids": []}}]]}}]
    assert not _accepts(schema, json.dumps(wrapper_shaped))
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == {"$ref": "#/$defs/tool1"}
    assert TREE["function"]["parameters"]["properties"]["kids"]["items"] == {"$ref": "#"}  # the request's untouched


# -- end to end: "required" and named choices on the real SmolLM2 GGUF, enforced by the engine's grammar ----------
def test_required_and_named_give_valid_calls_on_smollm2(smollm2_gguf, serve_app):
    import openai

    from nanoserve.server.app import build_app

    app = build_app(str(smollm2_gguf), served_model_name="smollm2", device="cpu", max_model_len=1024,
                    show_progress=False)
    server = serve_app(app)
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="k", max_retries=0, timeout=120)
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice, reason in (("required", "tool_calls"), (named, "stop")):
        kw = dict(model="smollm2", messages=ASK, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=64,
                  temperature=0)
        r = client.chat.completions.create(**kw)
        assert r.choices[0].finish_reason == reason and r.choices[0].message.tool_calls, r
        for call in r.choices[0].message.tool_calls:
            arguments = json.loads(call.function.arguments)
            assert call.function.name in ("get_weather", "get_time") and isinstance(arguments, dict)
            if call.function.name == "get_weather":  # valid against its parameters
                assert isinstance(arguments["city"], str) and set(arguments) <= {"city", "unit"}
                assert arguments.get("unit", "C") in ("C", "F")
            else:
                assert arguments == {}
        chunks = list(client.chat.completions.create(stream=True, **kw))
        arguments = "".join(t.function.arguments or "" for c in chunks if c.choices
                            for t in c.choices[0].delta.tool_calls or ())
        assert arguments == "".join(t.function.arguments for t in r.choices[0].message.tool_calls)
