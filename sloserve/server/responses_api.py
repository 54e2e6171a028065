"""OpenAI's Responses API (``POST /v1/responses``, ``GET /v1/responses/{id}``) over the chat path.

A request's ``input`` (a string, or items: messages with ``input_text`` / ``output_text`` parts,
``function_call`` and ``function_call_output`` items), ``instructions``, function ``tools``,
``tool_choice``, ``max_output_tokens``, ``temperature`` / ``top_p``, ``text.format``
(``json_schema`` / ``json_object``) and ``parallel_tool_calls`` become a
``ChatCompletionRequest`` that runs as a chat completion (template, tool plan, structured
outputs, prefix caching, queue limits, disconnect aborts). The answer is a ``response`` object
whose ``output`` holds ``reasoning``, ``message`` and ``function_call`` items, streamed as the
Responses events (``response.created``, ``response.in_progress``,
``response.output_item.added`` / ``.done``, ``response.content_part.added`` / ``.done``,
``response.output_text.delta`` / ``.done``, ``response.function_call_arguments.delta`` /
``.done``, ``response.completed`` or ``response.incomplete``), each with a
``sequence_number``.

``store`` (default true) keeps a response and its conversation in memory (:class:`ResponseStore`,
the most recent ``capacity``, least recently used evicted), so that ``previous_response_id``
continues it (its ``instructions`` are not carried over, as in OpenAI's API); an unknown id is a
404. Refused with a 400: tool types other than ``function``, input items other than those above.
"""
from __future__ import annotations

import collections
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator

from sloserve.sampling_params import ParamError
from sloserve.server.protocol import ChatCompletionRequest, Int, random_id
from sloserve.server.tools import ChoiceOutput, ToolPlan


class ResponsesRequest(BaseModel):
    """``POST /v1/responses`` body (unknown fields ignored)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: Int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any] | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None  # accepted, ignored
    background: bool = False  # refused when true: a client would poll a response never made
    priority: Int | None = 0  # vLLM's extension, as on the chat route
    cache_salt: str | None = None  # vLLM's extension, as on the chat route

    @field_validator("background")
    @classmethod
    def _background(cls, v: bool) -> bool:
        if v:
            raise ValueError("background responses are not served here: send the request "
                             "without background (stream it for early output)")
        return v

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        """OpenAI's limits: at most 16 pairs, keys up to 64 characters, values up to 512; and
        text that UTF-8 can carry (a lone surrogate could never be sent back)."""
        if v is None:
            return v
        if len(v) > 16:
            raise ValueError(f"at most 16 metadata pairs, got {len(v)}")
        for k, x in v.items():
            if len(k) > 64 or len(x) > 512:
                raise ValueError(f"metadata keys are at most 64 characters and values 512, "
                                 f"got {len(k)} and {len(x)} for key {k[:64]!r}")
            for text in (k, x):
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError:
                    raise ValueError("metadata text must be valid Unicode (a lone surrogate "
                                     "is not)") from None
        return v


class ResponseStore:
    """Stored responses (``store``): id -> (the response object, the conversation as chat
    messages up to and including its output), the ``capacity`` most recently used kept."""

    def __init__(self, capacity: int = 1024):
        self.capacity = capacity
        self._items: collections.OrderedDict[str, tuple[dict, list[dict]]] = \
            collections.OrderedDict()
        self._lock = threading.Lock()

    def put(self, response: dict, conversation: list[dict]) -> None:
        with self._lock:
            self._items[response["id"]] = (response, conversation)
            self._items.move_to_end(response["id"])
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def get(self, rid: str) -> tuple[dict, list[dict]] | None:
        with self._lock:
            got = self._items.get(rid)
            if got is not None:
                self._items.move_to_end(rid)
            return got

    def __len__(self) -> int:
        return len(self._items)


def _part_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ParamError(f"{where}.content must be a string or a list of parts", "input")
    out = []
    for j, p in enumerate(content):
        kind = p.get("type") if isinstance(p, dict) else type(p).__name__
        if kind not in ("input_text", "output_text", "text"):
            raise ParamError(f"{where}.content[{j}]: part type {kind!r} is not served here "
                             f"(input_text, output_text)", "input")
        if not isinstance(p.get("text"), str):
            raise ParamError(f"{where}.content[{j}]: a {kind} part needs a string text", "input")
        out.append(p["text"])
    return "\n".join(out)


def input_messages(inp: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``input`` as chat messages (consecutive function calls in one assistant message).

    Raises:
        ParamError: an unknown item type or role, an item without its fields.
    """
    if isinstance(inp, str):
        return [{"role": "user", "content": inp}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(inp):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise ParamError(f"{where}.role must be user, assistant, system or developer, "
                                 f"got {role!r}", "input")
            out.append({"role": "system" if role == "developer" else role,
                        "content": _part_text(item.get("content"), where)})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise ParamError(f"{where}: a function_call item needs call_id, name and "
                                 f"arguments", "input")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise ParamError(f"{where}: a function_call_output item needs call_id", "input")
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": output if isinstance(output, str) else json.dumps(output)})
        elif kind == "reasoning":  # an earlier turn's reasoning: not shown to the model again
            continue
        else:
            raise ParamError(f"{where}: item type {kind!r} is not served here (message, "
                             f"function_call, function_call_output)", "input")
    return out


def _chat_tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise ParamError(f"tools[{i}]: tool type {kind!r} is not served here (function)",
                             "tools")
        out.append({"type": "function", "function": {
            k: t[k] for k in ("name", "description", "parameters") if k in t}})
    return out


def _chat_tool_choice(tc: Any) -> Any:
    if isinstance(tc, dict) and tc.get("type") == "function":
        return {"type": "function", "function": {"name": tc.get("name")}}
    return tc


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise ParamError(f'text.format must be an object such as {{"type": "json_schema", '
                         f'"schema": ...}}, got {fmt!r:.100}', "text")
    if not fmt or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name"),
                                                       "schema": fmt.get("schema"),
                                                       "strict": fmt.get("strict")}}
    raise ParamError(f"text.format.type must be text, json_object or json_schema, got "
                     f"{fmt.get('type')!r}", "text")


