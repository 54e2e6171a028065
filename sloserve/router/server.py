"""``sloserve router``'s process: the app under uvicorn until SIGTERM / SIGINT."""
from __future__ import annotations

import logging

import uvicorn

from sloserve.router.app import build_app
from sloserve.router.config import RouterConfig


def run_router(config: RouterConfig) -> None:
    """Serve until stopped. Raises ValueError for bad settings (before listening)."""
    if config.log_level.lower() != "debug":  # not a line per health poll
        logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("sloserve.router").setLevel(config.log_level.upper())
    app = build_app(config)
    uvicorn.run(app, host=config.host, port=config.port, log_level=config.log_level,
                timeout_graceful_shutdown=5)
