"""Each completion / chat request's latency as the router's client sees it, for the router's
SLO counters and ``/stats`` window (``router --goodput``).

The definitions are ``sloserve bench``'s (``sloserve.openai_stream``, docs/bench.md), timed at
the router: from the request's arrival, TTFT to the first chunk with output (text, or a chat's
reasoning or tool-call delta), ITL between such chunks, E2E to the last one; output tokens from
the stream's final ``usage`` event (``stream_options.include_usage``, which the bench sends),
else those chunks; TPOT is vLLM's, per choice when a request has several (``n``, or a list of
prompts; their ITLs, interleaved, are not kept). A request answered
whole (not streamed) reaches its client at once: TTFT = E2E, judged on those. A request that
failed (an error answer or error event), ended without content or was left by its client is
not judged.
"""
from __future__ import annotations

import json
import time
from typing import AsyncIterator

from fastapi.responses import Response, StreamingResponse

from sloserve.latency import tpot as tpot_of
from sloserve.openai_stream import MalformedEvent, has_output, parse_event, usage_counts


def num_prompts(prompt) -> int:
    """Prompts of a completion request's ``prompt``: a list of strings or of token-id lists is
    several (each gets ``n`` choices); a string or one list of token ids is one."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return len(prompt)
    return 1


class RequestTimer:
    """One request's clock, from its arrival; ``wrap`` times the answer and records it in
    ``metrics`` (a ``RouterMetrics``) when it ends."""

    def __init__(self, metrics, chat: bool, body: dict):
        self.t0 = time.monotonic()
        self.metrics = metrics
        self.chat = chat
        n = body.get("n", 1)
        n = n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else 1
        self.n = n * num_prompts(body.get("prompt"))
        self.times: list[float] = []
        self.usage_tokens: int | None = None
        self.failed = False
        self.done = False
        self._buf = b""

    def wrap(self, resp: Response) -> Response:
        if resp.status_code != 200:
            return resp
        if isinstance(resp, StreamingResponse):
            resp.body_iterator = self._timed(resp.body_iterator)
            return resp
        now = time.monotonic()
        if resp.headers.get("content-type", "").startswith("text/event-stream"):
            self.feed(resp.body, now)  # a stream answered at once (one-token prefill halves)
        else:
            self._whole(resp.body, now)
        self.finish()
        return resp

    async def _timed(self, it: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        try:
            async for chunk in it:
                self.feed(chunk, time.monotonic())
                if self.done:  # judged as [DONE] passes, before the client can leave (a
                    self.finish()  # client gone after [DONE] may cancel the stream's end)
                yield chunk
            self.finish()
        finally:
            aclose = getattr(it, "aclose", None)
            if aclose is not None:
                await aclose()

    def feed(self, data: bytes | str, now: float) -> None:
        """Stream bytes (whole events or not) received at ``now``."""
        self._buf += data.encode() if isinstance(data, str) else data
        *events, self._buf = self._buf.split(b"\n\n")
        for ev in events:
            for line in ev.split(b"\n"):
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    self.done = True
                    continue
                try:
                    d = parse_event(payload.decode("utf-8", "replace"))
                    if d.get("error") is not None:
                        self.failed = True
                    if d.get("usage"):
                        self.usage_tokens = usage_counts(d)[0]
                    if has_output(d, self.chat):
                        self.times.append(now)
                except MalformedEvent:
                    self.failed = True

    def _whole(self, body: bytes, now: float) -> None:
        try:
            d = json.loads(body)
            tokens = d["usage"]["completion_tokens"]
        except (ValueError, KeyError, TypeError):
            return
        if isinstance(tokens, int) and tokens > 0:
            self.times = [now]
            self.usage_tokens = tokens
            self.done = True

    def finish(self) -> None:
        """Judge and record the request (once), if it ended well and carried content."""
        if not self.done or self.failed or not self.times:
            return
        self.done = False
        ttft = self.times[0] - self.t0
        e2e = self.times[-1] - self.t0
        tokens = self.usage_tokens if self.usage_tokens is not None else len(self.times)
        per_choice = max(1, tokens // self.n)
        itls = ([b - a for a, b in zip(self.times, self.times[1:])]
                if self.n == 1 else [])
        self.metrics.record_request(ttft, tpot_of(e2e, ttft, per_choice), e2e, itls)
