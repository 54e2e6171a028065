"""JSON request bodies must be UTF-8 (RFC 8259 8.1); one that is not gets HTTP 400 with
OpenAI's error body naming the first bad byte, before anything parses it.

Without this, Python's ``json.loads`` takes bytes in UTF-16 or UTF-32 (it guesses the encoding)
and CESU-8 encoded surrogates (it decodes with ``surrogatepass``; the tokenizer then fails on
them), and FastAPI answers other invalid bytes with a bare "There was an error parsing the
body". The body is checked as it arrives, with an incremental decoder (nothing is buffered).
"""
from __future__ import annotations

import codecs

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send


def is_json(scope: Scope) -> bool:
    """The request says its body is JSON (``application/json`` or ``application/*+json``)."""
    for k, v in scope.get("headers", ()):
        if k == b"content-type":
            media = v.split(b";", 1)[0].strip().lower()
            return media == b"application/json" or (media.startswith(b"application/")
                                                     and media.endswith(b"+json"))
    return False


class Utf8BodyMiddleware:
    """Pure ASGI middleware: a JSON request body that is not valid UTF-8 makes ``receive``
    raise an ``HTTPException(400)`` (FastAPI re-raises those from its body read; the app's
    handler renders OpenAI's error body). A UTF-8 byte order mark is valid UTF-8 and passes."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_json(scope):
            await self.app(scope, receive, send)
            return
        decoder = codecs.getincrementaldecoder("utf-8")()
        seen = 0  # body bytes passed before this message

        async def checked_receive() -> Message:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                body = msg.get("body", b"")
                pending = len(decoder.getstate()[0])  # an incomplete sequence held back
                try:
                    decoder.decode(body, final=not msg.get("more_body", False))
                except UnicodeDecodeError as e:
                    at = seen - pending + e.start
                    raise HTTPException(400, f"request body is not valid UTF-8: byte "
                                             f"0x{e.object[e.start]:02x} at offset {at} "
                                             f"({e.reason}); JSON must be sent as UTF-8"
                                        ) from None
                seen += len(body)
            return msg

        await self.app(scope, checked_receive, send)
