"""The router's errors, in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``
(the servers' own), as a JSON response or, once a stream has started, as an SSE error event
followed by ``data: [DONE]``."""
from __future__ import annotations

import json

from fastapi.responses import Response

_TYPES = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowedError",
          500: "InternalServerError", 502: "BadGatewayError", 503: "ServiceUnavailableError",
          504: "GatewayTimeoutError"}

DONE = b"data: [DONE]\n\n"


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "APIError"),
                      "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None,
                   headers: dict | None = None) -> Response:
    return Response(json.dumps(error_body(status, message, param), ensure_ascii=True),
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

    def response(self) -> Response:
        if self.body is not None:
            return Response(self.body, status_code=self.status,
                            media_type=self.content_type or "application/json")
        return error_response(self.status, self.message)

    def sse(self) -> bytes:
        """The error event and ``[DONE]`` that end a stream already under way."""
        body = None
        if self.body is not None:
            try:
                body = json.loads(self.body)
            except ValueError:
                body = None
        if not (isinstance(body, dict) and isinstance(body.get("error"), dict)):
            body = error_body(self.status, self.message)
        return b"data: " + json.dumps(body, ensure_ascii=True).encode() + b"\n\n" + DONE
