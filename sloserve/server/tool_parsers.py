"""Tool-call parsers: a model's text -> OpenAI tool calls, whole or streamed (vLLM's
``--tool-call-parser`` names: ``hermes``, ``llama3_json``).

- ``hermes`` (Hermes 2 Pro, Qwen2.5, the template shipped for the embedded model): each call is
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; text outside the tags is content.
- ``llama3_json`` (Llama 3.1/3.2's JSON tool calling): the whole output, after an optional
  ``<|python_tag|>``, is one or more ``{"name": ..., "parameters": {...}}`` objects separated by
  ``;``; an output that does not start so is content.

Streaming (:meth:`ToolParser.streamer`): content goes out as soon as no tag can start in it; a
call's id and name go out once, as soon as its name is read, then its arguments in pieces as they
are generated (the object's text as the model wrote it, up to its closing brace), so that the
``openai`` client's reassembled arguments are the call's JSON text. A call whose text never
parses (the model stopped mid-call) is kept as content where nothing of it went out as a call.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field


@dataclass
class ToolCall:
    """One whole call: ``arguments`` is JSON text (an object)."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: new_tool_call_id())


@dataclass
class ToolCallDelta:
    """A piece of the call at ``index``: its id and name (once, first), then arguments text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class Extracted:
    """A whole output read by a parser: the content left (None where there is none) and the
    calls."""

    content: str | None
    tool_calls: list[ToolCall]


def new_tool_call_id() -> str:
    """An id for a tool call (vLLM's form: ``chatcmpl-tool-`` and 32 hex digits)."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _arguments_text(value) -> str:
    """A call's arguments as JSON text: an object dumped, a string that is JSON kept."""
    if isinstance(value, str):
        try:
            json.loads(value)
            return value
        except ValueError:
            return json.dumps(value)
    return json.dumps({} if value is None else value, ensure_ascii=False)


def _parse_call(text: str, arg_keys: tuple[str, ...]) -> ToolCall | None:
    """The call in JSON ``text`` (see :func:`_call_of`), or None where it is not one."""
    try:
        return _call_of(json.loads(text), arg_keys)
    except ValueError:
        return None


def _call_of(obj, arg_keys: tuple[str, ...]) -> ToolCall | None:
    """A call from a parsed object with a string ``name`` (its arguments under one of
    ``arg_keys``), else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in arg_keys if k in obj), {})
    return ToolCall(obj["name"], _arguments_text(args))


# ---------------------------------------------------------------- one call's object, streamed
_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(\w+)"\s*:\s*')


class _CallStream:
    """The text of one call object as it arrives: the name once it is read, then the arguments
    value's text as it grows, up to where that value closes (a brace-depth scan that skips
    strings). An object whose arguments are not an object literal, or come first, is sent
    whole at its end."""

    def __init__(self, index: int, arg_keys: tuple[str, ...]):
        self.index, self.arg_keys = index, arg_keys
        self.text = ""
        self.id: str | None = None  # set once the name went out
        self.args_start = -1  # where the arguments value starts in text, once known
        self.sent = 0  # characters of the arguments value sent
        self.streaming = False  # the value is an object literal being streamed
        self.depth, self.in_str, self.esc, self.closed = 0, False, False, False

    def feed(self, piece: str) -> list[ToolCallDelta]:
        self.text += piece
        out = []
        if self.id is None:
            m = _NAME.match(self.text)
            if m is None or m.group(2) not in self.arg_keys or m.end() >= len(self.text):
                return out
            self.id = new_tool_call_id()
            out.append(ToolCallDelta(self.index, id=self.id, name=json.loads(f'"{m.group(1)}"')))
            self.args_start = m.end()
            self.streaming = self.text[m.end()] == "{"
        if self.streaming and not self.closed:
            start = self.args_start + self.sent
            end = self._scan(start)
            if end > start:
                out.append(ToolCallDelta(self.index, arguments=self.text[start:end]))
                self.sent += end - start
        return out

    def _scan(self, start: int) -> int:
        """Where the arguments value's text may be sent to: scans from ``start``."""
        t = self.text
        for i in range(start, len(t)):
            c = t[i]
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif c == "\\":
                    self.esc = True
                elif c == '"':
                    self.in_str = False
            elif c == '"':
                self.in_str = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.closed = True
                    return i + 1
        return len(t)

    def finish(self, call: ToolCall | None) -> list[ToolCallDelta]:
        """The rest of the call, ``call`` being its parse (None: it did not parse)."""
        if call is None:
            return []
        if self.id is None:  # nothing went out yet: the call whole
            self.id = call.id
            return [ToolCallDelta(self.index, id=call.id, name=call.name, arguments=call.arguments)]
        if self.streaming:
            rest = call.arguments if not self.sent else ""
            return [ToolCallDelta(self.index, arguments=rest)] if rest else []
        return [ToolCallDelta(self.index, arguments=call.arguments)]