def to_chat_request(req: ResponsesRequest, conversation: list[dict[str, Any]]
                    ) -> ChatCompletionRequest:
    """The chat request a Responses request runs as: its ``instructions``, then the
    ``conversation`` (the stored one of ``previous_response_id``, then ``input`` as chat
    messages, :func:`input_messages`).

    Raises:
        ParamError: a bad tool or text format.
    """
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions
                else []) + list(conversation)
    return ChatCompletionRequest(
        model=req.model, messages=messages, tools=_chat_tools(req.tools),
        tool_choice=_chat_tool_choice(req.tool_choice),
        parallel_tool_calls=req.parallel_tool_calls, max_tokens=req.max_output_tokens,
        temperature=req.temperature, top_p=req.top_p, stream=req.stream,
        response_format=_response_format(req.text), priority=req.priority,
        cache_salt=req.cache_salt)


#: the chat request's fields -> the Responses request's, for its errors
_FIELDS = {"max_tokens": "max_output_tokens", "response_format": "text", "messages": "input"}


def responses_error(err):
    """An ``errors.APIError`` of the chat path in the Responses API's field names."""
    from sloserve.server.errors import APIError
    message = err.message.replace("response_format json_schema needs json_schema.schema",
                                  "text.format json_schema needs a schema")
    message = message.replace("max_tokens", "max_output_tokens")
    return APIError(err.status, message, _FIELDS.get(err.param, err.param), headers=err.headers)


