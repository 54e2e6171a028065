"""Tool calling and reasoning on ``/v1/chat/completions``, as vLLM serves them.

The serve flags (:class:`ChatConfig`): ``--enable-auto-tool-choice`` with ``--tool-call-parser``
(``sloserve.server.tool_parsers``), ``--reasoning-parser``
(``sloserve.server.reasoning_parsers``), ``--chat-template FILE`` (a template that renders
``tools`` and ``tool`` messages; ``sloserve/templates/hermes_chatml.jinja`` is one for ChatML
models such as the embedded SmolLM2, whose own template ignores tools).

One request's plan (:func:`plan_tools`): ``tool_choice``
- ``none``: the tools go to the template, the output is text;
- ``auto`` (the default where tools are given, as in vLLM; it needs the two flags): the tool
  parser reads the output, calls out and the rest as content;
- ``required`` and ``{"type": "function", "function": {"name": ...}}``: forced by the structured
  output machinery, so the output always parses and matches each function's ``parameters``
  schema: a named function's output is its arguments object; ``required`` outputs a JSON array
  of ``{"name", "parameters"}`` objects (one, where ``parallel_tool_calls`` is false).

Each choice's output goes through :class:`ChoiceOutput`: reasoning first, then the calls.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from sloserve.sampling_params import ParamError, StructuredOutputsParams
from sloserve.server.reasoning_parsers import ReasoningStreamer, get_reasoning_parser
from sloserve.server.tool_parsers import (ToolCall, ToolCallDelta, ToolParser, ToolStreamer,
                                          Llama3Streamer, Llama3JsonToolParser,
                                          get_tool_parser, new_tool_call_id)


@dataclass(frozen=True)
class ChatConfig:
    """The chat endpoint's serve flags (vLLM's names)."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    #: the template text (``--chat-template FILE`` read at start), None: the model's own
    chat_template: str | None = None
    #: ``--chat-template-content-format``: ``auto`` / ``string`` (text parts joined into one
    #: string) or ``openai`` (a list of text parts)
    chat_template_content_format: str = "auto"

    def validate(self) -> None:
        """Raises ValueError (one line: the flag and the value) for unknown parser names and
        ``--enable-auto-tool-choice`` without ``--tool-call-parser``."""
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (one of "
                             "hermes, llama3_json)")
        if self.tool_call_parser:
            get_tool_parser(self.tool_call_parser)
        if self.reasoning_parser:
            get_reasoning_parser(self.reasoning_parser)
        if self.chat_template_content_format not in ("auto", "string", "openai"):
            raise ValueError(f"--chat-template-content-format must be one of auto, string, "
                             f"openai, got {self.chat_template_content_format!r}")


@dataclass
class ToolPlan:
    """What one request does with its tools."""

    mode: str = "none"  # none, auto, required, named
    tools: list[dict[str, Any]] | None = None  # for the template
    name: str | None = None  # the named function
    structured: StructuredOutputsParams | None = None  # forced modes' constraint
    parser: ToolParser | None = None  # auto's


def _functions(tools: Any) -> dict[str, dict[str, Any]]:
    """name -> function of ``tools`` (OpenAI's shape), checked."""
    if not isinstance(tools, list) or not tools:
        raise ParamError("tools must be a non-empty list", "tools")
    out: dict[str, dict[str, Any]] = {}
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise ParamError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": "
                             f"{{...}}}}", "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise ParamError(f"tools[{i}].function.name must be a non-empty string", "tools")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ParamError(f"tools[{i}].function.parameters must be a JSON schema object",
                             "tools")
        if name in out:
            raise ParamError(f"two tools are named {name!r}", "tools")
        out[name] = {**fn, "parameters": params}
    return out