def partial_tag(buf: str, tag: str) -> int:
    """The length of the longest end of ``buf`` that begins ``tag`` (held back: a tag may be
    arriving)."""
    for n in range(min(len(tag) - 1, len(buf)), 0, -1):
        if tag.startswith(buf[-n:]):
            return n
    return 0


# ---------------------------------------------------------------------------------- parsers
class ToolStreamer:
    """One choice's streamed output: :meth:`feed` each text delta, then :meth:`finish`; each
    returns (content delta, tool call deltas). ``calls`` counts the calls begun."""

    calls: int = 0

    def feed(self, delta: str) -> tuple[str, list[ToolCallDelta]]:
        raise NotImplementedError

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        raise NotImplementedError


class ToolParser:
    """A ``--tool-call-parser``: :meth:`extract` reads a whole output, :meth:`streamer` one
    streamed choice."""

    name = ""

    def extract(self, text: str) -> Extracted:
        raise NotImplementedError

    def streamer(self) -> ToolStreamer:
        raise NotImplementedError


class HermesToolParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number, between text."""

    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    ARG_KEYS = ("arguments", "parameters")
    _CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def extract(self, text: str) -> Extracted:
        if self.START not in text:
            return Extracted(text, [])
        calls, kept, pos = [], [], 0
        for m in self._CALL.finditer(text):
            call = _parse_call(m.group(1), self.ARG_KEYS)
            if call is None:  # not a call: left in the content as written
                continue
            kept.append(text[pos:m.start()])
            pos = m.end()
            calls.append(call)
        kept.append(text[pos:])
        content = "".join(kept)
        return Extracted(content if content.strip() else None, calls)

    def streamer(self) -> ToolStreamer:
        return _HermesStreamer(self)


class _HermesStreamer(ToolStreamer):
    def __init__(self, parser: HermesToolParser):
        self.p = parser
        self.buf = ""  # text not yet sent: content held back, or the call being read
        self.call: _CallStream | None = None
        self.calls = 0

    def feed(self, delta: str) -> tuple[str, list[ToolCallDelta]]:
        self.buf += delta
        content, deltas = [], []
        while True:
            if self.call is None:
                i = self.buf.find(self.p.START)
                if i < 0:
                    keep = partial_tag(self.buf, self.p.START)
                    content.append(self.buf[:len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep:]
                    break
                content.append(self.buf[:i])
                self.buf = self.buf[i + len(self.p.START):]
                self.call = _CallStream(self.calls, self.p.ARG_KEYS)
                self.calls += 1
                continue
            j = self.buf.find(self.p.END)
            if j < 0:  # the call grows: feed what cannot be part of the end tag
                keep = partial_tag(self.buf, self.p.END)
                deltas += self.call.feed(self.buf[:len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
                break
            deltas += self.call.feed(self.buf[:j])
            deltas += self._end_call(content, self.p.END)
            self.buf = self.buf[j + len(self.p.END):]
        return "".join(content), deltas

    def _end_call(self, content: list[str], end: str = "") -> list[ToolCallDelta]:
        cs, self.call = self.call, None
        call = _parse_call(cs.text, self.p.ARG_KEYS)
        if call is None and cs.id is None:  # never a call: its text is content
            self.calls -= 1
            content.append(self.p.START + cs.text + end)
            return []
        return cs.finish(call)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        content: list[str] = []
        if self.call is None:
            content.append(self.buf)
            self.buf = ""
            return "".join(content), []
        deltas = self.call.feed(self.buf)
        self.buf = ""
        deltas += self._end_call(content)
        return "".join(content), deltas


class Llama3JsonToolParser(ToolParser):
    """An output that is, after an optional ``<|python_tag|>``, ``{"name": ..., "parameters":
    {...}}`` objects separated by ``;``."""

    name = "llama3_json"
    TAG = "<|python_tag|>"
    ARG_KEYS = ("parameters", "arguments")

    def _objects(self, text: str) -> list[ToolCall] | None:
        s = text.strip()
        if s.startswith(self.TAG):
            s = s[len(self.TAG):].lstrip()
        dec, calls, i = json.JSONDecoder(), [], 0
        while i < len(s):
            try:
                obj, i = dec.raw_decode(s, i)
            except ValueError:
                return None
            call = _call_of(obj, self.ARG_KEYS)
            if call is None:
                return None
            calls.append(call)
            while i < len(s) and (s[i].isspace() or s[i] == ";"):
                i += 1
        return calls or None

    def extract(self, text: str) -> Extracted:
        calls = self._objects(text)
        return Extracted(None, calls) if calls else Extracted(text, [])

    def streamer(self) -> ToolStreamer:
        return Llama3Streamer(self)


class Llama3Streamer(ToolStreamer):
    def __init__(self, parser: Llama3JsonToolParser):
        self.p = parser
        self.text = ""
        self.mode: str | None = None  # "content" or "calls", once the start decides
        self.sent_content = 0
        self.call: _CallStream | None = None
        self.call_from = 0  # where the current call's text starts in self.text
        self.calls = 0
        self.went_out = False  # a call's id went out (else, at the end, it all is content)
        self.failed = False  # an object that is not a call: the rest is not read

    def _decide(self) -> None:
        s = self.text.lstrip()
        if not s:
            return
        if s[0] == "{" or s.startswith(self.p.TAG):
            self.mode = "calls"
        elif not self.p.TAG.startswith(s):
            self.mode = "content"

    def feed(self, delta: str) -> tuple[str, list[ToolCallDelta]]:
        self.text += delta
        if self.mode is None:
            self._decide()
        if self.mode == "content":
            out = self.text[self.sent_content:]
            self.sent_content = len(self.text)
            return out, []
        if self.mode != "calls" or self.failed:
            return "", []
        deltas = self._calls()
        self.went_out = self.went_out or any(d.id for d in deltas)
        return "", deltas

    def _calls(self) -> list[ToolCallDelta]:
        deltas = []
        while not self.failed:
            if self.call is None:
                rest = self.text[self.call_from:]
                i = rest.find("{")
                if i < 0:
                    return deltas
                self.call_from += i
                self.call = _CallStream(self.calls, self.p.ARG_KEYS)
                self.calls += 1
            fed = len(self.call.text)
            deltas += self.call.feed(self.text[self.call_from + fed:])
            end = self._object_end(self.call.text)
            if end < 0:
                return deltas
            cs, self.call = self.call, None
            call = _parse_call(cs.text[:end], self.p.ARG_KEYS)
            self.failed = call is None
            deltas += cs.finish(call)
            self.call_from += end
        return deltas

    @staticmethod
    def _object_end(t: str) -> int:
        """The end of the first whole JSON object in ``t`` (which starts with it), or -1."""
        try:
            _, end = json.JSONDecoder().raw_decode(t)
            return end
        except ValueError:
            return -1

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        deltas = []
        if self.mode == "calls" and self.call is not None:  # stopped inside an object
            cs, self.call = self.call, None
            call = _parse_call(cs.text, self.p.ARG_KEYS)
            deltas = cs.finish(call)
            self.went_out = self.went_out or any(d.id for d in deltas)
        if self.mode != "calls" or not self.went_out:  # no call: the text is content
            out = self.text[self.sent_content:]
            self.sent_content = len(self.text)
            return out, []
        return "", deltas


TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesToolParser,
                                                                  Llama3JsonToolParser)}


def named(registry: dict, name: str, flag: str):
    """A new instance of ``registry[name]``.

    Raises:
        ValueError: an unknown name (the message names ``flag`` and lists the known ones).
    """
    if name not in registry:
        raise ValueError(f"{flag} must be one of {', '.join(registry)}, got {name!r}")
    return registry[name]()


def get_tool_parser(name: str) -> ToolParser:
    """The parser named ``name`` (ValueError for an unknown one)."""
    return named(TOOL_PARSERS, name, "--tool-call-parser")
