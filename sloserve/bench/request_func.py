"""One streamed request to an OpenAI-compatible server, timed chunk by chunk.

Timing follows the definitions in ``docs/bench.md``: the send time is taken just before the
request is written; a *content chunk* is an SSE event whose choice carries non-empty text
(``choices[0].text`` for completions, ``choices[0].delta.content`` for chat); role-only, empty
and usage-only events are not content. TTFT = first content chunk - send; ITL = gaps between
consecutive content chunks; E2E = last content chunk - send. The output length comes from the
final ``usage`` event (``stream_options.include_usage``); without one it is counted with the
tokenizer (or, lacking that, as the number of content chunks).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import httpx

from sloserve.openai_stream import MalformedEvent, chunk_text, parse_event, usage_counts
from sloserve.workload import RequestRecord


@dataclass
class RequestInput:
    """What to send.

    Attributes:
        url: full endpoint URL (``.../v1/completions`` or ``.../v1/chat/completions``).
        model: the ``model`` field.
        prompt: prompt text (the user message for chat).
        prompt_len: prompt tokens (for the record).
        max_tokens: ``max_tokens`` (tokens).
        chat: True for the chat endpoint's request body.
        ignore_eos: send ``ignore_eos`` (vLLM / sloserve extension) so every request runs to
            ``max_tokens``.
        extra_body: more fields merged into the JSON body (e.g. ``temperature``).
        tag: workload label, carried to the record.
    """

    url: str
    model: str
    prompt: str
    prompt_len: int
    max_tokens: int
    chat: bool = False
    ignore_eos: bool = False
    extra_body: dict[str, Any] = field(default_factory=dict)
    tag: str | None = None

    def body(self) -> dict[str, Any]:
        """The JSON request body (streaming, usage requested, greedy unless overridden)."""
        b: dict[str, Any] = {"model": self.model, "max_tokens": self.max_tokens, "stream": True,
                             "stream_options": {"include_usage": True}, "temperature": 0.0}
        if self.chat:
            b["messages"] = [{"role": "user", "content": self.prompt}]
        else:
            b["prompt"] = self.prompt
        if self.ignore_eos:
            b["ignore_eos"] = True
        b.update(self.extra_body)
        return b


async def send_request(client: httpx.AsyncClient, inp: RequestInput,
                       count_tokens: Callable[[str], int] | None = None) -> RequestRecord:
    """POST ``inp`` with streaming and time its SSE events.

    Never raises for server or network errors: they end up in ``record.error`` (HTTP status and
    body for non-200 answers, the event's message for an in-stream error event, "malformed
    stream event: ..." for an event that is not an OpenAI stream chunk).

    Args:
        client: an httpx client (timeouts are the client's).
        inp: the request.
        count_tokens: counts output tokens from text when the server sends no usage.
    """
    rec = RequestRecord(prompt_len=inp.prompt_len, tag=inp.tag)
    rec.send_time = time.perf_counter()
    text_parts: list[str] = []
    usage_tokens: int | None = None
    try:
        async with client.stream("POST", inp.url, json=inp.body()) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                rec.error = f"HTTP {resp.status_code}: {body[:500]}"
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                now = time.perf_counter()
                data = parse_event(payload)
                if data.get("error") is not None:
                    err = data["error"]
                    rec.error = (str(err.get("message", err)) if isinstance(err, dict)
                                 else str(err))
                    break
                if data.get("usage"):
                    usage_tokens, rec.server_prompt_tokens = usage_counts(data)
                text = chunk_text(data, inp.chat)
                if text:
                    rec.chunk_times.append(now)
                    text_parts.append(text)
    except MalformedEvent as e:
        rec.error = f"malformed stream event: {e}"
    except (httpx.HTTPError, OSError) as e:
        rec.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    rec.generated_text = "".join(text_parts)
    rec.set_times_from_chunks()
    if rec.server_prompt_tokens is not None:  # as vLLM: the server's count (chat: + template)
        rec.prompt_len = int(rec.server_prompt_tokens)
    if usage_tokens is not None:
        rec.output_tokens = int(usage_tokens)
    elif count_tokens is not None:
        rec.output_tokens = count_tokens(rec.generated_text)
    else:
        rec.output_tokens = len(rec.chunk_times)
    if not rec.error and not rec.chunk_times:
        rec.error = "the stream ended without any content"
    rec.success = not rec.error
    return rec
