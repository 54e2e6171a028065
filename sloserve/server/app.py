"""The OpenAI-compatible HTTP front end (FastAPI) of an AsyncLLM.

Endpoints:
    POST /v1/completions        text completion (streamed as SSE with ``"stream": true``)
    POST /v1/chat/completions   chat completion through the model's chat template
    GET  /v1/models             the served model
    GET  /health                200 while the engine thread is alive, 503 otherwise
    GET  /metrics               Prometheus text format

Errors use OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: 400 BadRequestError
for invalid parameters and malformed / schema-invalid JSON (FastAPI's 422 becomes 400), 404
NotFoundError for an unknown model, 500 InternalServerError when the engine failed the request,
503 ServiceUnavailableError when the engine thread is not running. A failure mid-stream is sent
as an SSE event ``data: {"error": {...}}`` followed by ``data: [DONE]``.

A client that disconnects, streaming or not, queued or running, has its request aborted (the
engine frees its KV blocks before the next step).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from sloserve.engine.async_engine import AsyncLLM, EngineDeadError
from sloserve.engine.outputs import RequestOutput
from sloserve.engine.request import Request as EngineRequest
from sloserve.sampling_params import ParamError
from sloserve.server.metrics import CONTENT_TYPE_LATEST, PrometheusStatLogger
from sloserve.server.protocol import (ChatCompletionChoice, ChatCompletionRequest,
                                      ChatCompletionResponse, ChatCompletionStreamChoice,
                                      ChatCompletionStreamResponse, ChatResponseMessage,
                                      CompletionChoice, CompletionRequest, CompletionResponse,
                                      CompletionStreamResponse, DeltaMessage, ErrorInfo,
                                      ErrorResponse, ModelCard, ModelList, UsageInfo, now_s,
                                      random_id)

logger = logging.getLogger(__name__)

_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 499: "ClientClosedRequest",
                500: "InternalServerError", 503: "ServiceUnavailableError"}
_CLIENT_CLOSED = 499  # nginx's "client closed request"; nobody reads it


class APIError(Exception):
    """An error to answer with OpenAI's error body.

    Args:
        status: HTTP status code (400, 404, 500, 503, ...).
        message: human-readable message.
        param: the offending request field, if any.
    """

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    @property
    def type(self) -> str:
        return _ERROR_TYPES.get(self.status, "APIError")

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type,
                                             param=self.param, code=self.status))


class ClientDisconnected(Exception):
    """The HTTP client went away before the response was ready."""


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    """A JSONResponse with OpenAI's error body (type derived from the status code)."""
    err = APIError(status, message, param)
    return JSONResponse(err.body().model_dump(), status_code=status)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """(message, param) of a FastAPI validation error (malformed JSON or schema mismatch)."""
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


class _SSEResponse(StreamingResponse):
    """StreamingResponse that always closes its body generator when the response ends.

    Starlette cancels the streaming task when the client disconnects; if that happens while the
    task waits in ``send`` rather than in the generator, the generator would stay suspended until
    garbage collection. Closing it here runs its ``finally`` at once, which leaves
    ``engine.generate`` early and so aborts the request.
    """

    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()


def _sse(payload: Any) -> str:
    """One SSE event ``data: <json>\\n\\n`` from a pydantic model or a dict."""
    if hasattr(payload, "model_dump_json"):
        return f"data: {payload.model_dump_json()}\n\n"
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _engine_exception_to_api_error(e: Exception) -> APIError:
    if isinstance(e, EngineDeadError):
        return APIError(503, f"engine is not running: {e}")
    if isinstance(e, ValueError):  # rejected when queued (duplicate id, over capacity)
        return APIError(400, str(e))
    logger.exception("request failed", exc_info=e)
    return APIError(500, f"internal error: {type(e).__name__}: {e}")


async def _wait_for_disconnect(raw: Request) -> None:
    """Return when the ASGI server reports ``http.disconnect`` (the body is already read)."""
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return


async def _generate_all(engine: AsyncLLM, req: EngineRequest, raw: Request
                        ) -> tuple[RequestOutput, str]:
    """Run a request to completion, racing it against a client disconnect.

    Returns:
        (final output, full text).

    Raises:
        ClientDisconnected: the client went away (the request was aborted, KV blocks freed).
        APIError: the engine failed or rejected the request.
    """

    async def consume() -> tuple[RequestOutput, str]:
        parts: list[str] = []
        last: RequestOutput | None = None
        async with contextlib.aclosing(engine.generate(req)) as outs:
            async for out in outs:
                if out.new_text:
                    parts.append(out.new_text)
                last = out
        assert last is not None
        return last, "".join(parts)

    gen_task = asyncio.ensure_future(consume())
    disc_task = asyncio.ensure_future(_wait_for_disconnect(raw))
    try:
        await asyncio.wait({gen_task, disc_task}, return_when=asyncio.FIRST_COMPLETED)
        if gen_task.done():
            try:
                return gen_task.result()
            except Exception as e:
                raise _engine_exception_to_api_error(e) from e
        raise ClientDisconnected()
    finally:
        for t in (gen_task, disc_task):
            if not t.done():
                t.cancel()
        # wait for the cancelled generation to leave engine.generate (that queues the abort)
        with anyio.CancelScope(shield=True):
            await asyncio.gather(gen_task, disc_task, return_exceptions=True)


