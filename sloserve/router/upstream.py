"""One request proxied to one worker.

Its I/O runs in a task of its own that hands the response on through a small queue: the head
(status, headers), the body's chunks, the end. Whoever reads it (the client's response) waits
on that queue only, so the request can be failed from outside at any moment, with the reader
told at once: when its worker is marked down, or when the other half of a disaggregated
request failed. Closing it (the client went away, or the response ended) cancels the task,
which closes the connection to the worker: the worker then aborts the request.

While it runs it counts in its worker's ``inflight`` (the least-outstanding policy's load).
"""
from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator

import httpx

from sloserve.router.errors import RouterError
from sloserve.router.workers import Worker

logger = logging.getLogger("sloserve.router")

#: body chunks buffered per request before the worker's connection is read no further
QUEUE_CHUNKS = 64

_HEAD, _DATA, _END, _WAKE = "head", "data", "end", "wake"


class Upstream:
    """POST ``path`` to ``worker`` with ``content`` (JSON bytes); :meth:`start` sends it.

    Args:
        pool: the ``WorkerPool`` (told when the worker cannot be reached).
        client: the proxy's HTTP client.
        headers: request headers to send (the client's, filtered).
        metrics: a ``RouterMetrics`` or None.
    """

    def __init__(self, pool, client: httpx.AsyncClient, worker: Worker, path: str,
                 content: bytes, headers: dict[str, str] | None = None, metrics=None):
        self.pool = pool
        self.client = client
        self.worker = worker
        self.path = path
        self.content = content
        self.headers = dict(headers or {})
        self.headers["content-type"] = "application/json"
        self.metrics = metrics
        self.error: RouterError | None = None
        self.status: int | None = None
        self.response_headers: httpx.Headers | None = None
        self._queue: asyncio.Queue = asyncio.Queue(maxsize=QUEUE_CHUNKS)
        self._task: asyncio.Task | None = None
        self._finished = False

    # ------------------------------------------------------------------ control
    def start(self) -> "Upstream":
        self.worker.inflight.add(self)
        if self.metrics is not None:
            self.metrics.request_sent(self.worker)
        self._task = asyncio.create_task(self._run(), name=f"upstream {self.worker.url}")
        return self

    def fail(self, err: RouterError) -> None:
        """End the request with ``err``: its reader gets it after the chunks already queued."""
        if self._finished:
            return
        self._finished = True
        self.error = err
        self.worker.inflight.discard(self)
        if self.metrics is not None:
            self.metrics.proxy_error(self.worker, err.kind)
        if self._task is not None and self._task is not asyncio.current_task():
            self._task.cancel()
        try:
            self._queue.put_nowait((_WAKE,))
        except asyncio.QueueFull:  # the reader is busy with the queue: it sees the error next
            pass

    async def close(self) -> None:
        """Stop the request (the connection to the worker closes) and wait for its task."""
        self._finished = True
        self.worker.inflight.discard(self)
        t = self._task
        if t is not None and not t.done():
            t.cancel()
            try:
                await t
            except BaseException:  # noqa: BLE001 - cancelled or failed: either way it ended
                pass

    @property
    def done(self) -> bool:
        return self._finished

    # ------------------------------------------------------------------ reading
    async def _get(self) -> tuple:
        while True:
            if self._queue.empty() and self.error is not None:
                raise self.error
            item = await self._queue.get()
            if item[0] != _WAKE:
                return item

    async def head(self) -> int:
        """Wait for the response's status (its headers in ``response_headers``).

        Raises:
            RouterError: the request failed before the worker answered.
        """
        item = await self._get()
        assert item[0] == _HEAD
        return self.status

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body's chunks as they arrive (after :meth:`head`).

        Raises:
            RouterError: the request failed mid-body.
        """
        while True:
            item = await self._get()
            if item[0] == _END:
                return
            yield item[1]

    async def read(self) -> bytes:
        """The whole body (after :meth:`head`). Raises RouterError."""
        parts = [c async for c in self.chunks()]
        return b"".join(parts)

    # ------------------------------------------------------------------ the task
    async def _run(self) -> None:
        w = self.worker
        try:
            req = self.client.build_request("POST", w.url + self.path, content=self.content,
                                            headers=self.headers)
            try:
                resp = await self.client.send(req, stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                self.fail(RouterError(502, f"cannot connect to worker {w.url}: "
                                           f"{type(e).__name__}: {e}", "connect"))
                self.pool.mark_down(w, f"connect: {type(e).__name__}")
                return
            try:
                self.status = resp.status_code
                self.response_headers = resp.headers
                await self._queue.put((_HEAD,))
                async for chunk in resp.aiter_bytes():
                    await self._queue.put((_DATA, chunk))
            finally:
                await resp.aclose()
            self._finished = True
            w.inflight.discard(self)
            await self._queue.put((_END,))
        except asyncio.CancelledError:
            raise
        except httpx.HTTPError as e:
            # the connection broke (or timed out) mid-request: this request fails; the worker
            # is polled at once and marked down if it cannot be reached
            self.fail(RouterError(502, f"connection to worker {w.url} lost: "
                                       f"{type(e).__name__}: {e}", "reset"))
            self.pool.probe_soon(w)
        except Exception as e:  # noqa: BLE001 - a bug must still answer the client
            logger.exception("request to %s failed", w.url)
            self.fail(RouterError(502, f"request to worker {w.url} failed: "
                                       f"{type(e).__name__}: {e}", "bad_response"))
