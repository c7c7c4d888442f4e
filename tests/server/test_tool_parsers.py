"""Tool-call parsers (server/tool_parsers.py): what each format's output parses into, and that a stream fed in any
pieces gives out fragments that reassemble to exactly the non-streamed answer."""
from __future__ import annotations

import json
from functools import partial

import pytest

from nanoserve.server.tool_parsers import (TOOL_PARSERS, HermesParser, Llama3JsonParser, NamedParser, ParsedDelta,
                                           RequiredParser, detect_tool_parser)


def parsed(parser, text):
    r = parser.parse(text)
    return r.content, [(c.name, c.arguments) for c in r.calls]


HERMES_CASES = [
    ("Hello, world!\n", "Hello, world!\n", []),  # no call: the text exactly, whitespace and all
    ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "Let me check.", [("get_weather", '{"city":"Paris"}')]),
    ('<tool_call>\n{"name": "a", "arguments": {"x": [1, {"y": "}\\"<tool_call>"}]}}\n</tool_call>\n'
     '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>\n', "",
     [("a", '{"x":[1,{"y":"}\\"<tool_call>"}]}'), ("b", "{}")]),
    ('<tool_call>{"arguments": {"x": 1}, "name": "a", "id": null}</tool_call>', "", [("a", '{"x":1}')]),
    ('<tool_call>{"name": "now"}</tool_call>', "", [("now", "{}")]),  # no arguments: an empty object
    ('<tool_call>{"name": "a", "arguments": {"x": 1}</tool_call>Done', "Done", [("a", '{"x":1}')]),  # brace missing
    # no calls: the text is content, exactly
    ("<tool_call>\nnot json\n</tool_call> after", "<tool_call>\nnot json\n</tool_call> after", []),
    ('<tool_call>{"name": "a", "arguments": "x=1"}</tool_call>', '<tool_call>{"name": "a", "arguments": "x=1"}'
     "</tool_call>", []),
    ('<tool_call>{"name": 5, "arguments": {}}</tool_call>', '<tool_call>{"name": 5, "arguments": {}}</tool_call>', []),
    ('<tool_call>{"nam', '<tool_call>{"nam', []),  # cut off before it became a call
    ("a <tool_c", "a <tool_c", []),
    # cut off after it became one (max_tokens): the arguments it got, as a stream sends them
    ('<tool_call>{"name": "a", "arguments": {"x": 1', "", [("a", '{"x":1')]),
]


@pytest.mark.parametrize("text,content,calls", HERMES_CASES)
def test_hermes(text, content, calls):
    assert parsed(HermesParser(), text) == (content, calls)


LLAMA3_CASES = [
    ('{"name": "f", "parameters": {"a": 1}}', "", [("f", '{"a":1}')]),
    ('<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "arguments": {}}', "",
     [("f", '{"a":1}'), ("g", "{}")]),
    ('{"name": "f", "parameters": {"a": true}};', "", [("f", '{"a":true}')]),
    ('{"name": "f", "parameters": {"a": 1}} and more', "and more", [("f", '{"a":1}')]),
    ('Sure: {"name": "f", "parameters": {}}', 'Sure: {"name": "f", "parameters": {}}', []),  # not at the start
    ('{"answer": 42}', '{"answer": 42}', []),
    ("  <|python", "  <|python", []),
]


@pytest.mark.parametrize("text,content,calls", LLAMA3_CASES)
def test_llama3_json(text, content, calls):
    assert parsed(Llama3JsonParser(), text) == (content, calls)


@pytest.mark.parametrize("text,content,calls", [
    ('[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {}}]', "", [("f", '{"a":1}'), ("g", "{}")]),
    ('\n[ {"name": "f", "parameters": {"a": [1, 2]}} ]\n', "", [("f", '{"a":[1,2]}')]),
    ("[]", "[]", []),
    ('{"name": "f", "parameters": {}}', '{"name": "f", "parameters": {}}', []),
    ('[{"name": "f", "parameters": 3}]', '[{"name": "f", "parameters": 3}]', []),
])
def test_required_array(text, content, calls):
    assert parsed(RequiredParser(), text) == (content, calls)