def _stream_error_event(err: APIError) -> str:
    return _sse(err.body())


def build_app(engine: AsyncLLM, metrics: PrometheusStatLogger, *,
              manage_engine: bool = False) -> FastAPI:
    """The FastAPI app serving `engine`.

    Args:
        engine: the AsyncLLM to serve (its stat loggers should include `metrics`).
        metrics: the Prometheus exporter rendered at ``/metrics``; bound here to the engine's
            model name and max_model_len.
        manage_engine: start the engine on app startup and shut it down on app shutdown (the
            standalone server uses this so SIGINT / SIGTERM stop the engine thread).

    Returns:
        The FastAPI application (``app.state.engine`` and ``app.state.metrics`` are set).
    """
    metrics.bind(engine.model_name, engine.max_model_len,
                 getattr(getattr(engine.engine, "config", None), "max_num_batched_tokens", None))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if manage_engine:
            engine.start()
        try:
            yield
        finally:
            if manage_engine:
                logger.info("shutting down the engine")
                await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="sloserve", summary="OpenAI-compatible LLM server", lifespan=lifespan)
    app.state.engine = engine
    app.state.metrics = metrics
    model_name = engine.model_name

    # --------------------------------------------------------------------------- error handlers
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body().model_dump(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(APIError(exc.status_code, str(exc.detail)).body().model_dump(),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    # ----------------------------------------------------------------------------- helpers
    def check_model(requested: str | None) -> None:
        if requested is not None and requested != model_name:
            raise APIError(404, f"The model `{requested}` does not exist.", "model")

    def check_running() -> None:
        if not engine.is_running:
            raise APIError(503, "engine is not running")

    def make_request(prompt: str | list[int], body, request_id: str) -> EngineRequest:
        try:
            body.unsupported()
            params = body.to_sampling_params()
            return engine.make_request(prompt, params, request_id)
        except ParamError as e:
            param = e.param
            if param == "max_tokens" and isinstance(body, ChatCompletionRequest):
                param = body.max_tokens_param
            raise APIError(400, str(e), param) from e
        except ValueError as e:  # e.g. a model without tokenizer given a text prompt
            raise APIError(400, str(e), "prompt") from e

    async def stream_events(req: EngineRequest, include_usage: bool,
                            first: list[str], chunk: Callable[[str, str | None], str],
                            usage_chunk: Callable[[UsageInfo], str]) -> AsyncIterator[str]:
        """SSE events of one request: `first`, content chunks, optional usage, [DONE].

        `first` (the chat role chunk) goes out with the first engine output, as vLLM sends it,
        so a client that times the first event with choices measures the real TTFT.
        """
        usage: UsageInfo | None = None
        try:
            async with contextlib.aclosing(engine.generate(req)) as outs:
                async for out in outs:
                    if out.error:
                        logger.error("request %s failed: %s", req.request_id, out.error)
                        yield _stream_error_event(APIError(500, out.error))
                        break
                    for ev in first:
                        yield ev
                    first = []
                    if out.finished:
                        yield chunk(out.new_text, out.finish_reason)
                        usage = UsageInfo.of(out.num_prompt_tokens, out.num_output_tokens)
                    elif out.new_text:
                        yield chunk(out.new_text, None)
        except Exception as e:  # engine rejected / died (CancelledError is not an Exception)
            yield _stream_error_event(_engine_exception_to_api_error(e))
        else:
            if include_usage and usage is not None:
                yield usage_chunk(usage)
        yield "data: [DONE]\n\n"

    # ------------------------------------------------------------------------------ routes
    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        """200 while the engine thread is alive, 503 otherwise."""
        if engine.is_running:
            return Response(status_code=200)
        return error_response(503, "engine is not running")

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        """Prometheus text exposition; queue and KV gauges are refreshed at scrape time."""
        core = engine.engine
        with contextlib.suppress(Exception):  # live view; the step records stay authoritative
            metrics.set_queue_sizes(len(core.scheduler.running), len(core.scheduler.waiting))
            metrics.set_kv_usage(core.kv.usage)
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", response_model=ModelList)
    async def list_models() -> ModelList:
        """The served model (one entry)."""
        return ModelList(data=[ModelCard(id=model_name, root=engine.model_path,
                                         max_model_len=engine.max_model_len)])

    async def respond_whole(req: EngineRequest, raw: Request,
                            build: Callable[[RequestOutput, str], Any]) -> Response:
        """Run a non-streamed request to the end; `build(final_output, text)` makes the body.

        Raises APIError(500) when the engine failed the request; a client that went away gets
        no body (the request is aborted)."""
        try:
            final, text = await _generate_all(engine, req, raw)
        except ClientDisconnected:
            logger.info("client disconnected, aborted %s", req.request_id)
            return Response(status_code=_CLIENT_CLOSED)
        if final.error:
            raise APIError(500, final.error)
        return JSONResponse(build(final, text).model_dump())

    @app.post("/v1/completions", response_model=None)
    async def create_completion(body: CompletionRequest, raw: Request) -> Response:
        """OpenAI text completion. Errors: 400 (parameters), 404 (model), 500 (engine), 503."""
        check_model(body.model)
        check_running()
        rid = random_id("cmpl")
        created = now_s()
        try:
            prompt = body.single_prompt()
        except ParamError as e:
            raise APIError(400, str(e), e.param) from e
        req = make_request(prompt, body, rid)

        if body.stream:
            def chunk(text: str, finish_reason: str | None) -> str:
                return _sse(CompletionStreamResponse(
                    id=rid, created=created, model=model_name,
                    choices=[CompletionChoice(text=text, finish_reason=finish_reason)]))

            def usage_chunk(usage: UsageInfo) -> str:
                return _sse(CompletionStreamResponse(id=rid, created=created, model=model_name,
                                                     choices=[], usage=usage))

            return _SSEResponse(stream_events(req, body.include_usage, [], chunk, usage_chunk))

        return await respond_whole(req, raw, lambda final, text: CompletionResponse(
            id=rid, created=created, model=model_name,
            choices=[CompletionChoice(text=text, finish_reason=final.finish_reason)],
            usage=UsageInfo.of(final.num_prompt_tokens, final.num_output_tokens)))

    @app.post("/v1/chat/completions", response_model=None)
    async def create_chat_completion(body: ChatCompletionRequest, raw: Request) -> Response:
        """OpenAI chat completion via the chat template. Errors: 400, 404, 500, 503."""
        check_model(body.model)
        check_running()
        rid = random_id("chatcmpl")
        created = now_s()
        tok = engine.tokenizer
        if tok is None:
            raise APIError(400, "this model has no tokenizer, so no chat template", "messages")
        try:
            body.unsupported()
            messages = [m.to_template_dict() for m in body.messages]
            ids = tok.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt)
        except ParamError as e:
            raise APIError(400, str(e), e.param) from e
        except Exception as e:  # no template (ValueError), template errors (jinja2), ...
            raise APIError(400, f"cannot apply the chat template: {e}", "messages") from e
        req = make_request(ids, body, rid)

        if body.stream:
            def chunk(text: str, finish_reason: str | None) -> str:
                delta = DeltaMessage(content=text) if text else DeltaMessage()
                return _sse(ChatCompletionStreamResponse(
                    id=rid, created=created, model=model_name,
                    choices=[ChatCompletionStreamChoice(delta=delta, finish_reason=finish_reason)]))

            def usage_chunk(usage: UsageInfo) -> str:
                return _sse(ChatCompletionStreamResponse(id=rid, created=created, model=model_name,
                                                         choices=[], usage=usage))

            first = _sse(ChatCompletionStreamResponse(
                id=rid, created=created, model=model_name,
                choices=[ChatCompletionStreamChoice(delta=DeltaMessage(role="assistant",
                                                                       content=""))]))
            return _SSEResponse(stream_events(req, body.include_usage, [first], chunk,
                                              usage_chunk))

        return await respond_whole(req, raw, lambda final, text: ChatCompletionResponse(
            id=rid, created=created, model=model_name,
            choices=[ChatCompletionChoice(message=ChatResponseMessage(content=text),
                                          finish_reason=final.finish_reason)],
            usage=UsageInfo.of(final.num_prompt_tokens, final.num_output_tokens)))

    return app


def create_engine_and_app(config, *, manage_engine: bool = False,
                          step_trace: str | None = None) -> tuple[AsyncLLM, FastAPI]:
    """Build an AsyncLLM with a Prometheus exporter wired in, start it, and build its app.

    Args:
        config: EngineConfig of the engine.
        manage_engine: also shut the engine down when the app shuts down (see build_app).
        step_trace: a file to write one JSON line per engine step to (StepTraceLogger).

    Returns:
        (engine, app); the engine thread is running. Call ``engine.shutdown()`` when done.

    Raises:
        FileNotFoundError / ValueError: from the engine constructor (missing model, bad settings).
        OSError: the step trace file cannot be opened.
    """
    metrics = PrometheusStatLogger(max_num_batched_tokens=config.max_num_batched_tokens)
    loggers: list = [metrics]
    if step_trace:
        from sloserve.engine.metrics import StepTraceLogger
        loggers.append(StepTraceLogger(step_trace))
    engine = AsyncLLM(config, stat_loggers=loggers)
    app = build_app(engine, metrics, manage_engine=manage_engine)
    engine.start()
    return engine, app
