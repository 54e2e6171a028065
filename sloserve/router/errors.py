"""The router's errors, in the shape of the API asked (the servers' own,
``sloserve.error_shapes``: OpenAI's, Anthropic's on ``/v1/messages``), as a JSON response or,
once a stream has started, as that API's error event."""
from __future__ import annotations

import json

from fastapi.responses import Response

from sloserve.error_shapes import error_for, is_anthropic, stream_error

DONE = b"data: [DONE]\n\n"


def error_response(status: int, message: str, param: str | None = None,
                   headers: dict | None = None, path: str = "") -> Response:
    return Response(json.dumps(error_for(path, status, message, param), ensure_ascii=True),
                    status_code=status, media_type="application/json", headers=headers)


class RouterError(Exception):
    """A request the router could not complete.

    Args:
        status: the HTTP status the client gets (502: a worker failed it, 503: no worker).
        message: what happened (names the worker).
        kind: what for the metrics and the retry logic: ``connect`` (nothing was sent: another
            worker may take the request), ``worker_down`` (its worker was marked down while
            the request was in flight), ``reset`` (the connection broke mid-request),
            ``prefill_failed`` (the prefill half of a disaggregated request failed),
            ``no_worker``, ``bad_response``.
        body, content_type: a worker's own error answer, passed to the client as it came.
    """

    def __init__(self, status: int, message: str, kind: str = "bad_response", *,
                 body: bytes | None = None, content_type: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.body = body
        self.content_type = content_type

    def response(self, path: str = "") -> Response:
        """The answer to a request to ``path``: the worker's own error body, else the router's
        in that API's shape."""
        if self.body is not None:
            return Response(self.body, status_code=self.status,
                            media_type=self.content_type or "application/json")
        return error_response(self.status, self.message, path=path)

    def sse(self, path: str = "") -> bytes:
        """The error event(s) that end a stream to ``path`` already under way (a worker's own
        OpenAI error body is passed on in the chunk)."""
        body = None
        if self.body is not None:
            try:
                body = json.loads(self.body)
            except ValueError:
                body = None
        if not (is_anthropic(path) or path.startswith("/v1/responses")) and \
                isinstance(body, dict) and isinstance(body.get("error"), dict):
            return b"data: " + json.dumps(body, ensure_ascii=True).encode() + b"\n\n" + DONE
        return stream_error(path, self.status, self.message)
