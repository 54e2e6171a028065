"""Server-sent events: the event format and a streaming response that always closes its body."""
from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import anyio
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = "data: [DONE]\n\n"


def sse(payload: Any) -> str:
    """One SSE event ``data: <json>\\n\\n`` from a pydantic model or a dict (non-ASCII
    escaped in dicts, which carry error messages that may quote the client's input)."""
    if hasattr(payload, "model_dump_json"):
        return f"data: {payload.model_dump_json()}\n\n"
    return f"data: {json.dumps(payload, ensure_ascii=True)}\n\n"


class SSEResponse(StreamingResponse):
    """StreamingResponse that always closes its body generator when the response ends.

    Starlette cancels the streaming task when the client disconnects; if that happens while the
    task waits in ``send`` rather than in the generator, the generator would stay suspended until
    garbage collection. Closing it here runs its ``finally`` at once, which leaves
    ``engine.generate`` early and so aborts the request.
    """

    media_type = "text/event-stream"

    def __init__(self, content, *args, on_close: Callable[[], None] | None = None, **kw):
        """``on_close``: called once the response ended, however (after the body closed)."""
        super().__init__(content, *args, **kw)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()
            if self._on_close is not None:
                self._on_close()
