"""Forwarding: choose a worker, send it the request, hand its answer to the client.

A streamed answer (``"stream": true`` and a 200) passes through as server-sent events, whole
events at a time, as they arrive; if the request fails mid-stream (its worker went down, its
connection broke, the prefill half failed) the client gets an OpenAI error event and
``data: [DONE]``. Any other answer is passed through whole, status and body as the worker gave
them. A request that could not connect to its worker (nothing was sent) goes to another one.
"""
from __future__ import annotations

import json
from typing import AsyncIterator, Awaitable, Callable, Sequence

import anyio
import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from sloserve.router.errors import RouterError
from sloserve.router.policies import RouteContext
from sloserve.router.upstream import Upstream
from sloserve.router.workers import Worker, WorkerPool

#: request headers not forwarded (hop-by-hop, or set again for the worker)
_DROP_HEADERS = frozenset({"host", "content-length", "connection", "keep-alive",
                           "transfer-encoding", "te", "trailer", "upgrade", "proxy-authorization",
                           "proxy-connection", "accept-encoding", "content-type", "expect"})

_ROLE_WORDS = {"replica": "replica", "prefill": "prefill server", "decode": "decode server"}


def forward_headers(request: Request) -> dict[str, str]:
    """The client's headers for the worker, with ``X-Forwarded-For`` naming the client."""
    out = {k: v for k, v in request.headers.items() if k.lower() not in _DROP_HEADERS}
    if request.client is not None:
        prior = request.headers.get("x-forwarded-for")
        out["x-forwarded-for"] = (f"{prior}, {request.client.host}" if prior
                                  else request.client.host)
    return out


class ProxyStream(StreamingResponse):
    """A streamed answer that, however it ends (the client may go away mid-stream), closes its
    body generator and then runs ``on_close`` (which closes the worker connections)."""

    media_type = "text/event-stream"

    def __init__(self, content, on_close: Sequence[Callable[[], Awaitable]] = (), **kw):
        super().__init__(content, headers={"cache-control": "no-cache",
                                           "x-accel-buffering": "no"}, **kw)
        self._on_close = list(on_close)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                aclose = getattr(self.body_iterator, "aclose", None)
                if aclose is not None:
                    await aclose()
                for close in self._on_close:
                    await close()


async def relay_events(up: Upstream) -> AsyncIterator[bytes]:
    """The worker's SSE body, whole events at a time; the API's error event if the request
    fails before its end (a partial event is dropped)."""
    buf = b""
    try:
        async for chunk in up.chunks():
            buf += chunk
            i = buf.rfind(b"\n\n")
            if i >= 0:
                yield buf[:i + 2]
                buf = buf[i + 2:]
        if buf:
            yield buf
    except RouterError as e:
        yield e.sse(up.path)


class Proxy:
    """The router's forwarding, over its pool of workers.

    Args:
        pool: the workers.
        client: the HTTP client for proxied requests.
        metrics: a ``RouterMetrics``.
    """

    def __init__(self, pool: WorkerPool, client: httpx.AsyncClient, metrics=None):
        self.pool = pool
        self.client = client
        self.metrics = metrics

    async def choose(self, role: str, policy, ctx: RouteContext,
                     exclude: Sequence[Worker] = ()) -> Worker:
        """A worker of ``role`` by ``policy``.

        Raises:
            RouterError: 503, none is available.
        """
        workers = [w for w in self.pool.available(role) if w not in exclude]
        if not workers:
            if self.metrics is not None:
                self.metrics.proxy_error(None, "no_worker")
            states = ", ".join(f"{w.url} {w.state}" for w in self.pool.role(role))
            raise RouterError(503, f"no healthy {_ROLE_WORDS[role]} ({states})", "no_worker")
        return await policy.choose(workers, ctx)

    def start(self, worker: Worker, path: str, content: bytes,
              headers: dict[str, str]) -> Upstream:
        """Send the request to ``worker`` (its answer is read from the returned upstream)."""
        return Upstream(self.pool, self.client, worker, path, content, headers,
                        self.metrics).start()

    async def open(self, role: str, policy, ctx: RouteContext, path: str, content: bytes,
                   headers: dict[str, str]) -> Upstream:
        """Send the request to a worker of ``role`` and wait for its answer's head; a worker
        that cannot be reached is marked down and the next one chosen.

        Raises:
            RouterError: no worker could take it (503), or it failed before its head (502).
        """
        tried: list[Worker] = []
        while True:
            w = await self.choose(role, policy, ctx, exclude=tried)
            up = self.start(w, path, content, headers)
            try:
                await up.head()
                return up
            except RouterError as e:
                await up.close()
                if e.kind != "connect":
                    raise
                tried.append(w)

    async def respond(self, up: Upstream, stream: bool,
                      also_close: Sequence[Callable[[], Awaitable]] = ()) -> Response:
        """The client's answer from ``up`` (after its head): streamed through when the client
        asked for a stream and the worker answered 200, else whole. ``up`` and ``also_close``
        are closed when the answer ends."""
        closers = [up.close, *also_close]
        if stream and up.status == 200:
            return ProxyStream(relay_events(up), on_close=closers)
        try:
            content = await up.read()
        except RouterError as e:
            return e.response(up.path)
        finally:
            for close in closers:
                await close()
        return Response(content, status_code=up.status,
                        media_type=up.response_headers.get("content-type", "application/json"))


def dumps(body: dict) -> bytes:
    return json.dumps(body, ensure_ascii=True, separators=(",", ":")).encode()
