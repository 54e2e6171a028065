"""A scripted mock of an OpenAI-compatible streaming server, for testing ``sloserve bench``.

A FastAPI app served by uvicorn in a daemon thread on a free 127.0.0.1 port. Both
``/v1/completions`` and ``/v1/chat/completions`` stream SSE lines ``data: {...}\\n\\n`` ending with
``data: [DONE]``. The prompt text (completions) or the last user message (chat) names a
:class:`Script` registered with :meth:`MockServer.add`; any other prompt gets
:attr:`MockServer.default`, or else min(max_tokens, 4) quick tokens with usage (prompt_tokens
:data:`DEFAULT_PROMPT_TOKENS`).

Times in a script are offsets in seconds from the moment the handler received the request; the
server sleeps until each offset (absolute, so gaps do not drift), which makes them lower bounds
of what the client measures.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

MODEL_ID = "mock-model"
#: ``usage.prompt_tokens`` of the default script
DEFAULT_PROMPT_TOKENS = 11


@dataclass
class Script:
    """What the server does for one prompt.

    Attributes:
        tokens: (offset s, text) of every content chunk, in order.
        usage: ``completion_tokens`` of a final usage-only chunk; None = no usage chunk.
        usage_at: offset of the usage chunk (default: right after the last event).
        prompt_tokens: ``usage.prompt_tokens``.
        role_at: chat only: offset of a role-only first chunk (``{"role": "assistant",
            "content": ""}``); None = none.
        empty_at: offsets of content-less chunks (text "" / delta {}) to interleave.
        status: HTTP status; not 200 = answer ``error_body`` as JSON instead of streaming.
        error_body: JSON body of a non-200 answer.
        stream_error: (offset, message) of an in-stream ``{"error": {...}}`` event sent after
            the tokens (the stream then ends without usage or [DONE]).
    """

    tokens: list[tuple[float, str]] = field(default_factory=list)
    usage: int | None = None
    usage_at: float | None = None
    prompt_tokens: int = 5
    role_at: float | None = None
    empty_at: list[float] = field(default_factory=list)
    status: int = 200
    error_body: dict[str, Any] | None = None
    stream_error: tuple[float, str] | None = None


def steady(ttft: float, n: int, gap: float, *, usage: int | None | str = "n", **kw) -> Script:
    """``n`` content chunks: the first at ``ttft`` s, then one every ``gap`` s; usage = n."""
    toks = [(ttft + i * gap, f" t{i}") for i in range(n)]
    return Script(tokens=toks, usage=n if usage == "n" else usage, **kw)


def http_error(status: int, message: str) -> Script:
    """A non-200 answer with an OpenAI error body."""
    return Script(status=status, error_body={"error": {"message": message, "type": "InternalServerError",
                                                       "param": None, "code": status}})


class MockServer:
    """The running mock (see the module docstring)."""

    def __init__(self) -> None:
        self.scripts: dict[str, Script] = {}
        #: the script for prompts without one; None = a few quick tokens (see _generate)
        self.default: Script | None = None
        self.received: list[tuple[str, dict[str, Any]]] = []  # (path, JSON body)
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self.app = self._build_app()
        self.server: uvicorn.Server | None = None
        self.thread: threading.Thread | None = None
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def add(self, script: Script, name: str | None = None) -> str:
        """Register ``script``; returns the (unique) prompt text that selects it."""
        name = name or f"script-{next(self._ids)}"
        with self._lock:
            self.scripts[name] = script
        return name

    def bodies(self, prompt: str) -> list[tuple[str, dict[str, Any]]]:
        """(path, body) of every request received for ``prompt``."""
        with self._lock:
            return [(p, b) for p, b in self.received if _prompt_of(b) == prompt]

    def num_generation_requests(self) -> int:
        with self._lock:
            return len(self.received)

    # -- app ---------------------------------------------------------------------------------

    def _build_app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/v1/models")
        async def models():
            # an id, and a root that is no usable local path
            return {"object": "list", "data": [{"id": MODEL_ID, "object": "model", "owned_by": "mock",
                                                "root": "/nonexistent/mock-model-root"}]}

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await self._generate(request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request):
            return await self._generate(request, chat=True)

        return app

    async def _generate(self, request: Request, chat: bool):
        t0 = time.perf_counter()
        body = await request.json()
        with self._lock:
            self.received.append((request.url.path, body))
            script = self.scripts.get(_prompt_of(body)) or self.default
        if script is None:
            n = max(1, min(int(body.get("max_tokens") or 4), 4))
            script = steady(0.0, n, 0.001, prompt_tokens=DEFAULT_PROMPT_TOKENS)
        if script.status != 200:
            return JSONResponse(script.error_body or {}, status_code=script.status)
        return StreamingResponse(self._stream(script, chat, t0), media_type="text/event-stream")

    async def _stream(self, s: Script, chat: bool, t0: float):
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text: str | None, role: bool = False) -> str:
            if chat:
                delta: dict[str, Any] = {}
                if role:
                    delta = {"role": "assistant", "content": ""}
                elif text is not None:
                    delta = {"content": text}
                choice = {"index": 0, "delta": delta, "finish_reason": None}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": None}
            return _sse({"id": "cmpl-mock", "object": obj, "created": 0, "model": MODEL_ID,
                         "choices": [choice], "usage": None})

        events: list[tuple[float, int, str]] = []  # (offset, order, payload)
        if chat and s.role_at is not None:
            events.append((s.role_at, 0, chunk(None, role=True)))
        for t in s.empty_at:
            events.append((t, 1, chunk("" if not chat else None)))
        for t, text in s.tokens:
            events.append((t, 2, chunk(text)))
        events.sort(key=lambda e: (e[0], e[1]))
        last = events[-1][0] if events else 0.0
        if s.stream_error is not None:
            t_err, msg = s.stream_error
            events.append((max(t_err, last), 3, _sse({"error": {"message": msg, "type": "BadRequestError",
                                                              "param": None, "code": 400}})))
        elif s.usage is not None:
            usage = {"prompt_tokens": s.prompt_tokens, "completion_tokens": s.usage,
                     "total_tokens": s.prompt_tokens + s.usage}
            events.append((max(s.usage_at if s.usage_at is not None else last, last), 3,
                           _sse({"id": "cmpl-mock", "object": obj, "created": 0, "model": MODEL_ID,
                                 "choices": [], "usage": usage})))
        # While waiting, an SSE comment (which clients skip) every 10 ms keeps the connection
        # path warm: after a long idle wait the first write arrives 5-15 ms late on a small VM,
        # which would blur the scripted timing.
        for t, _, payload in events:
            while (delay := t0 + t - time.perf_counter()) > 0.015:
                await asyncio.sleep(0.01)
                yield ": keep-alive\n\n"
            if delay > 0:
                await asyncio.sleep(delay)
            yield payload
        if s.stream_error is None:
            yield "data: [DONE]\n\n"

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> "MockServer":
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", lifespan="off",
                                                    access_log=False))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                       daemon=True, name=f"mock-openai-{self.port}")
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("mock uvicorn server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout=10)


def _prompt_of(body: dict[str, Any]) -> str | None:
    if "messages" in body:
        users = [m.get("content") for m in body.get("messages") or [] if m.get("role") == "user"]
        return users[-1] if users else None
    p = body.get("prompt")
    return p if isinstance(p, str) else None


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"
