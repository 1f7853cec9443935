"""Tool calls read from an answer's text as it grows, so a stream can send each call's name as soon
as it is written and then its arguments as they come (as vLLM's and OpenAI's streams do), not the
whole calls at the end. The tools grammar (gateway/tools.py) writes calls in one layout, compact
JSON with the name first: `<tool_call>{"name":NAME,"arguments":ARGS}</tool_call>`, one after
another. Text off that layout stops the reading (`broken`); what was read stays read."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from cde.gateway.tool_format import CALL_CLOSE, CALL_OPEN

_HEAD = CALL_OPEN + '{"name":'
_ARGS = ',"arguments":'
_TAIL = "}" + CALL_CLOSE


@dataclass
class CallPart:
    """What one read added to a call: its id and name (when the name was just completed) and the
    next piece of its arguments' text."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@dataclass
class ReadCall:
    id: str
    name: str
    arguments: str = ""  # as written, so far


@dataclass
class CallReader:
    """An answer's calls as its text grows (`feed`): `calls` read so far, `complete` once the text
    is whole calls and nothing else, `calls_whole` once no call read lacks part of its arguments."""

    text: str = ""
    calls: list[ReadCall] = field(default_factory=list)
    broken: bool = False
    _pos: int = 0  # text before it is read
    _stage: str = "head"  # head, name, sep (before the arguments), args, tail
    _depth: int = 0  # in the arguments: open brackets, inside a string, after a backslash
    _in_string: bool = False
    _escaped: bool = False

    @property
    def complete(self) -> bool:
        """Every call begun is closed and nothing follows: an answer made of calls."""
        return self.calls_whole and self._stage == "head" and self._pos == len(self.text)

    @property
    def calls_whole(self) -> bool:
        """Every call read has its whole arguments; what follows them (if anything) is the layout,
        up to a next call's name not yet closed, so not yet a call: where a stop string may cut."""
        return not self.broken and bool(self.calls) and self._stage in ("head", "name", "tail")

    def feed(self, text: str) -> list[CallPart]:
        """Appends `text`; returns what it completed: new calls (id, name) and arguments' text."""
        self.text += text
        parts: list[CallPart] = []
        read = {
            "head": self._read_head,
            "name": self._read_name,
            "sep": self._read_sep,
            "args": self._read_args,
            "tail": self._read_tail,
        }
        while not self.broken and self._pos < len(self.text):
            before = (self._pos, self._stage)
            read[self._stage](parts)
            if (self._pos, self._stage) == before:  # waits for more text
                break
        return parts

    def _expect(self, literal: str, stage: str) -> None:
        rest = self.text[self._pos : self._pos + len(literal)]
        if not literal.startswith(rest):
            self.broken = True
        elif rest == literal:
            self._pos += len(literal)
            self._stage = stage

    def _read_head(self, parts: list[CallPart]) -> None:
        self._expect(_HEAD, "name")

    def _read_name(self, parts: list[CallPart]) -> None:
        """A call begins once its name's string is closed: a call cut by max_tokens right after it
        is a call with no arguments yet, never text holding the call's layout."""
        end = _string_end(self.text, self._pos)
        if end is None:
            self.broken = not self.text.startswith('"', self._pos)
            return
        try:
            name = json.loads(self.text[self._pos : end])
        except ValueError:
            self.broken = True
            return
        call = ReadCall(f"call_{uuid.uuid4().hex[:24]}", name)
        self.calls.append(call)
        parts.append(CallPart(len(self.calls) - 1, id=call.id, name=name))
        self._pos, self._stage = end, "sep"

    def _read_sep(self, parts: list[CallPart]) -> None:
        self._expect(_ARGS, "args")

    def _read_args(self, parts: list[CallPart]) -> None:
        """A JSON object or array, read up to where it is written: its text goes out as it comes
        (its end is its last closing bracket outside a string)."""
        start, call = self._pos, self.calls[-1]
        if not call.arguments and self.text[start] not in "{[":
            self.broken = True  # the tools' parameters are objects
            return
        pos = start
        while pos < len(self.text):
            c = self.text[pos]
            pos += 1
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._stage = "tail"
                    break
        piece = self.text[start:pos]
        call.arguments += piece
        parts.append(CallPart(len(self.calls) - 1, arguments=piece))
        self._pos = pos

    def _read_tail(self, parts: list[CallPart]) -> None:
        self._expect(_TAIL, "head")


def _string_end(text: str, start: int) -> int | None:
    """The index after the JSON string that starts at `start`, None while it is not closed."""
    if not text.startswith('"', start):
        return None
    pos, escaped = start + 1, False
    while pos < len(text):
        c = text[pos]
        if escaped:
            escaped = False
        elif c == "\\":
            escaped = True
        elif c == '"':
            return pos + 1
        pos += 1
    return None
