"""Stub OpenAI workers and a live router, each a uvicorn server on 127.0.0.1 (a free port) in a
daemon thread: no model is loaded.

A :class:`StubWorker` answers completions and chats with its own name as the text (so a test
sees which worker served a request), records every body it got, and can be killed (listening
socket and connections closed at once, as a killed process's are), frozen (``/health`` and its
streams hang, as a stopped process's do) and restarted on the same port.
"""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from contextlib import asynccontextmanager
from typing import Any, Callable

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from sloserve.router.app import build_app
from sloserve.router.config import RouterConfig


def char_tokens(text: str) -> list[int]:
    """The stubs' tokenizer: one token per character (its code point)."""
    return [ord(c) for c in text]


def chat_text(messages: list[dict]) -> str:
    """The stubs' chat template."""
    return "".join(f"<{m['role']}>{m.get('content') or ''}" for m in messages) + "<assistant>"


def _bind(port: int = 0) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    return sock


class _Served:
    """An ASGI app under uvicorn in a thread, killable."""

    def __init__(self, app_factory: Callable[[], FastAPI]):
        self.app_factory = app_factory
        self.port = 0
        self.server: uvicorn.Server | None = None
        self.thread: threading.Thread | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.frozen = False
        self.killed = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self):
        self.killed = False
        sock = _bind(self.port)
        self.port = sock.getsockname()[1]
        app = self.app_factory()
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on",
                                                    access_log=False))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                       daemon=True, name=f"stub-{self.port}")
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.005)
        return self

    def kill(self, wait: bool = True) -> None:
        """Stop listening and drop every connection now (a killed process)."""
        server = self.server
        self.frozen, self.killed = False, True  # (its handlers may end)

        def abort() -> None:
            for s in getattr(server, "servers", []):
                s.close()
            for c in list(server.server_state.connections):
                t = getattr(c, "transport", None)
                if t is not None:
                    t.abort()
            server.should_exit = True

        self.loop.call_soon_threadsafe(abort)
        if wait:
            self.join()

    def join(self) -> None:
        self.thread.join(timeout=3)
        if self.thread.is_alive():
            self.server.force_exit = True
            self.thread.join(timeout=5)

    def stop(self, wait: bool = True) -> None:
        if self.thread is not None and self.thread.is_alive():
            self.kill(wait)


def stop_all(served: list[_Served]) -> None:
    """Stop servers together (each takes a tick of its loop to notice)."""
    live = [s for s in served if s.thread is not None and s.thread.is_alive()]
    for s in live:
        s.stop(wait=False)
    for s in live:
        s.join()


