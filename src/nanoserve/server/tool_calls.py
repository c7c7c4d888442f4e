"""What a chat request's tools do, and the tool calls of its answer (streamed or not), as vLLM and OpenAI give them.

tool_choice (OpenAI's default: "auto" with tools, "none" without):
- "none": the template still gets the tools (vLLM's default), the output is plain content.
- "auto": the output is read by the server's tool-call parser (--tool-call-parser; "auto": the one the chat
  template's format calls for, server/tool_parsers.py); with none known it is plain content. Calls found →
  message.tool_calls, finish_reason "tool_calls".
- "required": the output is constrained (structured outputs) to a JSON array of {"name": <a tool>, "parameters":
  <its schema>}, at least one, at most one without parallel_tool_calls (vLLM's shape); finish_reason "tool_calls".
- a named function: the output is constrained to its parameters' schema and is its arguments; finish_reason stays
  "stop", as OpenAI and vLLM answer a forced call.
parallel_tool_calls false keeps the first call only (vLLM's behaviour). A call cut off by max_tokens keeps the
arguments it got and the finish_reason "length"; a forced output never becomes content, even cut off before a call.
"auto" on a model whose chat template does not render `tools` is a 400 (the model would never see them; vLLM
refuses "auto" it cannot serve too), unless the request brings its own template; `renders_tools` is the probe.
"""
from __future__ import annotations

import json
from functools import partial

from nanoserve.sampling import StructuredOutputsParams
from nanoserve.server.protocol import ChatCompletionRequest
from nanoserve.server.tool_parsers import (TOOL_PARSERS, CallDelta, NamedParser, ParsedDelta, RequiredParser,
                                           ToolParser, detect_tool_parser)

NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}  # a function without parameters


def auto_parser_name(setting: str, chat_template) -> str | None:
    """The parser for tool_choice "auto": --tool-call-parser's, or with "auto" the one the template calls for."""
    if setting == "auto":
        return detect_tool_parser(chat_template)
    return None if setting == "none" else setting


_PROBE_TOOL = {"type": "function", "function": {"name": "nanoserve_probe_tool", "description": "probe",
                                                "parameters": {"type": "object", "properties": {}}}}


