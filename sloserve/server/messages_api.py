"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) over the chat
path: a request becomes a ``ChatCompletionRequest`` (system, text / ``tool_use`` /
``tool_result`` blocks, tools, ``tool_choice`` ``auto`` / ``any`` / ``tool`` / ``none``,
``stop_sequences``), runs as a chat completion (template, tool plan, prefix caching, priorities,
queue limits, disconnect aborts), and answers in Anthropic's shapes: content blocks, ``stop_reason``
``end_turn`` / ``max_tokens`` / ``stop_sequence`` / ``tool_use``, the streamed events
(``message_start``, ``content_block_start`` / ``_delta`` (``text_delta``, ``input_json_delta``,
``thinking_delta``) / ``_stop``, ``message_delta``, ``message_stop``) and errors as
``{"type": "error", "error": {"type", "message"}}``.

Refused with a 400: image and document blocks, ``n``-like fields do not exist here.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from sloserve.error_shapes import anthropic_error
from sloserve.sampling_params import ParamError
from sloserve.server.protocol import ChatCompletionRequest, Int
from sloserve.server.tools import ChoiceOutput, ToolPlan



class MessagesRequest(BaseModel):
    """``POST /v1/messages`` body (fields Anthropic's API takes; unknown ones ignored)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: Int
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)  # Anthropic's range
    top_p: float | None = None
    top_k: Int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None  # accepted, ignored
    priority: Int | None = 0  # vLLM's extension, as on the chat route
    cache_salt: str | None = None  # vLLM's extension, as on the chat route


class CountTokensRequest(BaseModel):
    """``POST /v1/messages/count_tokens`` body."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None


def _text(content: Any, where: str) -> str:
    """A system prompt or tool result as text: a string, or text blocks joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for b in content:
            if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
                raise ParamError(f"{where}: only text blocks are served here, got "
                                 f"{b.get('type') if isinstance(b, dict) else type(b).__name__!r}",
                                 "messages")
            out.append(b["text"])
        return "\n".join(out)
    raise ParamError(f"{where}: content must be a string or a list of blocks", "messages")


def _messages(system: Any, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Anthropic messages as OpenAI chat messages (tool_use -> tool_calls, tool_result -> a
    ``tool`` message).

    Raises:
        ParamError: a role other than user / assistant, an unknown or unserved block type, a
            tool_use without id / name or with a non-object input.
    """
    out: list[dict[str, Any]] = []
    sys_text = _text(system, "system")
    if sys_text:
        out.append({"role": "system", "content": sys_text})
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant"):
            raise ParamError(f"messages[{i}].role must be user or assistant, got {role!r}",
                             "messages")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise ParamError(f"messages[{i}].content must be a string or a list of blocks",
                             "messages")
        texts, calls, results = [], [], []
        for j, b in enumerate(content):
            kind = b.get("type") if isinstance(b, dict) else None
            where = f"messages[{i}].content[{j}]"
            if kind == "text":
                if not isinstance(b.get("text"), str):
                    raise ParamError(f"{where}: a text block needs a string text", "messages")
                texts.append(b["text"])
            elif kind == "tool_use" and role == "assistant":
                if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str) \
                        or not isinstance(b.get("input"), dict):
                    raise ParamError(f"{where}: a tool_use block needs id, name and an object "
                                     f"input", "messages")
                calls.append({"id": b["id"], "type": "function", "function": {
                    "name": b["name"], "arguments": json.dumps(b["input"])}})
            elif kind == "tool_result" and role == "user":
                if not isinstance(b.get("tool_use_id"), str):
                    raise ParamError(f"{where}: a tool_result block needs tool_use_id",
                                     "messages")
                results.append({"role": "tool", "tool_call_id": b["tool_use_id"],
                                "content": _text(b.get("content"), where)})
            elif kind == "thinking":  # an earlier turn's reasoning: not shown to the model again
                continue
            else:
                raise ParamError(f"{where}: block type {kind!r} is not served here (text, "
                                 f"tool_use in assistant turns, tool_result in user turns)",
                                 "messages")
        out += results
        if texts or calls or not results:
            msg: dict[str, Any] = {"role": role, "content": "\n".join(texts) or None}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    return out


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ParamError("tools must be a list", "tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise ParamError(f"tools[{i}] needs a name", "tools")
        if t.get("type") not in (None, "custom"):  # web_search_..., bash_..., text_editor_...
            raise ParamError(f"tools[{i}]: tool type {t['type']!r} is not served here (Anthropic "
                             f"runs its server tools itself; custom tools with an input_schema "
                             f"are served)", "tools")
        if not isinstance(t.get("input_schema"), dict):
            raise ParamError(f"tools[{i}] ({t['name']}) needs an input_schema object", "tools")
        out.append({"type": "function", "function": {
            "name": t["name"], "description": t.get("description", ""),
            "parameters": t["input_schema"]}})
    return out


def _tool_choice(tc: Any) -> tuple[Any, bool | None]:
    """(OpenAI tool_choice, parallel_tool_calls) of Anthropic's ``tool_choice``."""
    if tc is None:
        return None, None
    kind = tc.get("type") if isinstance(tc, dict) else None
    parallel = False if isinstance(tc, dict) and tc.get("disable_parallel_tool_use") else None
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", None
    if kind == "tool":
        return {"type": "function", "function": {"name": tc.get("name")}}, parallel
    raise ParamError(f'tool_choice.type must be auto, any, tool or none, got {kind!r}',
                     "tool_choice")


def to_chat_request(req: MessagesRequest | CountTokensRequest) -> ChatCompletionRequest:
    """The chat request a Messages request runs as.

    Raises:
        ParamError: see :func:`_messages`; a bad tool or tool_choice.
    """
    choice, parallel = _tool_choice(req.tool_choice)
    fields: dict[str, Any] = dict(model=req.model, messages=_messages(req.system, req.messages),
                                  tools=_tools(req.tools), tool_choice=choice,
                                  parallel_tool_calls=parallel)
    if isinstance(req, MessagesRequest):
        fields.update(max_tokens=req.max_tokens, stop=req.stop_sequences,
                      temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                      stream=req.stream, priority=req.priority, cache_salt=req.cache_salt)
    return ChatCompletionRequest(**fields)


# ----------------------------------------------------------------------------------- answers
def _sse(event: str, data: dict[str, Any]) -> str:
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=True)}\n\n"