class StubWorker(_Served):
    """A fake sloserve / vLLM server named ``name``.

    Attributes:
        bodies: (path, body) of every generation request it got, in order.
        kv_info: its ``GET /kv_transfer`` answer (None: 404).
        finish_reason: of its completions.
        stream_forever: streams send a chunk every 50 ms until the client goes away.
        fail_status: answer generations with this status and an OpenAI error body.
        delay: seconds a whole (non-streamed) answer, or a failure, takes.
        first_delay, chunk_delay: seconds before a stream's first chunk, and between chunks.
        include_usage: end streams with a usage event (completion_tokens ``usage_tokens``).
        stats: its ``GET /stats`` answer (None: 404).
    """

    def __init__(self, name: str, kv_info: dict | None = None):
        super().__init__(self._app)
        self.name = name
        self.kv_info = kv_info
        self.bodies: list[tuple[str, dict]] = []
        self.finish_reason = "length"
        self.stream_forever = False
        self.fail_status: int | None = None
        self.delay = 0.0
        self.first_delay = 0.0
        self.chunk_delay = 0.0
        self.include_usage = False
        self.usage_tokens = 3
        self.stats: dict | None = None
        self.health_status = 200
        self.num_streams_closed = 0

    def freeze(self) -> None:
        self.frozen = True

    def restart(self) -> "StubWorker":
        self.frozen = False
        return self.start()

    def _answer(self, path: str, body: dict) -> dict:
        chat = path.endswith("chat/completions")
        choice: dict[str, Any] = {"index": 0, "finish_reason": self.finish_reason,
                                  "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": self.name}
        else:
            choice["text"] = self.name
        out = {"id": f"{self.name}-1", "object": "chat.completion" if chat else "text_completion",
               "created": 1, "model": "stub", "choices": [choice], "worker": self.name,
               "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}
        kv = body.get("kv_transfer_params")
        if isinstance(kv, dict) and kv.get("do_remote_decode"):
            out["kv_transfer_params"] = {"do_remote_prefill": True, "remote_engine_id": self.name,
                                         "remote_host": "127.0.0.1", "remote_port": 7777,
                                         "transfer_id": kv.get("transfer_id", f"t-{self.name}"),
                                         "remote_block_ids": [3, 4]}
        return out

    def _app(self) -> FastAPI:
        @asynccontextmanager
        async def lifespan(app):
            self.loop = asyncio.get_running_loop()
            yield

        app = FastAPI(lifespan=lifespan)

        async def hang() -> None:
            while self.frozen:
                await asyncio.sleep(0.02)

        @app.get("/health")
        async def health():
            await hang()
            return Response(status_code=self.health_status)

        @app.get("/kv_transfer")
        async def kv_transfer():
            if self.kv_info is None:
                return JSONResponse({"error": {"message": "no"}}, status_code=404)
            return self.kv_info

        @app.get("/stats")
        async def stats():
            if self.stats is None:
                return JSONResponse({"error": {"message": "no"}}, status_code=404)
            return self.stats

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": "stub", "object": "model",
                                                "owned_by": self.name}]}

        @app.post("/tokenize")
        async def tokenize(request: Request):
            body = await request.json()
            if "messages" in body:
                tokens = char_tokens(chat_text(body["messages"]))
            else:
                tokens = char_tokens(body["prompt"])
            return {"count": len(tokens), "max_model_len": 4096, "tokens": tokens}

        async def generate(request: Request, path: str):
            body = await request.json()
            self.bodies.append((path, body))

            async def pause() -> None:
                end = time.monotonic() + self.delay
                while time.monotonic() < end and not self.killed:
                    await asyncio.sleep(0.02)

            if self.fail_status is not None:
                await pause()
                return JSONResponse({"error": {"message": f"{self.name} refuses",
                                               "type": "BadRequestError", "param": None,
                                               "code": self.fail_status}},
                                    status_code=self.fail_status)
            answer = self._answer(path, body)
            if not body.get("stream"):
                await pause()
                await hang()
                return JSONResponse(answer)
            chat = path.endswith("chat/completions")

            async def events():
                try:
                    i = 0
                    await asyncio.sleep(self.first_delay)
                    while True:
                        await hang()
                        c = dict(answer["choices"][0])
                        if chat:
                            c["delta"] = {"content": f"{self.name}-{i}"}
                            c.pop("message")
                        else:
                            c["text"] = f"{self.name}-{i}"
                        last = not self.stream_forever and i == 2
                        c["finish_reason"] = self.finish_reason if last else None
                        chunk = {k: v for k, v in answer.items() if k != "usage"}
                        yield f"data: {json.dumps({**chunk, 'choices': [c]})}\n\n"
                        if last:
                            break
                        i += 1
                        await asyncio.sleep(0.05 if self.stream_forever
                                            else max(self.chunk_delay, 0.001))
                    if self.include_usage:
                        yield ("data: " + json.dumps({**answer, "choices": [], "usage": {
                            "prompt_tokens": 3, "completion_tokens": self.usage_tokens,
                            "total_tokens": 3 + self.usage_tokens}}) + "\n\n")
                    yield "data: [DONE]\n\n"
                finally:
                    self.num_streams_closed += 1

            return StreamingResponse(events(), media_type="text/event-stream")

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await generate(request, "/v1/completions")

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            return await generate(request, "/v1/chat/completions")

        return app


class LiveRouter(_Served):
    """The router app for ``config`` under uvicorn; ``client`` talks to it."""

    def __init__(self, config: RouterConfig):
        self.config = config
        self.app = None

        def factory():
            self.app = build_app(config)
            inner = self.app.router.lifespan_context

            @asynccontextmanager
            async def lifespan(app):
                self.loop = asyncio.get_running_loop()
                async with inner(app):
                    yield
            self.app.router.lifespan_context = lifespan
            return self.app

        super().__init__(factory)
        self.client: httpx.Client | None = None

    @property
    def router(self):
        return self.app.state.router

    def start(self) -> "LiveRouter":
        super().start()
        self.client = httpx.Client(base_url=self.url, timeout=10.0, trust_env=False)
        return self

    def stop(self, wait: bool = True) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
        if self.server is not None and self.thread is not None and self.thread.is_alive():
            self.server.should_exit = True
            if wait:
                self.join()

    def states(self) -> dict[str, str]:
        """Each worker's state as ``/health`` reports it."""
        return {w["url"]: w["state"] for w in self.client.get("/health").json()["workers"]}

    def wait_for(self, cond: Callable[[], bool], timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise AssertionError("condition not reached in time")
            time.sleep(0.02)


def served_by(resp: httpx.Response) -> str:
    return resp.json()["worker"]


def sse_events(lines) -> list[str]:
    """The ``data:`` payloads of SSE lines."""
    return [ln[len("data: "):] for ln in lines if ln.startswith("data: ")]
