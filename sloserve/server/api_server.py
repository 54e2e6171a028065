"""Run the OpenAI-compatible server with uvicorn.

    from sloserve.config import EngineConfig
    from sloserve.server.api_server import run_server
    run_server(EngineConfig(dtype="float32"), host="0.0.0.0", port=8000)

SIGINT / SIGTERM make uvicorn stop accepting connections, finish (or, after
``graceful_timeout_s``, drop) the open ones, and run the app's shutdown, which calls
``engine.shutdown()`` (the engine thread is joined) before the process exits.
"""
from __future__ import annotations

import logging

import uvicorn

from sloserve.config import EngineConfig
from sloserve.server.app import create_engine_and_app

logger = logging.getLogger(__name__)


def run_server(config: EngineConfig, host: str = "127.0.0.1", port: int = 8000,
               log_level: str = "info", graceful_timeout_s: float = 5.0,
               step_trace: str | None = None) -> None:
    """Load the model, start the engine and serve HTTP until SIGINT / SIGTERM.

    Blocks until the server stops. Open streams get `graceful_timeout_s` seconds to finish on
    shutdown; then they are dropped (their requests are aborted) and the engine is shut down.

    Args:
        config: the engine configuration.
        host: interface to bind ("0.0.0.0" for all).
        port: TCP port.
        log_level: uvicorn / sloserve log level ("debug", "info", "warning", ...).
        graceful_timeout_s: seconds to wait for open connections on shutdown.
        step_trace: write one JSON line per engine step to this file (``--step-trace``).

    Raises:
        FileNotFoundError / ValueError: the engine could not be built (missing model, bad settings).
        OSError: the port cannot be bound.
    """
    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine, app = create_engine_and_app(config, manage_engine=True, step_trace=step_trace)
    logger.info("serving %s on http://%s:%d (max_model_len %d)", engine.model_name, host, port,
                engine.max_model_len)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                           timeout_graceful_shutdown=graceful_timeout_s))
    try:
        server.run()  # installs SIGINT / SIGTERM handlers; lifespan shutdown stops the engine
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it handled once it has shut down
        pass
    finally:
        engine.shutdown()  # idempotent; covers a failed startup (e.g. port in use)
