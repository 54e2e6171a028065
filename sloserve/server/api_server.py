"""Run the OpenAI-compatible server: this process serves HTTP, the engine core runs in its own.

    from sloserve.config import EngineConfig
    from sloserve.server.api_server import run_server
    run_server(EngineConfig(dtype="float32"), host="0.0.0.0", port=8000)

Thread placement on a small CPU: the engine core's torch uses every core it may (affinity and
cgroup quota; ``--num-threads`` fixes the count) and its OpenMP threads spin only briefly before
they sleep; this process imports no torch and does no math, so its event loop, the tokenizer
and the SSE streams take what the core's threads leave between steps.

Start: the port is bound first (a busy port or a bad host is one error line before any model
loads); SIGTERM / SIGINT while the model loads stop the engine core and exit 0.

Shutdown: the first SIGTERM or SIGINT drains: new generation requests and ``/health`` get 503,
requests in flight run to completion for up to ``drain_timeout_s``; those still running then
(or at a second signal) end with a 503 error body or an SSE error event and ``[DONE]``; the
server closes its connections, stops the engine core and exits 0.
If the engine core dies, requests in flight end with an error (503 or an SSE error event) and
``/health`` answers 503; the server keeps answering so a supervisor sees it.
"""
from __future__ import annotations

import asyncio
import logging
import math
import signal
import socket
import time

import uvicorn

from sloserve.config import EngineConfig
from sloserve.server.app import DEFAULT_MAX_BODY_BYTES, create_engine_and_app
from sloserve.server.tools import ChatConfig

logger = logging.getLogger(__name__)


class StartupInterrupted(BaseException):
    """SIGTERM / SIGINT arrived while the model was loading.

    A BaseException (like KeyboardInterrupt) so that the loaders' ``except Exception`` clauses,
    which turn a library's error into "cannot build the tokenizer of ...", let it through: a
    signal that lands inside one must stop the server (exit 0), not report a broken model."""


class DrainingServer(uvicorn.Server):
    """uvicorn's server with a drain before the shutdown (see the module docstring)."""

    def __init__(self, config: uvicorn.Config, app_state, engine, drain_timeout_s: float,
                 pending_signals: list[int] | None = None):
        super().__init__(config)
        self.pending_signals = pending_signals if pending_signals is not None else []
        self.app_state, self.engine = app_state, engine
        self.drain_timeout_s = drain_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        if self.pending_signals:  # SIGTERM / SIGINT between the model load and now: stop
            logger.info("%s before serving: stopping", signal.Signals(self.pending_signals[0]).name)
            self.should_exit = True
        await super().serve(sockets)

    def handle_exit(self, sig, frame) -> None:
        # not recorded in _captured_signals: uvicorn would re-raise it after the shutdown and
        # the process would die of it instead of exiting 0
        if self._loop is None or not self.started:
            self.should_exit = True
            return
        if self._draining:  # a second signal: end what is in flight now
            self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._finish()))
            return
        self._draining = True
        self.app_state.draining = True
        logger.info("draining: %d requests in flight, up to %.0f s",
                    self.app_state.in_flight.count, self.drain_timeout_s)
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.drain_timeout_s
        while self.app_state.in_flight.count > 0 and time.monotonic() < deadline:
            if self.should_exit:
                return
            await asyncio.sleep(0.05)
        await self._finish()

    async def _finish(self) -> None:
        """End the requests still in flight with a proper error, let their handlers answer,
        then exit."""
        if self.should_exit:
            return
        n = self.engine.fail_in_flight("the server is shutting down")
        if n:
            logger.warning("drain ended: %d requests in flight get 503", n)
            deadline = time.monotonic() + 2.0
            while self.app_state.in_flight.count > 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
        self.should_exit = True


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket on host:port. Raises OSError with one line naming them."""
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(info[0], socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(info[4])
        sock.listen(2048)
    except OSError as e:
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def run_server(config: EngineConfig, host: str = "127.0.0.1", port: int = 8000,
               log_level: str = "info", drain_timeout_s: float = 30.0,
               step_trace: str | None = None,
               max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               chat: ChatConfig | None = None, goodput: dict[str, float] | None = None) -> None:
    """Start the engine core, serve HTTP until SIGINT / SIGTERM, drain, stop.

    Blocks until the server stops.

    Args:
        config: the engine configuration.
        host: interface to bind ("0.0.0.0" for all).
        port: TCP port.
        log_level: uvicorn / sloserve log level ("debug", "info", "warning", ...).
        drain_timeout_s: most seconds requests in flight get to finish on shutdown.
        step_trace: the engine core writes one JSON line per step to this file.
        max_request_body_bytes: larger request bodies get 413.
        chat: the chat endpoint's tool calling, reasoning and template flags.
        goodput: the per-request SLO the SLO counters judge by (ms limits by metric).

    Raises:
        FileNotFoundError / ValueError / OSError: the engine core refused the model or the
            settings, a bad drain timeout or body limit, or the port cannot be bound.
        EngineCoreStartError: the core crashed while starting.
    """
    if not (isinstance(drain_timeout_s, (int, float)) and math.isfinite(drain_timeout_s)
            and drain_timeout_s >= 0):
        raise ValueError(f"--shutdown-timeout must be a finite number of seconds >= 0, got "
                         f"{drain_timeout_s}")
    if not (isinstance(max_request_body_bytes, int) and max_request_body_bytes >= 1):
        raise ValueError(f"--max-request-body-bytes must be an integer >= 1, got "
                         f"{max_request_body_bytes}")
    if chat is not None:
        chat.validate()
    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sock = _listen(host, port)

    # every signal is remembered first: the exception can be swallowed where it lands (raised
    # inside a __del__ it is only printed, "Exception ignored in ..."), and then the server,
    # once loaded, starts and stops at once instead of serving on
    pending: list[int] = []

    def interrupted(sig, frame):
        pending.append(sig)
        raise StartupInterrupted(signal.Signals(sig).name)
    old = {s: signal.signal(s, interrupted) for s in (signal.SIGTERM, signal.SIGINT)}
    engine = None
    try:
        engine, app = create_engine_and_app(config, manage_engine=True, step_trace=step_trace,
                                            log_level=log_level,
                                            max_request_body_bytes=max_request_body_bytes,
                                            chat=chat, goodput=goodput)
    except StartupInterrupted:
        pass  # in pending; the load cleaned up after itself
    finally:
        # until uvicorn installs its own handlers, a signal is remembered (the server then
        # starts and stops at once), never the default death
        for s in old:
            signal.signal(s, lambda sig, frame: pending.append(sig))
    if pending:  # raised out of the load, or swallowed where it landed and the load went on
        logger.info("%s while the model was loading: stopped", signal.Signals(pending[0]).name)
        if engine is not None:
            engine.shutdown()
        sock.close()
        return
    logger.info("serving %s on http://%s:%d (max_model_len %d)", engine.model_name, host, port,
                engine.max_model_len)
    server = DrainingServer(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=2),
                            app.state, engine, drain_timeout_s, pending)
    try:
        server.run(sockets=[sock])  # lifespan shutdown stops the engine core
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        engine.shutdown()  # idempotent
        sock.close()