def stop_reason(finish: str | None, stop: str | None, called: bool) -> str:
    if called and finish == "stop":
        return "tool_use"
    if finish == "length":
        return "max_tokens"
    return "stop_sequence" if stop is not None else "end_turn"


def _usage(st) -> dict[str, int]:
    f = st.final
    return {"input_tokens": f.num_prompt_tokens if f else 0,
            "output_tokens": f.num_output_tokens if f else 0,
            "cache_read_input_tokens": f.num_cached_tokens if f else 0}


@dataclass
class MessagesBuilder:
    """Anthropic's shapes for one request (a single choice), whole or streamed."""

    id: str
    model: str
    plan: ToolPlan
    reasoning_parser: str | None = None
    #: streaming: the open block (index, kind, tool index) and the next block's index
    _open: tuple[int, str, int] | None = field(default=None, init=False)
    _next: int = field(default=0, init=False)

    def _output(self) -> ChoiceOutput:
        return ChoiceOutput(self.plan, self.reasoning_parser)

    def response(self, states) -> BaseModel | dict:
        st = states[0]
        reasoning, content, calls = self._output().whole("".join(st.text))
        blocks: list[dict[str, Any]] = []
        if reasoning:
            blocks.append({"type": "thinking", "thinking": reasoning, "signature": ""})
        if content:
            blocks.append({"type": "text", "text": content})
        for c in calls:
            blocks.append({"type": "tool_use", "id": c.id, "name": c.name,
                           "input": json.loads(c.arguments)})
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": blocks, "stop_reason": stop_reason(
                    st.final.finish_reason, st.final.stop_reason, bool(calls)),
                "stop_sequence": st.final.stop_reason, "usage": _usage(st)}

    # streamed
    def preamble(self, st) -> list[str]:
        return [_sse("message_start", {"type": "message_start", "message": {
            "id": self.id, "type": "message", "role": "assistant", "model": self.model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": st.prompt_token_ids and len(st.prompt_token_ids) or 0,
                      "output_tokens": 0}}})]

    def _block(self, kind: str, tool: int = -1, start: dict | None = None) -> list[str]:
        """Events that make ``kind`` (and tool call ``tool``) the open block."""
        if self._open is not None and self._open[1:] == (kind, tool):
            return []
        ev = self._close()
        self._open = (self._next, kind, tool)
        self._next += 1
        ev.append(_sse("content_block_start", {"type": "content_block_start",
                                               "index": self._open[0], "content_block": start}))
        return ev

    def _close(self) -> list[str]:
        if self._open is None:
            return []
        i, self._open = self._open[0], None
        return [_sse("content_block_stop", {"type": "content_block_stop", "index": i})]

    def _delta(self, delta: dict[str, Any]) -> str:
        return _sse("content_block_delta", {"type": "content_block_delta",
                                            "index": self._open[0], "delta": delta})

    def chunk(self, st, out, first: bool) -> str | None:
        if st.parsed is None:
            st.parsed = self._output()
        reasoning, content, calls = st.parsed.feed(out.new_text, last=out.finished)
        ev: list[str] = []
        if reasoning:
            ev += self._block("thinking", start={"type": "thinking", "thinking": ""})
            ev.append(self._delta({"type": "thinking_delta", "thinking": reasoning}))
        if content:
            ev += self._block("text", start={"type": "text", "text": ""})
            ev.append(self._delta({"type": "text_delta", "text": content}))
        for d in calls:
            if d.id is not None:
                ev += self._block("tool_use", d.index, {"type": "tool_use", "id": d.id,
                                                        "name": d.name, "input": {}})
            if d.arguments:
                ev += self._block("tool_use", d.index)
                ev.append(self._delta({"type": "input_json_delta", "partial_json": d.arguments}))
        if out.finished:
            ev += self._close()
            ev.append(_sse("message_delta", {
                "type": "message_delta",
                "delta": {"stop_reason": stop_reason(out.finish_reason, out.stop_reason,
                                                     st.parsed.called),
                          "stop_sequence": out.stop_reason},
                "usage": {"output_tokens": out.num_output_tokens}}))
            ev.append(_sse("message_stop", {"type": "message_stop"}))
        return "".join(ev) or None

    def usage_chunk(self, usage) -> str:  # the usage went out with message_delta
        return ""

    def done(self) -> str:
        return ""

    def error_event(self, err) -> str:
        """A failure mid-stream (an ``errors.APIError``): Anthropic's error event."""
        return _sse("error", anthropic_error(err.status, err.message))
