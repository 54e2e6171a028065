"""One generation's HTTP flow, shared by ``/v1/completions`` and ``/v1/chat/completions``.

The endpoints differ only in their JSON shapes; each has a :class:`ResponseBuilder` (stream
chunk, usage chunk, the events before the first token, the whole response) and both run through
:func:`stream_response` or :func:`whole_response`.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from sloserve.engine.async_llm import AsyncLLM
from sloserve.engine.messages import EngineCoreRequest
from sloserve.engine.outputs import RequestOutput
from sloserve.server.disconnect import ClientDisconnected, run_until_disconnect
from sloserve.server.errors import APIError, engine_error
from sloserve.server.protocol import (ChatCompletionChoice, ChatCompletionResponse,
                                      ChatCompletionStreamChoice, ChatCompletionStreamResponse,
                                      ChatResponseMessage, CompletionChoice, CompletionResponse,
                                      CompletionStreamResponse, DeltaMessage, UsageInfo)
from sloserve.server.sse import DONE, SSEResponse, sse

logger = logging.getLogger(__name__)

_CLIENT_CLOSED = 499  # nginx's "client closed request"; nobody reads it


@dataclass
class CompletionBuilder:
    """JSON shapes of ``/v1/completions``."""

    id: str
    created: int
    model: str

    def preamble(self) -> list[str]:
        return []

    def chunk(self, text: str, finish_reason: str | None) -> str:
        return sse(CompletionStreamResponse(
            id=self.id, created=self.created, model=self.model,
            choices=[CompletionChoice(text=text, finish_reason=finish_reason)]))

    def usage_chunk(self, usage: UsageInfo) -> str:
        return sse(CompletionStreamResponse(id=self.id, created=self.created, model=self.model,
                                            choices=[], usage=usage))

    def response(self, final: RequestOutput, text: str) -> BaseModel:
        return CompletionResponse(
            id=self.id, created=self.created, model=self.model,
            choices=[CompletionChoice(text=text, finish_reason=final.finish_reason)],
            usage=UsageInfo.from_output(final))


@dataclass
class ChatBuilder:
    """JSON shapes of ``/v1/chat/completions``."""

    id: str
    created: int
    model: str

    def preamble(self) -> list[str]:
        """The role chunk, sent with the first token (as vLLM does), so a client that times the
        first event with choices measures the real TTFT."""
        return [sse(ChatCompletionStreamResponse(
            id=self.id, created=self.created, model=self.model,
            choices=[ChatCompletionStreamChoice(delta=DeltaMessage(role="assistant",
                                                                   content=""))]))]

    def chunk(self, text: str, finish_reason: str | None) -> str:
        delta = DeltaMessage(content=text) if text else DeltaMessage()
        return sse(ChatCompletionStreamResponse(
            id=self.id, created=self.created, model=self.model,
            choices=[ChatCompletionStreamChoice(delta=delta, finish_reason=finish_reason)]))

    def usage_chunk(self, usage: UsageInfo) -> str:
        return sse(ChatCompletionStreamResponse(id=self.id, created=self.created,
                                                model=self.model, choices=[], usage=usage))

    def response(self, final: RequestOutput, text: str) -> BaseModel:
        return ChatCompletionResponse(
            id=self.id, created=self.created, model=self.model,
            choices=[ChatCompletionChoice(message=ChatResponseMessage(content=text),
                                          finish_reason=final.finish_reason)],
            usage=UsageInfo.from_output(final))


ResponseBuilder = CompletionBuilder | ChatBuilder


def _error_event(err: APIError) -> str:
    return sse(err.body().model_dump())  # a dict: rendered ASCII-safe


async def _events(engine: AsyncLLM, req: EngineCoreRequest, include_usage: bool,
                  b: ResponseBuilder) -> AsyncIterator[str]:
    """SSE events of one request: preamble with the first output, content chunks, optional
    usage, ``[DONE]``; a failure mid-stream is an error event before ``[DONE]``."""
    first = b.preamble()
    usage: UsageInfo | None = None
    try:
        async with contextlib.aclosing(engine.generate(req)) as outs:
            async for out in outs:
                if out.error:
                    logger.error("request %s failed: %s", req.request_id, out.error)
                    yield _error_event(APIError(500, out.error))
                    break
                for ev in first:
                    yield ev
                first = []
                if out.finished:
                    yield b.chunk(out.new_text, out.finish_reason)
                    usage = UsageInfo.from_output(out)
                elif out.new_text:
                    yield b.chunk(out.new_text, None)
    except Exception as e:  # engine died or refused (CancelledError is not an Exception)
        yield _error_event(engine_error(e))
    else:
        if include_usage and usage is not None:
            yield b.usage_chunk(usage)
    yield DONE


def stream_response(engine: AsyncLLM, req: EngineCoreRequest, include_usage: bool,
                    b: ResponseBuilder) -> Response:
    """The streamed (SSE) answer; a client that disconnects aborts the request."""
    return SSEResponse(_events(engine, req, include_usage, b))


async def whole_response(engine: AsyncLLM, req: EngineCoreRequest, raw: Request,
                         b: ResponseBuilder) -> Response:
    """Run a non-streamed request to the end and answer its JSON.

    Raises:
        APIError: 500 when the engine failed the request, 503 when the core is down. A client
            that went away gets no body (the request is aborted).
    """
    try:
        outs = await run_until_disconnect(lambda: engine.generate(req), raw)
    except ClientDisconnected:
        logger.info("client disconnected, aborted %s", req.request_id)
        return Response(status_code=_CLIENT_CLOSED)
    except Exception as e:
        raise engine_error(e) from e
    final = outs[-1]
    if final.error:
        raise APIError(500, final.error)
    return JSONResponse(b.response(final, "".join(o.new_text for o in outs)).model_dump())
