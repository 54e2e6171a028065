"""The OpenAI stream's events as the bench and the router read them (one definition, docs/bench.md):
a *content chunk* is an SSE event whose first choice carries non-empty text
(``choices[0].text`` for completions, ``choices[0].delta.content`` for chat); role-only, empty
and usage-only events are not content; the output length is the final ``usage`` event's
``completion_tokens`` (``stream_options.include_usage``)."""
from __future__ import annotations

import json
from typing import Any


class MalformedEvent(ValueError):
    """An SSE event that is not an OpenAI stream chunk."""


def chunk_text(data: dict[str, Any], chat: bool) -> str:
    """The content text of one stream chunk ("" for none). Raises MalformedEvent."""
    choices = data.get("choices") or []
    if not choices:
        return ""
    if not isinstance(choices, list) or not isinstance(choices[0], dict):
        raise MalformedEvent(f"choices must be a list of objects, got {choices!r:.100}")
    c = choices[0]
    if chat:
        delta = c.get("delta") or {}
        text = delta.get("content") if isinstance(delta, dict) else None
    else:
        text = c.get("text")
    if text is not None and not isinstance(text, str):
        raise MalformedEvent(f"chunk text must be a string, got {text!r:.100}")
    return text or ""


def parse_event(payload: str) -> dict[str, Any]:
    try:
        data = json.loads(payload)
    except json.JSONDecodeError as e:
        raise MalformedEvent(f"event is not JSON ({e}): {payload[:100]!r}") from None
    if not isinstance(data, dict):
        raise MalformedEvent(f"event is not a JSON object: {payload[:100]!r}")
    return data


def usage_counts(data: dict[str, Any]) -> tuple[int | None, int | None]:
    """(completion_tokens, prompt_tokens) of a usage event. Raises MalformedEvent."""
    u = data["usage"]
    if not isinstance(u, dict):
        raise MalformedEvent(f"usage must be an object, got {u!r:.100}")
    vals = []
    for k in ("completion_tokens", "prompt_tokens"):
        v = u.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise MalformedEvent(f"usage.{k} must be a non-negative integer, got {v!r:.50}")
        vals.append(v)
    return vals[0], vals[1]


def has_output(data: dict[str, Any], chat: bool) -> bool:
    """The chunk carries generated output: content text (:func:`chunk_text`), or a chat delta's
    ``reasoning_content`` or ``tool_calls`` (what the router times; the bench's content chunks
    are text alone)."""
    if chunk_text(data, chat):
        return True
    if not chat:
        return False
    choices = data.get("choices") or []
    delta = choices[0].get("delta") if choices and isinstance(choices[0], dict) else None
    return isinstance(delta, dict) and bool(delta.get("reasoning_content") or delta.get("tool_calls"))