def test_named_output_is_the_arguments():
    assert parsed(NamedParser("f"), ' {"a": 1,\n "s": "x \\" y"}') == ("", [("f", '{"a":1,"s":"x \\" y"}')])
    assert parsed(NamedParser("f"), "") == ("", [("f", "")])


SAMPLES = [  # (parser, text) with content, several calls, nesting, escapes, multi-byte text
    (HermesParser, 'I will look both up.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", '
                   '"q": "a \\"quoted\\" } brace", "days": [1, 2]}}\n</tool_call>\n<tool_call>\n{"name": "get_time",'
                   ' "arguments": {}}\n</tool_call>'),
    (HermesParser, 'x <tool_call>{"name": "a", "arguments": {"k": 1}}</tool_call> then <tool_call>bad</tool_call> y'),
    (Llama3JsonParser, '<|python_tag|>{"name": "f", "parameters": {"a": {"b": "c;d"}}}; {"name": "g", '
                       '"parameters": {"n": -1.5e3}}'),
    (RequiredParser, '[{"name": "f", "parameters": {"s": "[{,}]"}}, {"name": "g", "parameters": {"t": null}}]'),
    (partial(NamedParser, "f"), ' {\n  "s": "a \\" b",\n  "n": [1, 2]\n}'),
]


def _streamed(parser, pieces) -> ParsedDelta:
    """Fragments as a stream gives them out, each delta checked for OpenAI's order (id and name first, once)."""
    total, opened = ParsedDelta(), set()
    for delta in [parser.feed(p) for p in pieces] + [parser.finish()]:
        for c in delta.calls:
            assert (c.id is not None) == (c.index not in opened) == (c.name is not None)
            opened.add(c.index)
        total.merge(delta)
    return total


def _shape(result: ParsedDelta):
    return result.content, [(c.index, c.name, c.arguments) for c in result.calls]


@pytest.mark.parametrize("parser_class,text", SAMPLES)
def test_any_split_reassembles_to_the_non_streamed_answer(parser_class, text):
    whole = _shape(parser_class().parse(text))
    assert whole[1], "each sample holds calls"
    for cut in range(len(text) + 1):
        assert _shape(_streamed(parser_class(), [text[:cut], text[cut:]])) == whole, cut
    assert _shape(_streamed(parser_class(), list(text))) == whole
    for _, _, arguments in whole[1]:
        json.loads(arguments)


def test_arguments_stream_as_they_grow_and_content_waits_only_for_a_possible_tag():
    p = HermesParser()
    assert p.feed("Hi <tool").content == "Hi"  # the space and "<tool" may belong to a call
    first = p.feed('_call>{"name": "f", "arguments": {"city": "Pa')
    assert first.content == "" and [(c.index, c.name, c.arguments) for c in first.calls] == [(0, "f", '{"city":"Pa')]
    assert first.calls[0].id.startswith("call_") and len(first.calls[0].id) == 29
    more = p.feed('ris"}}</tool_call>')
    assert [(c.index, c.id, c.name, c.arguments) for c in more.calls] == [(0, None, None, 'ris"}')]


def test_call_ids_are_unique():
    r = HermesParser().parse('<tool_call>{"name": "a"}</tool_call>' * 3)
    assert len({c.id for c in r.calls}) == 3


@pytest.mark.parametrize("template,name", [
    ("{% for tool in tools %}{{ tool | tojson }}{% endfor %}<tool_call>\n{\"name\": ...}\n</tool_call>", "hermes"),
    ("{{- '<|python_tag|>' }}{{- 'Respond in the format {\"name\": function name, \"parameters\": dictionary of "
     "argument name and its value}.' }}", "llama3_json"),
    ("<tool_call>\n<function=name>\n<parameter=x>", None),  # Qwen3-Coder's XML calls: another format
    ("{% for m in messages %}{{ m.content }}{% endfor %}", None),
    ({"default": "plain", "tool_use": "<tool_call>"}, "hermes"),
    (None, None),
])
def test_parser_detected_from_the_chat_template(template, name):
    assert detect_tool_parser(template) == name


def test_parser_names_are_the_cli_choices():
    from nanoserve.config import TOOL_CALL_PARSERS
    assert tuple(TOOL_PARSERS) == TOOL_CALL_PARSERS
