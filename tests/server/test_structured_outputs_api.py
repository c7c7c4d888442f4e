"""Structured outputs through the official `openai` client against a real server (its engine core in a process of
its own) over a tiny random model: response_format json_object / json_schema on chat and completions, vLLM's
structured_outputs (extra_body) regex / choice / grammar / json, streamed and not, n > 1; bad constraints are 400s
naming the problem. A random model writes whatever the grammar allows, so every output here is the grammar's doing."""
from __future__ import annotations

import json
import re

import openai
import pytest

MODEL = "tiny"
CHAT = [{"role": "user", "content": "Describe a pet."}]
# short whatever a random model picks: an enum, a bounded integer, a bool, a nullable enum
SCHEMA = {"type": "object", "properties": {
    "kind": {"type": "string", "enum": ["cat", "dog", "fish"]},
    "age": {"type": "integer", "minimum": 0, "maximum": 30},
    "indoor": {"type": "boolean"},
    "color": {"anyOf": [{"type": "string", "enum": ["red", "black"]}, {"type": "null"}]}},
    "required": ["kind", "age", "indoor", "color"], "additionalProperties": False}


def check_pet(text: str) -> None:
    pet = json.loads(text)
    assert set(pet) == {"kind", "age", "indoor", "color"}, text
    assert pet["kind"] in ("cat", "dog", "fish") and isinstance(pet["indoor"], bool), text
    assert isinstance(pet["age"], int) and not isinstance(pet["age"], bool) and 0 <= pet["age"] <= 30, text
    assert pet["color"] in ("red", "black", None), text


def json_schema_format(schema=SCHEMA) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "pet", "schema": schema, "strict": True}}


def test_chat_json_schema_n2_and_streamed(live):
    client = live.client()
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=200, n=2, temperature=1.0, seed=3,
                                       response_format=json_schema_format())
    assert len(r.choices) == 2
    for c in r.choices:
        assert c.finish_reason == "stop"
        check_pet(c.message.content)
    again = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=200, n=2, temperature=1.0, seed=3,
                                           response_format=json_schema_format())
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]  # seeds hold
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=200, n=2, temperature=1.0, seed=3,
                                            response_format=json_schema_format(), stream=True)
    texts, reasons = ["", ""], [None, None]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            reasons[c.index] = c.finish_reason or reasons[c.index]
    assert texts == [c.message.content for c in r.choices] and reasons == ["stop", "stop"]


def test_json_object_on_chat_and_completions(live):
    client = live.client()
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=120, temperature=0.0,
                                       response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":  # a random model may not close the object within max_tokens ...
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    assert r.choices[0].message.content.startswith("{")  # ... but it starts one, whatever it would have written
    r = client.completions.create(model=MODEL, prompt="A pet:", max_tokens=200, temperature=0.0,
                                  extra_body={"response_format": json_schema_format()})
    assert r.choices[0].finish_reason == "stop"
    check_pet(r.choices[0].text)


def test_extra_body_regex_choice_grammar(live):
    client = live.client()
    r = client.completions.create(model=MODEL, prompt="Call", max_tokens=30, n=3, temperature=1.0, seed=11,
                                  extra_body={"structured_outputs": {"regex": r"[0-9]{3}-[a-z]{2,4}"}})
    for c in r.choices:
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", c.text) and c.finish_reason == "stop", c.text
    choices = ["yes", "no", "maybe so"]
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, n=4, temperature=1.0,
                                       extra_body={"structured_outputs": {"choice": choices}})
    assert all(c.message.content in choices and c.finish_reason == "stop" for c in r.choices)
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=20, temperature=1.0, stream=True,
                                       extra_body={"structured_outputs": {"grammar": 'root ::= ("ab" | "cd")+ "!"'}})
    text = "".join(c.choices[0].delta.content or "" for c in r if c.choices)
    assert re.fullmatch(r"(ab|cd)+!", text), text


def test_structured_outputs_with_stop_strings(live):
    """A stop string still ends the text (the front end's), inside a constrained output."""
    r = live.client().completions.create(model=MODEL, prompt="x", max_tokens=30, temperature=0.0, stop=["b"],
                                         extra_body={"structured_outputs": {"regex": "a{3}b{3}c"}})
    assert r.choices[0].text == "aaa" and r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("extra, message, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}},
     'response_format.json_schema.schema: Unsupported type "wat"', "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "needs json_schema.schema", "response_format"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex: Regex parsing error", "structured_outputs"),
    ({"structured_outputs": {"grammar": "root ::= foo"}}, 'Rule "foo" is not defined', "structured_outputs"),
    ({"structured_outputs": {"json": "{not json"}}, "is not JSON", None),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one of", "structured_outputs"),
    ({"structured_outputs": {"regexp": "a"}}, "unknown fields ['regexp']", "structured_outputs"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "give one",
     "structured_outputs"),
])
def test_bad_constraints_are_400s_naming_the_problem(live, extra, message, param):
    with pytest.raises(openai.BadRequestError) as e:
        live.client().chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, extra_body=extra)
    assert message in e.value.body["message"]
    if param is not None:
        assert e.value.body["param"] == param
    live.wait_idle()  # nothing reached the core


def test_json_is_compact_by_default_and_whitespace_is_opt_in(live):
    """Issue 39, 6: a small model wrote whitespace between JSON tokens until max_tokens. By default the output is
    json.dumps' form (", " and ": ", one line) and ends well within max_tokens; disable_any_whitespace: false (vLLM's
    field) allows whitespace again, bounded at each place."""
    client = live.client()
    for kw in (dict(response_format=json_schema_format()), dict(response_format={"type": "json_object"})):
        for seed in range(3):
            r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=60, temperature=1.0, seed=seed,
                                               **kw)
            text = r.choices[0].message.content
            assert r.choices[0].finish_reason == "stop" and text == json.dumps(json.loads(text)), text
    loose = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0, extra_body={
        "structured_outputs": {"json": SCHEMA, "disable_any_whitespace": False}})
    assert loose.choices[0].message.content.startswith("{")
    with pytest.raises(openai.BadRequestError, match="disable_any_whitespace"):
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, extra_body={
            "structured_outputs": {"json": SCHEMA, "disable_any_whitespace": "no"}})
