"""Run the OpenAI-compatible server: this process serves HTTP, the engine core runs in its own.

    from sloserve.config import EngineConfig
    from sloserve.server.api_server import run_server
    run_server(EngineConfig(dtype="float32"), host="0.0.0.0", port=8000)

Thread placement on a small CPU: the engine core's torch uses every core (``--num-threads``
changes it); this process keeps torch to one thread and does no math, so its event loop, the
tokenizer and the SSE streams take what the core's OpenMP threads leave between steps.

Shutdown: the first SIGTERM or SIGINT drains: new generation requests and ``/health`` get 503,
requests in flight run to completion for up to ``drain_timeout_s``, then the server closes its
connections, stops the engine core and exits 0. A second signal exits at once.
If the engine core dies, requests in flight end with an error (503 or an SSE error event) and
``/health`` answers 503; the server keeps answering so a supervisor sees it.
"""
from __future__ import annotations

import asyncio
import logging
import time

import uvicorn

from sloserve.config import EngineConfig
from sloserve.server.app import create_engine_and_app

logger = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    """uvicorn's server with a drain before the shutdown (see the module docstring)."""

    def __init__(self, config: uvicorn.Config, app_state, drain_timeout_s: float):
        super().__init__(config)
        self.app_state = app_state
        self.drain_timeout_s = drain_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig, frame) -> None:
        # not recorded in _captured_signals: uvicorn would re-raise it after the shutdown and
        # the process would die of it instead of exiting 0
        if self._draining or self._loop is None or not self.started:
            self.should_exit = True
            self.force_exit = self._draining
            return
        self._draining = True
        self.app_state.draining = True
        logger.info("draining: %d requests in flight, up to %.0f s",
                    self.app_state.in_flight.count, self.drain_timeout_s)
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.drain_timeout_s
        while self.app_state.in_flight.count > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.app_state.in_flight.count:
            logger.warning("drain timeout: %d requests still in flight are cut",
                           self.app_state.in_flight.count)
        self.should_exit = True


def run_server(config: EngineConfig, host: str = "127.0.0.1", port: int = 8000,
               log_level: str = "info", drain_timeout_s: float = 30.0,
               step_trace: str | None = None) -> None:
    """Start the engine core, serve HTTP until SIGINT / SIGTERM, drain, stop.

    Blocks until the server stops.

    Args:
        config: the engine configuration.
        host: interface to bind ("0.0.0.0" for all).
        port: TCP port.
        log_level: uvicorn / sloserve log level ("debug", "info", "warning", ...).
        drain_timeout_s: most seconds requests in flight get to finish on shutdown.
        step_trace: the engine core writes one JSON line per step to this file.

    Raises:
        FileNotFoundError / ValueError / OSError: the engine core refused the model or settings.
        EngineCoreStartError: the core crashed while starting.
        OSError: the port cannot be bound.
    """
    import torch

    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)  # this process does no math; the cores are the engine core's
    engine, app = create_engine_and_app(config, manage_engine=True, step_trace=step_trace,
                                        log_level=log_level)
    logger.info("serving %s on http://%s:%d (max_model_len %d)", engine.model_name, host, port,
                engine.max_model_len)
    server = DrainingServer(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                           timeout_graceful_shutdown=5), app.state,
                            drain_timeout_s)
    try:
        server.run()  # lifespan shutdown stops the engine core
    finally:
        engine.shutdown()  # idempotent; covers a failed startup (e.g. port in use)