def plan_tools(body, cfg: ChatConfig) -> ToolPlan:
    """The plan of a ``ChatCompletionRequest``.

    Raises:
        ParamError: malformed ``tools``; ``tool_choice`` without tools, unknown, naming no
            given tool, or ``auto`` on a server without ``--enable-auto-tool-choice``; a
            forced choice with ``response_format`` / ``structured_outputs``.
    """
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise ParamError("tool_choice needs tools", "tool_choice")
        return ToolPlan()
    fns = _functions(body.tools)
    tools = [{"type": "function", "function": f} for f in fns.values()]
    if choice is None:
        choice = "auto"
    if choice == "none":
        return ToolPlan("none", tools)
    if choice == "auto":
        if not (cfg.enable_auto_tool_choice and cfg.tool_call_parser):
            raise ParamError('"auto" tool choice needs the server started with '
                             '--enable-auto-tool-choice and --tool-call-parser', "tool_choice")
        return ToolPlan("auto", tools, parser=get_tool_parser(cfg.tool_call_parser))
    if body.structured_spec() is not None:
        raise ParamError("a required or named tool_choice is a constraint on the output: give "
                         "it without response_format / structured_outputs", "tool_choice")
    if choice == "required":
        items, defs = [], {}
        for i, (n, f) in enumerate(fns.items()):
            params = f["parameters"]
            if _has_ref(params):  # its "#..." refs must still resolve inside the wrapper
                defs[f"tool{i}"] = _rebased(params, f"#/$defs/tool{i}")
                params = {"$ref": f"#/$defs/tool{i}"}
            items.append({"type": "object", "properties": {"name": {"type": "string", "const": n},
                                                           "parameters": params},
                          "required": ["name", "parameters"], "additionalProperties": False})
        schema: dict[str, Any] = {"type": "array", "minItems": 1,
                                  "items": items[0] if len(items) == 1 else {"anyOf": items}}
        if defs:
            schema["$defs"] = defs
        if body.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return ToolPlan("required", tools, structured=_forced(schema))
    if isinstance(choice, dict) and choice.get("type") == "function":
        fn = choice.get("function")
        if not isinstance(fn, dict):
            raise ParamError(f'tool_choice.function must be {{"name": ...}}, got {fn!r}',
                             "tool_choice")
        name = fn.get("name")
        if name not in fns:
            raise ParamError(f"tool_choice names function {name!r}, which is not in tools "
                             f"({', '.join(fns)})", "tool_choice")
        return ToolPlan("named", tools, name=name, structured=_forced(fns[name]["parameters"]))
    raise ParamError(f'tool_choice must be "none", "auto", "required" or {{"type": '
                     f'"function", "function": {{"name": ...}}}}, got {choice!r}', "tool_choice")


def _forced(schema: dict[str, Any]) -> StructuredOutputsParams:
    """The structured-output spec forcing ``schema``; its refusals name ``tools`` (the field
    the client sent)."""
    try:
        return StructuredOutputsParams(json=json.dumps(schema))
    except ParamError as e:
        why = str(e).replace("structured_outputs spec", "the forced tool call schema")
        raise ParamError(f"tools: {why}", "tools") from None


def _has_ref(schema: Any) -> bool:
    if isinstance(schema, dict):
        return isinstance(schema.get("$ref"), str) or any(map(_has_ref, schema.values()))
    return isinstance(schema, list) and any(map(_has_ref, schema))


def _rebased(schema: Any, root: str) -> Any:
    """``schema`` with its local references (``#``, ``#/$defs/X``, ``#/properties/...``)
    pointing under ``root``, where the wrapper keeps it."""
    if isinstance(schema, dict):
        out = {k: _rebased(v, root) for k, v in schema.items()}
        ref = schema.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            out["$ref"] = root + ref[1:]
        return out
    if isinstance(schema, list):
        return [_rebased(v, root) for v in schema]
    return schema


def check_tool_messages(messages: list[dict[str, Any]]) -> None:
    """Every ``tool`` message answers a call of an assistant message before it.

    Raises:
        ParamError: a tool message without ``tool_call_id``, or with one that matches no call.
    """
    ids: set[str] = set()
    for i, m in enumerate(messages):
        for c in m.get("tool_calls") or ():
            if c.get("id"):
                ids.add(c["id"])
        if m.get("role") == "tool":
            cid = m.get("tool_call_id")
            if not cid:
                raise ParamError(f"messages[{i}]: a tool message needs tool_call_id", "messages")
            if cid not in ids:
                raise ParamError(f"messages[{i}]: tool_call_id {cid!r} matches no tool call "
                                 f"of an earlier assistant message", "messages")


