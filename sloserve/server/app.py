"""Wiring: the FastAPI app over an AsyncLLM (routes, error handlers, in-flight accounting,
request-body checks: size in body_limit.py, UTF-8 in utf8_body.py).

The engine core runs in its own process; this process does HTTP, validation, tokenization, chat
templates, detokenization, stop strings and SSE. A client that disconnects, streaming or not,
queued or running, has its request aborted (the core frees its KV blocks before its next step).
"""
from __future__ import annotations

import contextlib
import logging

from fastapi import FastAPI
from prometheus_fastapi_instrumentator import Instrumentator
from starlette.types import ASGIApp, Receive, Scope, Send

from sloserve.config import EngineConfig
from sloserve.engine.async_llm import AsyncLLM
from sloserve.body_limit import DEFAULT_MAX_BODY_BYTES, BodyLimitMiddleware
from sloserve.server.errors import install_error_handlers
from sloserve.roofline.step import served_roofline
from sloserve.server.metrics import PrometheusStatLogger
from sloserve.server.openapi import install_openapi_constraints
from sloserve.server.routes import build_router
from sloserve.server.tools import ChatConfig
from sloserve.server.utf8_body import Utf8BodyMiddleware

logger = logging.getLogger(__name__)


class InFlightCounter:
    """HTTP requests in progress (a streamed response counts until its last byte): what a
    graceful shutdown waits for."""

    def __init__(self):
        self.count = 0


class InFlightMiddleware:
    """Pure ASGI middleware keeping an :class:`InFlightCounter`."""

    def __init__(self, app: ASGIApp, counter: InFlightCounter):
        self.app = app
        self.counter = counter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        self.counter.count += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.counter.count -= 1


def build_app(engine: AsyncLLM, metrics: PrometheusStatLogger, *,
              manage_engine: bool = False,
              max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              chat: ChatConfig | None = None) -> FastAPI:
    """The FastAPI app serving ``engine``.

    Args:
        engine: the AsyncLLM to serve (its stat loggers should include ``metrics``).
        metrics: the Prometheus exporter rendered at ``/metrics``; bound here to the engine's
            model name, max_model_len and token budget.
        manage_engine: start the engine on app startup and shut it down on app shutdown.
        max_request_body_bytes: larger request bodies get 413 (in the API's error shape, the
            connection kept); a JSON body that is not UTF-8 gets 400.
        chat: the chat endpoint's tool calling, reasoning and template flags (None: off).

    Returns:
        The app, its routes counted by endpoint at ``/metrics`` as vLLM's are
        (``http_requests_total{handler=...}``); ``app.state.engine``, ``app.state.metrics``, ``app.state.in_flight`` (requests
        in progress) and ``app.state.draining`` are set.
    """
    metrics.bind(engine.model_name, engine.max_model_len, engine.info.max_num_batched_tokens)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if manage_engine:
            engine.start()
            app.state.spec_checker.warm()  # (a served app: its first structured request waits less)
        try:
            yield
        finally:
            app.state.spec_checker.close()
            if manage_engine:
                logger.info("shutting down the engine")
                engine.shutdown()

    app = FastAPI(title="sloserve", summary="OpenAI-compatible LLM server", lifespan=lifespan)
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.draining = False
    app.state.in_flight = InFlightCounter()
    app.add_middleware(Utf8BodyMiddleware)  # the last added runs first: limit, then UTF-8
    app.add_middleware(BodyLimitMiddleware, limit=max_request_body_bytes)
    app.add_middleware(InFlightMiddleware, counter=app.state.in_flight)
    install_error_handlers(app)
    app.include_router(build_router(engine, metrics, app.state, chat or ChatConfig()))
    install_openapi_constraints(app, engine)
    # vLLM's per-endpoint HTTP metrics (http_requests_total{handler,method,status},
    # http_request_duration_seconds, ...), by route template, in the exporter's registry
    Instrumentator(excluded_handlers=["/metrics", "/health", "/stats", "/stats/stream"],
                   registry=metrics.registry).instrument(app)
    return app


def create_engine_and_app(config: EngineConfig, *, manage_engine: bool = False,
                          step_trace: str | None = None, log_level: str = "info",
                          max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                          chat: ChatConfig | None = None,
                          goodput: dict[str, float] | None = None) -> tuple[AsyncLLM, FastAPI]:
    """Start an engine core process for ``config``, an AsyncLLM with a Prometheus exporter in
    front of it (counting the requests that meet the ``goodput`` SLO, ms limits by metric,
    ``sloserve.slo``), and its app.

    Returns:
        (engine, app); the engine runs. Call ``engine.shutdown()`` when done.

    Raises:
        FileNotFoundError / ValueError / OSError: the core refused the model or the settings.
        EngineCoreStartError: the core crashed while starting.
    """
    spec = config.speculative
    metrics = PrometheusStatLogger(max_num_batched_tokens=config.max_num_batched_tokens,
                                   num_speculative_tokens=spec.num_speculative_tokens if spec
                                   else 0, slos=goodput)
    engine = AsyncLLM(config, stat_loggers=[metrics], step_trace=step_trace, log_level=log_level)
    info = engine.info
    metrics.roofline = served_roofline(info.model_shape, info.dtype, info.kv_cache_dtype)
    app = build_app(engine, metrics, manage_engine=manage_engine,
                    max_request_body_bytes=max_request_body_bytes, chat=chat)
    engine.start()
    return engine, app
