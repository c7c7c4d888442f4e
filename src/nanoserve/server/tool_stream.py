"""The incremental scan every tool-call format shares (server/tool_parsers.py holds the formats): the deltas a
parser reports (content, calls opening, argument fragments), and the base ToolParser with its streaming JSON object
scanner. A call opens (index, id, name) once its name is complete and its arguments have begun; its arguments then
grow as the JSON text the model wrote, less the whitespace outside strings (compact, as OpenAI's arguments are).
"""
from __future__ import annotations

import abc
import json
import secrets
import string
from dataclasses import dataclass, field

NAME_KEY = "name"
ARGUMENT_KEYS = ("parameters", "arguments")  # "parameters": the key tool_choice "required" asks for (as vLLM)
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
WHITESPACE = " \t\r\n"
_ID_CHARS = string.ascii_letters + string.digits


def new_call_id() -> str:
    """OpenAI's form: call_ and 24 random letters and digits."""
    return "call_" + "".join(secrets.choice(_ID_CHARS) for _ in range(24))


@dataclass
class CallDelta:
    """What one call gained: its id and name on the delta that opens it, then argument text."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@dataclass
class ParsedDelta:
    """Content and call deltas, in the order the text produced them (consecutive deltas of a call merged)."""

    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def add_call(self, delta: CallDelta) -> None:
        last = self.calls[-1] if self.calls else None
        if last is not None and last.index == delta.index:
            last.arguments += delta.arguments
        else:
            self.calls.append(delta)

    def merge(self, other: ParsedDelta) -> ParsedDelta:
        self.content += other.content
        for c in other.calls:
            self.add_call(CallDelta(c.index, c.arguments, c.id, c.name))
        return self


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that could be the start of `tag` (text to hold back)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class _CallObject:
    """One JSON object {"name": ..., "arguments": {...}, ...} scanned a character at a time: where its name and
    its arguments' text are, and when it ends. It tracks strings and nesting only; values are checked by json."""

    def __init__(self):
        self.state = "start"  # start → key → colon → value → in_value → comma → key ... → done | error
        self.in_string = self.escape = False
        self.nest = 0  # depth inside the depth-1 value being read
        self.scalar = False
        self.key_chars: list[str] = []
        self.key: str | None = None
        self.capture: list[str] | None = None  # the value being read, when it is the name or the arguments
        self.name_raw: list[str] = []
        self.name: str | None = None
        self.args: list[str] | None = None  # the arguments' text, once it began with "{"
        self.args_done = self.bad = False  # bad: the name is no string, or the arguments no object

    @property
    def ended(self) -> bool:
        return self.state in ("done", "error")

    def push(self, ch: str) -> bool:
        """Take one character; True when something a parser acts on happened (name, arguments begun or ended,
        the object ended or broke)."""
        if self.in_string:
            return self._string_char(ch)
        if self.state == "in_value":
            return self._value_char(ch)
        if ch in WHITESPACE:
            return False
        state = self.state
        if state == "start" and ch == "{":
            self.state = "key"
        elif state == "key" and ch == '"':
            self.in_string, self.key_chars = True, []
        elif state in ("key", "comma") and ch == "}":
            self.state = "done"
        elif state == "colon" and ch == ":":
            self.state = "value"
        elif state == "comma" and ch == ",":
            self.state = "key"
        elif state == "value":
            return self._start_value(ch)
        else:
            self.state = "error"
        return self.ended

    def _start_value(self, ch: str) -> bool:
        self.state, self.nest, self.scalar, self.capture = "in_value", 0, False, None
        event = False
        if self.key == NAME_KEY and self.name is None and not self.name_raw:
            self.capture = self.name_raw
        elif self.key in ARGUMENT_KEYS and self.args is None:
            if ch != "{":
                self.bad = True
                return True
            self.args = self.capture = []
            event = True
        if self.capture is not None:
            self.capture.append(ch)
        if ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.nest = 1
        else:
            self.scalar = True
        return event

    def _value_char(self, ch: str) -> bool:
        if self.scalar:
            if ch in WHITESPACE or ch in ",}":
                self._end_value()
                self.state = {",": "key", "}": "done"}.get(ch, "comma")
                return True
        elif ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.nest += 1
        elif ch in "}]":
            self.nest -= 1
        if self.capture is not None and ch not in WHITESPACE:  # (outside strings: arguments come out compact)
            self.capture.append(ch)
        if not self.scalar and self.nest == 0:
            self._end_value()
            self.state = "comma"
            return True
        return False

    def _string_char(self, ch: str) -> bool:
        target = self.key_chars if self.state == "key" else self.capture
        if target is not None:
            target.append(ch)
        if self.escape:
            self.escape = False
        elif ch == "\\":
            self.escape = True
        elif ch == '"':
            self.in_string = False
            if self.state == "key":
                self.key_chars.pop()
                self.key = _json_string('"' + "".join(self.key_chars) + '"')
                self.state = "colon"
            elif self.nest == 0:
                self._end_value()
                self.state = "comma"
                return True
        return False

    def _end_value(self) -> None:
        if self.capture is self.name_raw:
            self.name = _json_string("".join(self.name_raw))
            self.bad = self.bad or self.name is None
        elif self.capture is not None:
            self.args_done = True
        self.capture = None


