"""Request bodies over ``--max-request-body-bytes`` get HTTP 413 in the API's error shape (the
server's and the router's front door).

A body announced larger by its Content-Length is refused before a byte of it is read (the
server then discards the rest it is sent, and the connection stays open for the next request);
a chunked body is counted as it arrives and refused as soon as it passes the limit, before
anything parses or tokenizes it.
"""
from __future__ import annotations

import json

from starlette.types import ASGIApp, Receive, Scope, Send

from sloserve.config import DEFAULT_MAX_BODY_BYTES
from sloserve.error_shapes import error_for

__all__ = ["DEFAULT_MAX_BODY_BYTES", "BodyLimitMiddleware", "BodyTooLarge"]


class BodyTooLarge(BaseException):
    """A BaseException: FastAPI turns any Exception raised while it reads a body into a 400."""


class BodyLimitMiddleware:
    """Pure ASGI middleware: a request body over ``limit`` bytes gets 413 (by its
    Content-Length at once, or as soon as a chunked body passes the limit), before anything
    parses or tokenizes it."""

    def __init__(self, app: ASGIApp, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for k, v in scope.get("headers", ()):
            if k == b"content-length" and v.isdigit() and int(v) > self.limit:
                await self._reject(scope, send, int(v))
                return
        seen, started = 0, False

        async def limited_receive():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.limit:
                    raise BodyTooLarge()
            return msg

        async def tracking_send(msg):
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)
        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge:
            if not started:
                await self._reject(scope, send, seen)

    async def _reject(self, scope: Scope, send: Send, size: int) -> None:
        body = json.dumps(error_for(scope.get("path", ""), 413, (
            f"request body of {size} bytes is over the limit of {self.limit} bytes "
            f"(--max-request-body-bytes)")), ensure_ascii=True, separators=(",", ":")).encode()
        await send({"type": "http.response.start", "status": 413, "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
