"""Tool-call parsers: a chat completion's text → OpenAI tool calls, by one incremental scan.

A parser takes the text as it grows (`feed`) and once more at its end (`finish`), and says which part is
content and which are calls. A call opens (index, id, name) once its name is complete and its arguments have
begun; its arguments then grow as the JSON text the model wrote, less the whitespace outside strings (compact, as
OpenAI's arguments are). A non-streamed answer is the same scan fed at once, so the argument fragments of a
stream concatenate to the non-streamed `arguments`, whatever the split. Text that turns out to be no call (broken
JSON, no name, arguments that are not an object) is content: nothing is lost. A call cut off after it opened
(max_tokens) keeps the arguments it got, streamed or not.

- hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, what Qwen2.5/Qwen3 and Hermes templates ask
  for; several calls; text around them is content (whitespace next to a call is dropped).
- llama3_json: Llama 3.1's JSON form `{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`,
  several joined by ";" — only when the output starts with one (otherwise it is all content).
- RequiredParser: what tool_choice "required" constrains the output to, a JSON array of {"name", "parameters"}.
- NamedParser: tool_choice naming one function: the whole output is its arguments.
Either key, "arguments" or "parameters", is accepted in every JSON form.
"""
from __future__ import annotations

from nanoserve.server.tool_stream import (HERMES_CLOSE, HERMES_OPEN, PYTHON_TAG, WHITESPACE, CallDelta,  # noqa: F401
                                          ParsedDelta, ToolParser, new_call_id, partial_suffix)


class HermesParser(ToolParser):
    """<tool_call>{...}</tool_call> blocks among text."""

    def __init__(self):
        super().__init__()
        self._state = "text"  # text | block (the call object) | tail (after it, before </tool_call>)
        self._ws = ""  # trailing whitespace of the content, held until text follows (dropped next to a call)
        self._block = ""  # the block's text so far (content if it is no call), with the whitespace before it

    def _scan(self, final: bool) -> None:
        while self._buf or final:
            if not {"text": self._scan_text, "block": self._scan_block, "tail": self._scan_tail}[self._state](final):
                break
        if final:
            self._end(self._state == "block" and not self._object_is_call)

    def _end(self, unfinished_block: bool) -> None:
        if unfinished_block:  # a block that never became a call: what it held is content
            self._content(self._block)
        elif not self.num_calls:
            self._content(self._ws)
        self._ws = self._block = ""

    def _scan_text(self, final: bool) -> bool:
        buf = self._buf
        at = buf.find(HERMES_OPEN)
        if at < 0:
            keep = 0 if final else partial_suffix(buf, HERMES_OPEN)
            self._text(buf[:len(buf) - keep])
            self._buf = buf[len(buf) - keep:]
            return False
        self._text(buf[:at])
        self._block, self._ws = self._ws + HERMES_OPEN, ""
        self._buf = buf[at + len(HERMES_OPEN):]
        self._state = "block"
        self._start_object()
        return True

    def _text(self, text: str) -> None:
        text = self._ws + text
        kept = text.rstrip(WHITESPACE)
        self._ws = text[len(kept):]
        self._content(kept)

    def _scan_block(self, final: bool) -> bool:
        taken = self._push_object(self._buf)
        self._block += self._buf[:taken]
        self._buf = self._buf[taken:]
        obj = self._obj
        if not (obj.ended or obj.bad):
            return False  # needs more text
        if self._object_is_call:
            self._state, self._block = "tail", ""
        else:  # no call: the block so far is content, and the text after it is read as text again
            self._content(self._block)
            self._state, self._block = "text", ""
        return True

    def _scan_tail(self, final: bool) -> bool:
        """After a call's object: whitespace (and stray braces) up to </tool_call> belong to the call."""
        buf = self._buf.lstrip(WHITESPACE + "}")
        if buf.startswith(HERMES_CLOSE):
            self._buf, self._state = buf[len(HERMES_CLOSE):], "text"
            return True
        if not buf or (not final and HERMES_CLOSE.startswith(buf)):
            self._buf = buf
            return False
        self._buf, self._state = buf, "text"  # no closing tag: what follows is content
        return True


