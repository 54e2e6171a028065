"""The error bodies of the APIs served, chosen by the path asked: the server and the router
both answer in them.

OpenAI's ``{"error": {"message", "type", "param", "code"}}`` everywhere but Anthropic's
Messages routes (``/v1/messages...``), which get ``{"type": "error", "error": {"type",
"message"}}``. A stream already under way ends with the API's own error event: OpenAI's error
chunk and ``data: [DONE]``; Anthropic's ``event: error``; the Responses API's ``event: error``.
"""
from __future__ import annotations

import json
from typing import Any

#: OpenAI's error type of each status (the ``openai`` client's exception class names)
OPENAI_TYPES = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowedError",
                413: "RequestTooLargeError", 429: "RateLimitError", 499: "ClientClosedRequest",
                500: "InternalServerError", 502: "BadGatewayError",
                503: "ServiceUnavailableError", 504: "GatewayTimeoutError"}

#: Anthropic's error type of each status
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                   403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
                   413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                   502: "api_error", 503: "overloaded_error", 504: "api_error",
                   529: "overloaded_error"}


def is_anthropic(path: str) -> bool:
    return path.startswith("/v1/messages")


def openai_error(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": OPENAI_TYPES.get(status, "APIError"),
                      "param": param, "code": status}}


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(status, "api_error"),
                                       "message": message}}


def error_for(path: str, status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """The error body a request to ``path`` gets."""
    return anthropic_error(status, message) if is_anthropic(path) else \
        openai_error(status, message, param)


def _dumps(body: dict) -> str:
    return json.dumps(body, ensure_ascii=True)


def stream_error(path: str, status: int, message: str, param: str | None = None) -> bytes:
    """The server-sent events that end a stream to ``path`` already under way with an error."""
    if is_anthropic(path):
        return f"event: error\ndata: {_dumps(anthropic_error(status, message))}\n\n".encode()
    if path.startswith("/v1/responses"):
        body = {"type": "error", "code": str(status), "message": message, "param": param}
        return f"event: error\ndata: {_dumps(body)}\n\n".encode()
    return f"data: {_dumps(openai_error(status, message, param))}\n\ndata: [DONE]\n\n".encode()


def validation_message(exc) -> tuple[str, str | None]:
    """(message, param) of a FastAPI ``RequestValidationError`` (malformed JSON or schema
    mismatch)."""
    errors = exc.errors()
    for e in errors:
        if e.get("type") == "json_invalid":
            detail = (e.get("ctx") or {}).get("error")
            return (f"malformed JSON body: {e.get('msg')}" + (f" ({detail})" if detail else ""),
                    None)
    parts, param = [], None
    for e in errors:
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        if param is None and loc and not loc[0].isdigit():
            param = loc[0]
        parts.append(f"{'.'.join(loc) or 'body'}: {e.get('msg')}")
    n = len(errors)
    head = f"{n} validation error{'s' if n != 1 else ''}: " if n else "invalid request: "
    return head + "; ".join(parts), param