# ----------------------------------------------------------------------------------- answers
@dataclass
class ResponsesBuilder:
    """The ``response`` object of one request, whole or streamed; stores it when asked."""

    req: ResponsesRequest
    model: str
    plan: ToolPlan
    conversation: list[dict[str, Any]]  # the chat messages it ran on (without instructions)
    store: ResponseStore | None
    reasoning_parser: str | None = None
    id: str = field(default_factory=lambda: random_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))
    _seq: int = field(default=0, init=False)
    _items: list[dict[str, Any]] = field(default_factory=list, init=False)
    _open: dict[str, Any] | None = field(default=None, init=False)  # the item being streamed
    _open_key: tuple | None = field(default=None, init=False)

    def _output(self) -> ChoiceOutput:
        return ChoiceOutput(self.plan, self.reasoning_parser)

    def _object(self, status: str, output: list[dict[str, Any]], st=None) -> dict[str, Any]:
        f = st.final if st is not None else None
        r = self.req
        usage = None
        if f is not None:
            usage = {"input_tokens": f.num_prompt_tokens, "output_tokens": f.num_output_tokens,
                     "total_tokens": f.num_prompt_tokens + f.num_output_tokens,
                     "input_tokens_details": {"cached_tokens": f.num_cached_tokens},
                     "output_tokens_details": {"reasoning_tokens": 0}}
        return {"id": self.id, "object": "response", "created_at": self.created_at,
                "status": status, "model": self.model, "output": output, "usage": usage,
                "error": None, "incomplete_details": ({"reason": "max_output_tokens"}
                                                      if status == "incomplete" else None),
                "instructions": r.instructions, "tools": r.tools or [],
                "tool_choice": r.tool_choice or ("auto" if r.tools else "none"),
                "parallel_tool_calls": r.parallel_tool_calls is not False,
                "temperature": r.temperature, "top_p": r.top_p,
                "max_output_tokens": r.max_output_tokens,
                "previous_response_id": r.previous_response_id, "store": r.store,
                "text": r.text or {"format": {"type": "text"}}, "metadata": r.metadata or {}}

    @staticmethod
    def _status(st) -> str:
        return "incomplete" if st.final.finish_reason == "length" else "completed"

    def _finish(self, obj: dict[str, Any]) -> None:
        """Keep the response and its conversation (``store``)."""
        if not (self.req.store and self.store is not None):
            return
        conv = list(self.conversation)
        calls = [{"id": i["call_id"], "type": "function",
                  "function": {"name": i["name"], "arguments": i["arguments"]}}
                 for i in obj["output"] if i["type"] == "function_call"]
        text = "".join(p["text"] for i in obj["output"] if i["type"] == "message"
                       for p in i["content"])
        conv.append({"role": "assistant", "content": text or None,
                     **({"tool_calls": calls} if calls else {})})
        self.store.put(obj, conv)

    def response(self, states) -> dict[str, Any]:
        st = states[0]
        reasoning, content, calls = self._output().whole("".join(st.text))
        out: list[dict[str, Any]] = []
        if reasoning:
            out.append(_reasoning_item(random_id("rs"), reasoning))
        if content:
            out.append(_message_item(random_id("msg"), content))
        for c in calls:
            out.append(_call_item(random_id("fc"), c.id, c.name, c.arguments))
        obj = self._object(self._status(st), out, st)
        self._finish(obj)
        return obj

    # streamed
    def _event(self, kind: str, **data) -> str:
        self._seq += 1
        return (f"event: {kind}\ndata: "
                f"{json.dumps({'type': kind, 'sequence_number': self._seq - 1, **data}, ensure_ascii=True)}\n\n")

    def preamble(self, st) -> list[str]:
        obj = self._object("in_progress", [])
        return [self._event("response.created", response=obj),
                self._event("response.in_progress", response=obj)]

    def _switch(self, key: tuple, item: dict[str, Any]) -> list[str]:
        """Events that make ``item`` (identified by ``key``) the open output item."""
        if self._open_key == key:
            return []
        ev = self._close()
        self._open, self._open_key = item, key
        n = len(self._items)
        added = {**item, "content": []} if item["type"] == "message" else dict(item)
        ev.append(self._event("response.output_item.added", output_index=n, item=added))
        if item["type"] == "message":
            ev.append(self._event("response.content_part.added", item_id=item["id"],
                                  output_index=n, content_index=0,
                                  part={"type": "output_text", "text": "", "annotations": []}))
        return ev

    def _close(self) -> list[str]:
        item, self._open, self._open_key = self._open, None, None
        if item is None:
            return []
        n, ev = len(self._items), []
        if item["type"] == "message":
            part = item["content"][0]
            ev.append(self._event("response.output_text.done", item_id=item["id"],
                                  output_index=n, content_index=0, text=part["text"]))
            ev.append(self._event("response.content_part.done", item_id=item["id"],
                                  output_index=n, content_index=0, part=part))
        elif item["type"] == "function_call":
            ev.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                  output_index=n, arguments=item["arguments"]))
        item["status"] = "completed"
        ev.append(self._event("response.output_item.done", output_index=n, item=item))
        self._items.append(item)
        return ev

    def chunk(self, st, out, first: bool) -> str | None:
        if st.parsed is None:
            st.parsed = self._output()
        reasoning, content, calls = st.parsed.feed(out.new_text, last=out.finished)
        ev: list[str] = []
        n = lambda: len(self._items)  # noqa: E731 - the open item's output_index
        if reasoning:
            ev += self._switch(("reasoning",), _reasoning_item(random_id("rs"), "",
                                                                "in_progress"))
            self._open["content"][0]["text"] += reasoning
            ev.append(self._event("response.reasoning_text.delta", item_id=self._open["id"],
                                  output_index=n(), content_index=0, delta=reasoning))
        if content:
            ev += self._switch(("message",), _message_item(random_id("msg"), "", "in_progress"))
            self._open["content"][0]["text"] += content
            ev.append(self._event("response.output_text.delta", item_id=self._open["id"],
                                  output_index=n(), content_index=0, delta=content,
                                  logprobs=[]))
        for d in calls:
            if d.id is not None:
                ev += self._switch(("call", d.index), _call_item(random_id("fc"), d.id, d.name,
                                                                 "", "in_progress"))
            if d.arguments:
                self._open["arguments"] += d.arguments
                ev.append(self._event("response.function_call_arguments.delta",
                                      item_id=self._open["id"], output_index=n(),
                                      delta=d.arguments))
        if out.finished:
            ev += self._close()
            obj = self._object(self._status(st), list(self._items), st)
            self._finish(obj)
            kind = "response.completed" if obj["status"] == "completed" else \
                "response.incomplete"
            ev.append(self._event(kind, response=obj))
        return "".join(ev) or None

    def usage_chunk(self, usage) -> str:
        return ""

    def done(self) -> str:
        return ""

    def error_event(self, err) -> str:
        return self._event("error", code=str(err.status), message=err.message, param=err.param)


def _message_item(iid: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": iid, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def _call_item(iid: str, call_id: str, name: str, arguments: str,
               status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": iid, "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def _reasoning_item(iid: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "reasoning", "id": iid, "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}