class _JsonCallsParser(ToolParser):
    """Call objects one after another: an optional or required opening, a separator, an optional closing.
    Output that does not start as such is content; whatever breaks the sequence, and all after it, is content."""

    openings: tuple[str, ...] = ()  # one of these may come first (`opening_required`: must)
    opening_required = False
    separator = ""
    closing = ""

    def __init__(self):
        super().__init__()
        self._state = "start"  # start | object | between | next (after a separator) | closed | content
        self._held = ""  # text that is content unless the call being read opens

    def _scan(self, final: bool) -> None:
        while self._buf and self._state != "content":
            step = getattr(self, "_scan_" + self._state)
            if not step(final):
                break
        if self._state == "content":
            self._content(self._held + self._buf)
            self._held = self._buf = ""
        elif final:
            self._end()

    def _end(self) -> None:
        unfinished = self._state == "start" or (self._state == "object" and not self._object_is_call)
        if unfinished or (self._state == "next" and not self.num_calls):
            self._content(self._held + self._buf)  # (a separator after the last call is dropped)
        self._held = self._buf = ""

    def _scan_start(self, final: bool) -> bool:
        buf = self._buf.lstrip(WHITESPACE)
        for opening in self.openings:
            if buf.startswith(opening):
                return self._begin(opening)
            if not final and opening.startswith(buf):
                return False
        if buf.startswith("{") and not self.opening_required:
            return self._begin("")
        if not buf and not final:
            return False
        self._state = "content"
        return True

    def _begin(self, opening: str) -> bool:
        at = self._buf.index(opening[:1] or "{") + len(opening)
        self._held, self._buf = self._buf[:at], self._buf[at:]
        self._state = "next"
        return True

    def _scan_next(self, final: bool) -> bool:
        buf = self._buf.lstrip(WHITESPACE)
        self._held += self._buf[:len(self._buf) - len(buf)]
        self._buf = buf
        if not buf:
            return False
        if buf[0] != "{":
            self._state = "content"
            return True
        self._state = "object"
        self._start_object()
        return True

    def _scan_object(self, final: bool) -> bool:
        taken = self._push_object(self._buf)
        text, self._buf = self._buf[:taken], self._buf[taken:]
        obj = self._obj
        if self._object_is_call:
            self._held = ""
        else:
            self._held += text
        if not (obj.ended or obj.bad):
            return False
        # no call: it and the rest are content; a call, even one whose object broke after it opened, is followed
        # by a separator, the closing or content
        self._state = "between" if self._object_is_call else "content"
        return True

    def _scan_between(self, final: bool) -> bool:
        buf = self._buf.lstrip(WHITESPACE)
        if not buf:
            self._buf = ""
            return False
        if buf[0] == self.separator:
            self._buf, self._held, self._state = buf[1:], buf[0], "next"
        elif self.closing and buf[0] == self.closing:
            self._buf, self._state = buf[1:], "closed"
        else:
            self._buf, self._state = buf, "content"
        return True

    def _scan_closed(self, final: bool) -> bool:
        buf = self._buf.lstrip(WHITESPACE)
        self._buf = buf
        if buf:
            self._state = "content"
        return bool(buf)


class Llama3JsonParser(_JsonCallsParser):
    openings = (PYTHON_TAG,)
    separator = ";"


class RequiredParser(_JsonCallsParser):
    """The output of tool_choice "required": [{"name": ..., "parameters": {...}}, ...]."""

    openings = ("[",)
    opening_required = True
    separator = ","
    closing = "]"


class NamedParser(ToolParser):
    """tool_choice naming a function: the output is that function's arguments (compacted as a call's are)."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name
        self._in_string = self._escape = False

    def _scan(self, final: bool) -> None:
        if self._open is None:
            self._open, self.num_calls = 0, 1
            self._out.add_call(CallDelta(0, "", new_call_id(), self.name))
        if self._buf:
            self._out.add_call(CallDelta(0, self._compact(self._buf)))
            self._buf = ""

    def _compact(self, text: str) -> str:
        kept = []
        for ch in text:
            if self._in_string:
                self._escape, self._in_string = (False, True) if self._escape else (ch == "\\", ch != '"')
            elif ch in WHITESPACE:
                continue
            else:
                self._in_string = ch == '"'
            kept.append(ch)
        return "".join(kept)


TOOL_PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}


def detect_tool_parser(chat_template) -> str | None:
    """The parser a chat template's own tool-call format needs, or None when it shows none this module knows.
    Hermes-style templates write `<tool_call>` (but Qwen3-Coder's XML form, `<function=...>`, is another format);
    Llama 3.1's mention `<|python_tag|>` or ask for {"name": ..., "parameters": ...}."""
    if isinstance(chat_template, dict):  # named templates: all of them (transformers picks "tool_use" for tools)
        chat_template = "\n".join(t for t in chat_template.values() if isinstance(t, str))
    if not isinstance(chat_template, str):
        return None
    if HERMES_OPEN in chat_template and "<function=" not in chat_template:
        return "hermes"
    if PYTHON_TAG in chat_template or '"parameters": dictionary' in chat_template:
        return "llama3_json"
    return None


__all__ = ["ToolParser", "HermesParser", "Llama3JsonParser", "RequiredParser", "NamedParser", "ParsedDelta",
           "CallDelta", "TOOL_PARSERS", "detect_tool_parser", "new_call_id"]
