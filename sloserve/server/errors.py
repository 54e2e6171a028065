"""The error model: OpenAI's body ``{"error": {"message", "type", "param", "code"}}``.

400 BadRequestError for invalid parameters and malformed / schema-invalid JSON (FastAPI's 422
becomes 400) or a JSON body that is not UTF-8, 413 RequestTooLargeError for a body over
``--max-request-body-bytes``, 404 NotFoundError for an unknown model (naming the served one) or
route, 405 MethodNotAllowedError for a route asked with a method it lacks, 500
InternalServerError when the engine failed a request (an engine fault, never the client's),
503 ServiceUnavailableError while the
engine core is not running or the server drains, 429 RateLimitError (with ``Retry-After``) when
overload control refuses a request. Only validation errors are 4xx, and one the engine finds:
a structured-output spec that no string satisfies (400, as the first token is sampled).
"""
from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from sloserve.engine.async_llm import EngineDeadError, EngineShutdownError
from sloserve.error_shapes import OPENAI_TYPES, error_for, is_anthropic, validation_message
from sloserve.server.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)



class ErrorJSONResponse(JSONResponse):
    """JSON with non-ASCII escaped: an error message may quote the client's input, and input
    with a lone surrogate (valid JSON escapes, invalid UTF-8) must still render."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


class APIError(Exception):
    """An error to answer with OpenAI's error body.

    Args:
        status: HTTP status code (400, 404, 500, 503, ...).
        message: human-readable message.
        param: the offending request field, if any.
    """

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers

    @property
    def type(self) -> str:
        return OPENAI_TYPES.get(self.status, "APIError")

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type,
                                             param=self.param, code=self.status))

    def response(self, headers: dict | None = None) -> JSONResponse:
        return ErrorJSONResponse(self.body().model_dump(), status_code=self.status,
                                 headers=headers if headers is not None else self.headers)


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    """A JSONResponse with OpenAI's error body (type derived from the status code)."""
    return APIError(status, message, param).response()


def engine_error(e: BaseException) -> APIError:
    """What a failure inside the engine means for the client: 503 while the core is down, 500
    for anything else (an engine fault; the client's mistakes were refused before)."""
    if isinstance(e, EngineShutdownError):
        return APIError(503, str(e))
    if isinstance(e, EngineDeadError):
        return APIError(503, f"engine is not running: {e}")
    logger.error("request failed: %s: %s", type(e).__name__, e, exc_info=e)
    return APIError(500, f"internal error: {type(e).__name__}: {e}")


def route_error_message(detail: str, method: str, path: str, headers: dict | None) -> str:
    """The message of the router's 404 / 405: what was asked for (the path cut at 200
    characters) and, for a 405, the methods its ``Allow`` header offers."""
    shown = path if len(path) <= 200 else path[:200] + "..."
    allow = (headers or {}).get("Allow") or (headers or {}).get("allow")
    return f"{detail}: {method} {shown}" + (f" (allowed: {allow})" if allow else "")


def _shaped(request: Request, err: APIError, headers: dict | None = None) -> JSONResponse:
    return shaped_response(request.url.path, err, headers)


def shaped_response(path: str, err: APIError, headers: dict | None = None) -> JSONResponse:
    """``err`` in the error shape of the API asked (by the request's ``path``): Anthropic's
    under ``/v1/messages``, else OpenAI's."""
    if is_anthropic(path):
        return ErrorJSONResponse(error_for(path, err.status, err.message), status_code=err.status,
                                 headers=headers if headers is not None else err.headers)
    return err.response(headers)


def install_error_handlers(app: FastAPI) -> None:
    """Answer APIError, validation errors and HTTP errors with OpenAI's body (Anthropic's on
    its Messages routes)."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return _shaped(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc)
        return _shaped(request, APIError(400, message, param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        headers = getattr(exc, "headers", None)
        message = str(exc.detail)
        if exc.status_code in (404, 405):  # the router's: no such route / method
            message = route_error_message(message, request.method, request.url.path, headers)
        return _shaped(request, APIError(exc.status_code, message), headers)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        return _shaped(request, engine_error(exc))  # an engine or server bug: 500, never 4xx