def _json_string(text: str) -> str | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, str) else None


class ToolParser(abc.ABC):
    """One completion's incremental parse. Subclasses scan self._buf (text fed, not yet decided) in _scan."""

    def __init__(self):
        self._buf = ""
        self._out = ParsedDelta()
        self.num_calls = 0
        self._obj: _CallObject | None = None
        self._open: int | None = None  # the index of the call being read, once it opened
        self._sent = 0  # argument characters of the open call already given out

    def feed(self, text: str) -> ParsedDelta:
        self._buf += text
        self._scan(final=False)
        return self._take()

    def finish(self) -> ParsedDelta:
        self._scan(final=True)
        return self._take()

    def parse(self, text: str) -> ParsedDelta:
        """A whole completion at once: exactly what feeding it in any pieces and finishing gives."""
        return self.feed(text).merge(self.finish())

    @abc.abstractmethod
    def _scan(self, final: bool) -> None:
        """Move what self._buf has decided into self._out (final: the completion has ended)."""

    def _take(self) -> ParsedDelta:
        out, self._out = self._out, ParsedDelta()
        return out

    def _content(self, text: str) -> None:
        self._out.content += text

    # -- one call object ----------------------------------------------------------------------------
    def _start_object(self) -> None:
        self._obj, self._open, self._sent = _CallObject(), None, 0

    def _push_object(self, text: str) -> int:
        """Give `text` to the call object until it ends, or breaks before its call opened; the characters taken
        (the character that broke it is not: it is the next parser state's to read)."""
        obj = self._obj
        for i, ch in enumerate(text):
            if obj.push(ch):
                self._update_call()
                if obj.ended or (obj.bad and self._open is None):
                    return i if obj.state == "error" else i + 1
        self._update_call()
        return len(text)

    def _update_call(self) -> None:
        obj = self._obj
        if self._open is None:
            if obj.bad or obj.name is None or (obj.args is None and obj.state != "done"):
                return
            self._open, self.num_calls = self.num_calls, self.num_calls + 1
            self._out.add_call(CallDelta(self._open, "" if obj.args is not None else "{}", new_call_id(), obj.name))
        if obj.args is not None and self._sent < len(obj.args):
            self._out.add_call(CallDelta(self._open, "".join(obj.args[self._sent:])))
            self._sent = len(obj.args)

    @property
    def _object_is_call(self) -> bool:
        return self._open is not None


__all__ = ["ToolParser", "ParsedDelta", "CallDelta", "new_call_id", "partial_suffix", "NAME_KEY", "ARGUMENT_KEYS",
           "HERMES_OPEN", "HERMES_CLOSE", "PYTHON_TAG", "WHITESPACE"]