def renders_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template shows `tools` to the model (its rendering changes when given one);
    True when it cannot tell (no template, a render error: the chat request itself then says what is wrong)."""
    if not getattr(tokenizer, "chat_template", None):
        return True
    messages = [{"role": "user", "content": "Hi"}]
    try:
        with_tool = tokenizer.apply_chat_template(messages, tools=[_PROBE_TOOL], tokenize=False,
                                                  add_generation_prompt=True)
        without = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception:  # noqa: BLE001 (templates raise anything)
        return True
    return with_tool != without


def required_schema(functions: list, parallel: bool) -> dict:
    """The JSON schema of tool_choice "required": [{"name": <one of the functions>, "parameters": <its schema>}]. A
    parameters schema with definitions or local references ($defs / $ref, as pydantic, zod and MCP servers write
    them) moves into the root's $defs (its own definitions beside it), so its references still point where they
    pointed; a plain one stays inline."""
    defs: dict = {}
    items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [f.name]},
                                               "parameters": _placed(f.parameters or NO_PARAMETERS, f"tool{i}", defs)},
              "required": ["name", "parameters"], "additionalProperties": False} for i, f in enumerate(functions)]
    schema = {"type": "array", "items": items[0] if len(items) == 1 else {"anyOf": items}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


_DEF_KEYS = ("$defs", "definitions")
_LITERAL_KEYS = frozenset({"enum", "const", "default", "examples"})  # values, not schemas: no $ref to rewrite


def _placed(parameters: dict, name: str, defs: dict) -> dict:
    """`parameters` as it goes inside the wrapper: itself, or a $ref to its copy in `defs` (under `name`, its own
    definitions under name.$defs.X) with every local $ref rewritten to the new place."""
    if not any(k in parameters for k in _DEF_KEYS) and not _has_local_ref(parameters):
        return parameters
    base = f"#/$defs/{name}"
    moved = {k: v for k, v in parameters.items() if k not in _DEF_KEYS}
    defs[name] = _rewrite_refs(moved, base)
    for key in _DEF_KEYS:
        for sub, schema in (parameters.get(key) or {}).items():
            defs[f"{name}.{key}.{sub}"] = _rewrite_refs(schema, base)
    return {"$ref": base}


def _walk(node):
    """Every dict in a schema (iteratively: no recursion limit to reach), literals skipped."""
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            yield item
            stack.extend(v for k, v in item.items() if k not in _LITERAL_KEYS)
        elif isinstance(item, list):
            stack.extend(item)


def _has_local_ref(schema: dict) -> bool:
    return any(isinstance(d.get("$ref"), str) and d["$ref"].startswith("#") for d in _walk(schema))


def _rewrite_refs(schema, base: str):
    """A copy of `schema` whose local refs point into its hoisted place: "#" → base, "#/$defs/X…" →
    base.$defs.X…, any other "#/path" → base/path."""
    copy = json.loads(json.dumps(schema))
    for d in _walk(copy):
        ref = d.get("$ref")
        if not (isinstance(ref, str) and ref.startswith("#")):
            continue
        path = ref[1:].lstrip("/")
        key, _, rest = path.partition("/")
        if key in _DEF_KEYS and rest:
            d["$ref"] = f"{base}.{key}.{rest}"
        else:
            d["$ref"] = f"{base}/{path}" if path else base
    return copy


class ToolCalling:
    """One chat request's tool choice: its output constraint, and a parser for each of its choices."""

    def __init__(self, body: ChatCompletionRequest, auto_parser: str | None):
        self.mode, self.parallel = body.chosen_mode, body.parallel_tool_calls
        self.legacy = getattr(body, "functions", None) is not None  # answered as `function_call`, not `tool_calls`
        functions = [t.function for t in body.tools or ()]
        self.structured_outputs = None
        self._parser = None
        if self.mode == "required":
            self.structured_outputs = StructuredOutputsParams(json=required_schema(functions, self.parallel))
            self._parser = RequiredParser
        elif self.mode == "named":
            name = body.tool_choice.function.name
            chosen = next(f for f in functions if f.name == name)
            self.structured_outputs = StructuredOutputsParams(json=chosen.parameters or NO_PARAMETERS)
            self._parser = partial(NamedParser, name)
        elif self.mode == "auto" and auto_parser is not None:
            self._parser = TOOL_PARSERS[auto_parser]

    @property
    def parses(self) -> bool:
        return self._parser is not None

    @property
    def forced(self) -> bool:
        """The output is the constraint's text (a call's JSON), never content: a call cut off before it opened (by
        max_tokens, at '[') leaves no content behind."""
        return self.mode in ("required", "named")

    def new_parser(self) -> ToolParser:
        return self._parser()

    def finish_reason(self, called: bool, reason: str | None) -> str | None:
        if called and reason == "stop" and self.mode in ("auto", "required"):
            return "function_call" if self.legacy else "tool_calls"
        return reason

    def kept(self, calls: list[CallDelta]) -> list[CallDelta]:
        return calls if self.parallel else [c for c in calls if c.index == 0]

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """A non-streamed choice's message and finish_reason."""
        if not self.parses:
            return {"role": "assistant", "content": text}, finish_reason
        parsed = self.new_parser().parse(text)
        calls = self.kept(parsed.calls)
        content = None if self.forced else parsed.content
        if not calls:
            return {"role": "assistant", "content": content}, finish_reason
        message = {"role": "assistant", "content": content or None, "tool_calls": _tool_calls(calls)}
        if self.legacy:
            message["function_call"] = message.pop("tool_calls")[0]["function"]
        return message, self.finish_reason(True, finish_reason)

    def stream(self) -> ToolStream:
        return ToolStream(self)


class ToolStream:
    """One streamed choice: its text in, OpenAI chunk deltas out (a call's id, type and name once, then arguments)."""

    def __init__(self, calling: ToolCalling):
        self.calling, self.parser, self.called = calling, calling.new_parser(), False

    def delta(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        parsed = self.parser.feed(text)
        if finish_reason is not None:
            parsed.merge(self.parser.finish())
        return self._delta(parsed), self.calling.finish_reason(self.called, finish_reason)

    def _delta(self, parsed: ParsedDelta) -> dict:
        delta: dict = {"content": parsed.content} if parsed.content and not self.calling.forced else {}
        calls = self.calling.kept(parsed.calls)
        if calls:
            self.called = True
            delta["tool_calls"] = [_tool_call(c) if c.id is not None else
                                   {"index": c.index, "function": {"arguments": c.arguments}} for c in calls]
            if self.calling.legacy:  # one call, its name on the first delta
                delta["function_call"] = delta.pop("tool_calls")[0]["function"]
        return delta


def _tool_call(c: CallDelta) -> dict:
    return {"index": c.index, "id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}


def _tool_calls(calls: list[CallDelta]) -> list[dict]:
    """A message's tool_calls (no index: that is for stream deltas)."""
    return [{k: v for k, v in _tool_call(c).items() if k != "index"} for c in calls]


__all__ = ["ToolCalling", "ToolStream", "auto_parser_name", "renders_tools", "required_schema"]