class _RequiredStreamer(Llama3Streamer):
    """``required``'s output, a JSON array of ``{"name", "parameters"}`` objects, streamed
    as calls (the objects as llama3_json's, the brackets and commas between them skipped)."""

    def __init__(self):
        super().__init__(Llama3JsonToolParser())
        self.mode = "calls"


class _NamedStreamer(ToolStreamer):
    """A named function's output is its arguments: the id and name with the first text, then
    the text as arguments."""

    def __init__(self, name: str):
        self.name, self.id = name, None
        self.calls = 1

    def feed(self, delta: str) -> tuple[str, list[ToolCallDelta]]:
        out = []
        if self.id is None:
            self.id = new_tool_call_id()
            out.append(ToolCallDelta(0, id=self.id, name=self.name))
        if delta:
            out.append(ToolCallDelta(0, arguments=delta))
        return "", out

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        return ("", []) if self.id is not None else self.feed("")


@dataclass
class ChoiceOutput:
    """One choice's text through the reasoning parser, then the tool plan."""

    plan: ToolPlan
    reasoning_parser: str | None = None
    _reasoning: ReasoningStreamer | None = field(default=None, init=False)
    _tools: ToolStreamer | None = field(default=None, init=False)
    #: a call went out (finish_reason becomes "tool_calls")
    called: bool = field(default=False, init=False)

    def __post_init__(self):
        if self.reasoning_parser:
            self._reasoning = get_reasoning_parser(self.reasoning_parser).streamer()
        p = self.plan
        if p.mode == "auto":
            self._tools = p.parser.streamer()
        elif p.mode == "required":
            self._tools = _RequiredStreamer()
        elif p.mode == "named":
            self._tools = _NamedStreamer(p.name)

    def feed(self, delta: str, last: bool = False) -> tuple[str, str, list[ToolCallDelta]]:
        """(reasoning, content, call deltas) of the next text ``delta``; ``last``: the
        output ends with it."""
        r, c = ("", delta) if self._reasoning is None else self._reasoning.feed(delta)
        if last and self._reasoning is not None:
            r2, c2 = self._reasoning.finish()
            r, c = r + r2, c + c2
        if self._tools is None:
            return r, c, []
        content, deltas = self._tools.feed(c)
        if last:
            c2, d2 = self._tools.finish()
            content, deltas = content + c2, deltas + d2
        self.called = self.called or bool(deltas)
        return r, content, deltas

    def whole(self, text: str) -> tuple[str | None, str | None, list[ToolCall]]:
        """(reasoning, content, calls) of a whole output; a call cut short (``max_tokens``
        ended the output inside its arguments) is left out (streamed, its pieces went out
        before the end: ``finish_reason`` ``length`` says so), and a forced output (required,
        named) has no content, whole or cut short: the same on every API."""
        r, c, deltas = self.feed(text, last=True)
        if self.plan.mode in ("required", "named"):
            c = None  # a forced output is calls only; cut short, its held-back start is not text
        calls: dict[int, ToolCall] = {}
        for d in deltas:
            if d.id is not None:
                calls[d.index] = ToolCall(d.name, d.arguments, id=d.id)
            else:
                calls[d.index].arguments += d.arguments
        return r or None, c or None, [calls[i] for i in sorted(calls)
                                      if _is_json(calls[i].arguments)]


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def reasoning_parser_for(cfg: ChatConfig, body) -> str | None:
    """The reasoning parser a chat request's output goes through (after ``plan_tools``): none
    where a grammar forces the output to be JSON (a required or named tool call,
    ``response_format`` or ``structured_outputs`` json), which admits no reasoning section
    (deepseek_r1's parser would read all of it as reasoning: no ``</think>`` ever comes). A
    regex, choice or grammar may spell one out, and keeps the parser."""
    if not cfg.reasoning_parser:
        return None
    spec = body.structured_spec()
    if spec is not None and (spec.json is not None or spec.json_object):
        return None
    return cfg.reasoning_parser


def finish_reason(reason: str | None, called: bool) -> str | None:
    """``tool_calls`` where a call went out and the output ended by itself (vLLM's)."""
    return "tool_calls" if called and reason == "stop" else reason
